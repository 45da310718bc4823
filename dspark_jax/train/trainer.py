"""Drafter training loop: optax AdamW, micro-step accumulation, online/offline target features,
orbax checkpoints with exact resume, held-out simulated τ, best-by-τ checkpoint.

    trainer = Trainer.for_drafter(train_cfg, drafter_cfg, target_params,
                                  train_data=samples, eval_data=held_out, run_dir="runs/x")
    result = trainer.run()          # resumes from run_dir/checkpoints if present

or, generic over any loss with the contract of `dspark_jax.train.losses`:

    Trainer(train_cfg, loss_fn, trainable, frozen, train_data=..., target_cfg=...,
            target_params=..., run_dir=...)

with `loss_fn(trainable, frozen, batch, rng) -> (loss, metrics)`; `batch` holds `input_ids`,
`loss_mask`, `attention_mask` [B, L] and `target_features` [B, L, m*H], `target_hidden`
[B, L, H] in the compute dtype. Metric keys ending in `_num` / `_den` are summed over batches and
divided at the end; `accept_num` / `accept_den` [γ] give the per-position 1 − TV.

One optimizer step = `accum_steps` calls of the jitted micro-step (one compilation per sequence
bucket: forward of the frozen target in online mode, loss, gradient, fp32 accumulation) and one
call of the jitted update (compiled once: mean gradient, global-norm clip, AdamW, schedule).
The gradient is the equal-weight mean over micro-batches of each micro-batch's token-weighted
loss (REFERENCE §4.3); a micro-batch is the global one over every device and process.

Determinism: the data order is a function of the stream position, the loss RNG of micro-step a
of update s is fold_in(fold_in(key(seed), s), a), and the optimizer state is restored exactly,
so a resumed run reproduces the uninterrupted loss trajectory bit for bit (same devices/flags).

Run directory: `config.json` (sidecar: every config of the run), `metrics.jsonl` (one line per
train step / evaluation), `checkpoints/` (latest steps for resume), `best/` (trainable params
of the best evaluation by `TrainConfig.best_metric`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dspark_jax import parallel
from dspark_jax.config import DrafterConfig, MeshConfig, TargetConfig, TrainConfig
from dspark_jax.errors import CheckpointError, ConfigError
from dspark_jax.train import loader as loader_lib
from dspark_jax.train import memory as memory_lib
from dspark_jax.train.checkpoint import Checkpointer, abstract_like
from dspark_jax.train.data import atomic_write
from dspark_jax.train.features import FeatureCacheReader, target_features

log = logging.getLogger(__name__)

LossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
_EVAL_STREAM = 0x7EA1  # folded into the base key for held-out evaluation


# ------------------------------------------------------------------------------------------------
# Optimizer


def lr_schedule(cfg: TrainConfig, total_steps: int) -> Callable[[jax.Array], jax.Array]:
    """REFERENCE §8: update s (0-indexed) uses lr·(s+1)/W for s < W, lr·½(1+cos(π(s−W)/(S−W)))
    for W ≤ s < S, 0 after; W = int(warmup_ratio·S)."""
    peak, s_total = cfg.learning_rate, int(total_steps)
    warm = int(cfg.warmup_ratio * s_total)

    def schedule(count):
        s = jnp.asarray(count, jnp.float32)
        warm_lr = peak * (s + 1.0) / max(warm, 1)
        frac = jnp.clip((s - warm) / max(s_total - warm, 1), 0.0, 1.0)
        cos_lr = peak * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
        return jnp.where(s < warm, warm_lr, cos_lr)

    return schedule


def make_optimizer(cfg: TrainConfig, total_steps: int) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW with the warmup-cosine schedule."""
    adamw = optax.adamw(
        lr_schedule(cfg, total_steps),
        b1=cfg.adam_b1,
        b2=cfg.adam_b2,
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
    )
    if cfg.grad_clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adamw)
    return adamw


# ------------------------------------------------------------------------------------------------
# Compatibility


def check_compatible(
    target_cfg: TargetConfig,
    drafter_cfg: DrafterConfig,
    *,
    target_params=None,
    frozen=None,
) -> None:
    """Raise `ConfigError` unless a drafter built for `drafter_cfg` can train on this target.

    Checks hidden size, vocabulary, the feature layers (same ids, inside the target's layers,
    never its last layer), the mask token (a row of the embedding) and, when given, the shapes of
    the target's embedding and of the drafter's frozen embedding / LM head.
    """
    d = drafter_cfg.target
    problems = []
    if d.hidden_size != target_cfg.hidden_size:
        problems.append(f"hidden size: drafter {d.hidden_size} vs target {target_cfg.hidden_size}")
    if d.vocab_size != target_cfg.vocab_size:
        problems.append(f"vocabulary: drafter {d.vocab_size} vs target {target_cfg.vocab_size}")
    bad = [i for i in d.target_layer_ids if not 0 <= i < target_cfg.num_layers - 1]
    if bad:
        problems.append(
            f"feature layer ids {bad} are outside the target's layers 0..{target_cfg.num_layers - 2}"
        )
    elif tuple(d.target_layer_ids) != tuple(target_cfg.target_layer_ids):
        problems.append(
            f"feature layer ids: drafter {d.target_layer_ids} vs target "
            f"{target_cfg.target_layer_ids}"
        )
    if drafter_cfg.kind != "eagle3" and not 0 <= drafter_cfg.mask_token_id < target_cfg.vocab_size:
        problems.append(
            f"mask token {drafter_cfg.mask_token_id} is not a row of the target embedding "
            f"(vocab {target_cfg.vocab_size})"
        )
    want = (target_cfg.vocab_size, target_cfg.hidden_size)
    if target_params is not None:
        emb = _get(target_params, "embed_tokens")
        if emb is not None and tuple(emb.shape) != want:
            problems.append(f"target embedding shape {tuple(emb.shape)} != config {want}")
    if frozen is not None:
        emb = _get(frozen, "embed_tokens")
        head = _get(frozen, "lm_head")
        if emb is not None and tuple(emb.shape) != want:
            problems.append(f"drafter frozen embedding shape {tuple(emb.shape)} != target {want}")
        if head is not None and tuple(head.shape) != want[::-1]:
            problems.append(f"drafter frozen lm_head shape {tuple(head.shape)} != {want[::-1]}")
    if problems:
        raise ConfigError(
            "drafter and target are incompatible: "
            + "; ".join(problems)
            + ". Build the drafter config from this target (DrafterConfig.dspark(target_cfg, ...))"
        )


def _get(tree, key):
    try:
        v = tree[key]
    except (KeyError, TypeError, IndexError):
        return None
    return v.get_value() if isinstance(v, nnx.Variable) else v


# ------------------------------------------------------------------------------------------------
# Metrics


def simulated_tau(accept_rate: Sequence[float]) -> float:
    """τ = 1 + Σ_k Π_{i≤k} a_i from per-position acceptance a_i = mean(1 − TV_i)."""
    return float(1.0 + np.sum(np.cumprod(np.asarray(accept_rate, np.float64))))


def _is_additive(key: str) -> bool:
    return key.endswith("_num") or key.endswith("_den")


def summarize(metric_sums: dict[str, np.ndarray], n_batches: int) -> dict[str, Any]:
    """Held-out metrics: additive pairs divided (x = x_num / x_den), other keys averaged over
    batches; adds `accept_rate` [γ] and `sim_tau` when `accept_num/den` exist."""
    out: dict[str, Any] = {}
    for k, v in metric_sums.items():
        if not _is_additive(k):
            out[k] = v / max(n_batches, 1)
    for k in metric_sums:
        if k.endswith("_num") and k[:-4] + "_den" in metric_sums:
            num, den = metric_sums[k], metric_sums[k[:-4] + "_den"]
            out[k[:-4]] = np.where(den > 0, num / np.where(den > 0, den, 1), 0.0)
    if "accept" in out:
        out["accept_rate"] = out.pop("accept")
    if "accept_rate" in out and np.ndim(out["accept_rate"]) == 1:
        out["sim_tau"] = simulated_tau(out["accept_rate"])
    return out


def _jsonable(v):
    a = np.asarray(v)
    if a.ndim == 0:
        return float(a) if a.dtype.kind == "f" else int(a)
    return a.tolist()


# ------------------------------------------------------------------------------------------------
# Jitted steps


class _Static:
    """A loss function as a hashable static jit argument.

    Equal `functools.partial(f, cfg)` objects compare equal, so Trainers that share a loss share
    compiled steps.
    """

    def __init__(self, fn: LossFn):
        self.fn = fn
        if isinstance(fn, functools.partial):
            key = (fn.func, fn.args, tuple(sorted(fn.keywords.items())))
        else:
            key = (fn,)
        try:
            hash(key)
        except TypeError:
            key = (id(fn),)
        self._key = key

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Static) and self._key == other._key


# The TrainConfig fields each compiled step reads; the others are reset in the static views so
# that runs differing only in intervals, seeds, data or optimizer settings share compilations.
_MICRO_FIELDS = ("compute_dtype", "feature_mode")
_UPDATE_FIELDS = (
    "learning_rate",
    "warmup_ratio",
    "adam_b1",
    "adam_b2",
    "adam_eps",
    "weight_decay",
    "grad_clip_norm",
    "global_batch_size",
    "micro_batch_size",
)


def _view(cfg: TrainConfig, fields) -> TrainConfig:
    return TrainConfig(**{f: getattr(cfg, f) for f in fields}, total_steps=1)


@dataclasses.dataclass(frozen=True)
class _StepSpec:
    """Everything static about the micro and eval steps (`train`: compute dtype, feature mode)."""

    loss: _Static
    train: TrainConfig
    target: TargetConfig | None

    @property
    def compute_dtype(self):
        return jnp.bfloat16 if self.train.compute_dtype == "bfloat16" else jnp.float32


def _cast_floats(tree, dtype):
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def _loss_batch(spec: _StepSpec, target_params, batch):
    cdt = spec.compute_dtype
    if spec.train.feature_mode == "online":
        feats, hidden = target_features(spec.target, target_params, batch["input_ids"])
    else:
        feats, hidden = batch["target_features"], batch["target_hidden"]
    # the loss contract (module docstring), checked at trace time: no runtime cost
    ids = batch["input_ids"]
    chex.assert_rank(ids, 2)
    chex.assert_type(ids, int)
    chex.assert_equal_shape([ids, batch["loss_mask"], batch["attention_mask"]])
    chex.assert_equal_shape_prefix([ids, feats, hidden], 2)
    if spec.target is not None:
        chex.assert_axis_dimension(feats, 2, spec.target.feature_size)
        chex.assert_axis_dimension(hidden, 2, spec.target.hidden_size)
    return {
        "input_ids": batch["input_ids"],
        "loss_mask": batch["loss_mask"],
        "attention_mask": batch["attention_mask"],
        "target_features": feats.astype(cdt),
        "target_hidden": hidden.astype(cdt),
    }


def _micro_rng(base_key, step, micro):
    return jax.random.fold_in(jax.random.fold_in(base_key, step), micro)


def train_micro_step(
    spec, trainable, frozen, target_params, grad_acc, metric_acc, batch, base_key, step, micro
):
    """One micro-batch: features, loss, gradient; adds the fp32 gradient and metrics into the
    (donated) accumulators. Static: `spec` and the batch shape [B, L] (one compilation per
    bucket). Arrays: everything else (`step`, `micro` int32 scalars select the loss RNG)."""
    lb = _loss_batch(spec, target_params, batch)
    rng = _micro_rng(base_key, step, micro)

    def f(tr):
        return spec.loss.fn(_cast_floats(tr, spec.compute_dtype), frozen, lb, rng)

    (loss, metrics), grads = jax.value_and_grad(f, has_aux=True)(trainable)
    grad_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_acc, grads)
    metrics = dict(metrics, loss=loss)
    metric_acc = {k: metric_acc[k] + jnp.asarray(metrics[k], jnp.float32) for k in metric_acc}
    return grad_acc, metric_acc


def train_apply_step(train_cfg, total_steps, trainable, opt_state, grad_acc, metric_acc, step):
    """Mean gradient over the step's micro-batches, clip, AdamW update (compiled once).

    Static: `train_cfg` (the optimizer/batch fields of the TrainConfig) and `total_steps`.
    Arrays: the rest.

    Returns new (trainable, opt_state), zeroed accumulators and the step's metrics: ratio metrics
    averaged over micro-batches, `_num`/`_den` summed, plus `grad_norm` (before clipping) and `lr`.
    """
    n = train_cfg.accum_steps
    grads = jax.tree.map(lambda g: g / n, grad_acc)
    tx = make_optimizer(train_cfg, total_steps)
    updates, opt_state = tx.update(grads, opt_state, trainable)
    trainable = optax.apply_updates(trainable, updates)
    metrics = {k: v if _is_additive(k) else v / n for k, v in metric_acc.items()}
    metrics["grad_norm"] = optax.global_norm(grads)
    metrics["lr"] = lr_schedule(train_cfg, total_steps)(step)
    zero = functools.partial(jax.tree.map, jnp.zeros_like)
    return trainable, opt_state, zero(grad_acc), zero(metric_acc), metrics


def eval_step(spec, trainable, frozen, target_params, batch, base_key, index):
    """Loss metrics of one held-out batch (no gradient). Static: `spec`, batch shape."""
    lb = _loss_batch(spec, target_params, batch)
    rng = jax.random.fold_in(jax.random.fold_in(base_key, _EVAL_STREAM), index)
    loss, metrics = spec.loss.fn(_cast_floats(trainable, spec.compute_dtype), frozen, lb, rng)
    return dict(metrics, loss=loss)


def _zeros_f32(tree):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)


class _TreeKey:
    """A pytree of shardings as a hashable key (treedef + leaves)."""

    def __init__(self, tree):
        leaves, treedef = jax.tree.flatten(tree)
        self.key = (treedef, tuple(leaves))

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, _TreeKey) and self.key == other.key


_JITS: dict = {}


def _jitted(fn, static, donate, out_shardings):
    """`jax.jit(fn)` with fixed output shardings, shared by every Trainer with the same layout.

    Pinning the outputs to the very sharding objects the inputs were placed with keeps the
    arguments' shardings identical from call to call, so each step compiles once per shape
    (without it, `P()` vs `P(None, None)` spellings of the same layout would retrace).
    """
    key = (fn, static, donate, _TreeKey(out_shardings))
    if key not in _JITS:
        _JITS[key] = jax.jit(
            fn, static_argnames=static, donate_argnames=donate, out_shardings=out_shardings
        )
    return _JITS[key]


# ------------------------------------------------------------------------------------------------
# Trainer


@dataclasses.dataclass
class TrainResult:
    step: int  # optimizer steps done in total (including before a resume)
    history: list[dict[str, Any]]  # train metrics of the steps run by this call
    evals: list[dict[str, Any]]  # evaluations run by this call
    best_score: float | None
    best_step: int | None
    resumed_from: int | None
    tokens: int = 0  # real (unpadded) training tokens of the steps run by this call
    seconds: float = 0.0  # wall time of those steps (with evaluations, without the final save)


def _shardings(tree, mesh):
    """Per-leaf NamedShardings: the logical-axis table for an `nnx.State`, else replicated."""
    if isinstance(tree, nnx.State):
        return parallel.param_shardings(tree, mesh)
    return jax.tree.map(lambda _: parallel.replicated(mesh), tree)


def data_shards(mesh, micro_batch: int) -> int:
    """Data shards of a run: one per process when process k's devices hold exactly rows
    [k·B/P, (k+1)·B/P) of every micro-batch (the usual layout: processes along data / fsdp),
    so each process reads only its own shard; else 1 (every process draws from all the data,
    still reading only the rows its devices hold)."""
    p = jax.process_count()
    if p == 1:
        return 1
    if micro_batch % p == 0:
        blk = micro_batch // p
        sharding = parallel.batch_sharding(mesh, (micro_batch, 1))
        ok = True
        for dev, idx in sharding.devices_indices_map((micro_batch, 1)).items():
            lo, hi, _ = idx[0].indices(micro_batch)
            k = dev.process_index
            ok &= k * blk <= lo and hi <= (k + 1) * blk
        if ok:
            return p
    log.warning(
        "the mesh does not give each of the %d processes its own block of batch rows (tensor "
        "axis across processes?): every process draws from the whole dataset",
        p,
    )
    return 1


class Trainer:
    """Trains `trainable` under `loss_fn` with the frozen parts (`frozen`, the target) held fixed.

    Construction validates everything (configs, drafter/target compatibility, datasets, an
    existing run directory's config) before writing anything, then restores the newest good
    checkpoint of `run_dir` when `resume` (default). `run()` trains to the end of the schedule
    (or `max_steps` more steps) and always leaves a checkpoint of where it stopped.

    Parameters are placed on `mesh` (default: every device, data parallel) through the
    logical-axis table of `dspark_jax.parallel`; batches are split over ("data", "fsdp").
    `trainable` is kept in fp32 (master weights); `frozen` and `target_params` are stored in the
    compute dtype. Only `trainable` enters the optimizer state.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        loss_fn: LossFn,
        trainable,
        frozen,
        *,
        train_data,
        run_dir: str | os.PathLike,
        target_cfg: TargetConfig | None = None,
        target_params=None,
        eval_data=None,
        mesh: jax.sharding.Mesh | None = None,
        drafter_cfg: DrafterConfig | None = None,
        resume: bool = True,
        sidecar: dict[str, Any] | None = None,
    ):
        cfg = memory_lib.resolve_dtypes(cfg)  # "auto" dtypes: bf16 on accelerators, f32 on CPU
        self.cfg = cfg
        self.drafter_cfg = drafter_cfg
        self.target_cfg = target_cfg
        # ---- validation: nothing is written before all of it passed
        if cfg.feature_mode == "online":
            if target_cfg is None or target_params is None:
                raise ConfigError(
                    "feature_mode='online' needs target_cfg and target_params (the frozen target "
                    "runs inside the train step); or build a feature cache and use 'offline'"
                )
        else:
            for name, d in (("train_data", train_data), ("eval_data", eval_data)):
                if d is not None and not isinstance(d, FeatureCacheReader):
                    raise ConfigError(
                        f"feature_mode='offline' needs {name} to be a FeatureCacheReader (build "
                        "one with features.write_feature_cache); or use feature_mode='online'"
                    )
                if d is not None and target_cfg is not None:
                    d.check_target(target_cfg)
            target_params = None
        if drafter_cfg is not None and target_cfg is not None:
            check_compatible(target_cfg, drafter_cfg, target_params=target_params, frozen=frozen)
        self.mesh = mesh if mesh is not None else parallel.make_mesh(MeshConfig())
        self.train_source = loader_lib.as_source(train_data)
        self.loader = loader_lib.DataLoader(
            self.train_source,
            global_batch=cfg.global_batch_size,
            micro_batch=cfg.micro_batch_size,
            buckets=cfg.seq_buckets,
            data_seed=cfg.data_seed,
            empty_sequences=cfg.empty_sequences,
            num_shards=data_shards(self.mesh, cfg.micro_batch_size),
        )
        self.eval_source = None if eval_data is None else loader_lib.as_source(eval_data)
        self.eval_plan = []
        if self.eval_source is not None:
            self.eval_plan = loader_lib.eval_batches(
                self.eval_source,
                batch_size=cfg.eval_batch_size,
                buckets=cfg.seq_buckets,
                max_batches=cfg.max_eval_batches,
            )
            if not self.eval_plan:
                raise loader_lib.DatasetError(
                    "the evaluation set has no sequence with a supervised token; pass other "
                    "held-out data or eval_data=None"
                )
        self.total_steps = cfg.total_steps or cfg.num_epochs * self.loader.steps_per_epoch
        shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        for name, b in (
            ("micro_batch_size", cfg.micro_batch_size),
            ("eval_batch_size", cfg.eval_batch_size),
        ):
            if b % shards:
                raise ConfigError(
                    f"TrainConfig.{name}={b} must be a multiple of the mesh's data x fsdp = "
                    f"{shards} (each device gets whole sequences)"
                )
        if min(self.mesh.shape.values()) > 1 and jax.default_backend() == "cpu":
            log.warning(
                "mesh %s has data, fsdp and tensor all > 1: XLA on CPU (jax 0.10.2) computes "
                "wrong gradients for some layouts there (tests/test_distributed.py::"
                "test_xla_gradient_on_a_2x2x2_mesh_is_correct); prefer at most two axes > 1",
                dict(self.mesh.shape),
            )
        self.spec = _StepSpec(_Static(loss_fn), _view(cfg, _MICRO_FIELDS), target_cfg)
        self._update_cfg = _view(cfg, _UPDATE_FIELDS)
        self.run_dir = Path(run_dir)
        self.sidecar = {
            "train": cfg.to_json(),
            "target": None if target_cfg is None else target_cfg.to_json(),
            "drafter": None if drafter_cfg is None else _drafter_json(drafter_cfg),
            "total_steps": self.total_steps,
            **(sidecar or {}),
        }
        ckpt_dir = self.run_dir / "checkpoints"
        if resume and ckpt_dir.exists():
            self._check_resumable(ckpt_dir)
        elif not resume and ckpt_dir.exists() and any(ckpt_dir.iterdir()):
            raise ConfigError(
                f"{ckpt_dir} already holds checkpoints and resume=False; use a new run_dir (or "
                "resume=True to continue that run)"
            )
        # ---- memory plan: printed, and refused when it cannot fit, before anything is placed
        self.is_main = jax.process_index() == 0
        cdt = self.spec.compute_dtype
        tdt = jnp.bfloat16 if cfg.target_dtype == "bfloat16" else jnp.float32
        repl = parallel.replicated(self.mesh)
        param_sh = _shardings(trainable, self.mesh)
        frozen_sh = _shardings(frozen, self.mesh)
        target_sh = None if target_params is None else _shardings(target_params, self.mesh)
        self.memory_plan = memory_lib.plan_memory(
            cfg,
            self.mesh,
            trainable=trainable,
            trainable_shardings=param_sh,
            frozen=frozen,
            frozen_shardings=frozen_sh,
            target_params=target_params,
            target_shardings=target_sh,
            target_cfg=target_cfg,
            drafter_cfg=drafter_cfg,
        )
        self.compiled_memory: dict[str, int] | None = None
        if cfg.memory_check != "off":
            if self.is_main:
                print(self.memory_plan.summary(), flush=True)
            memory_lib.check_fits(cfg, self.memory_plan, self.mesh, target_cfg, drafter_cfg)
        # ---- state
        self.trainable = jax.device_put(_cast_floats(trainable, jnp.float32), param_sh)
        self.frozen = jax.device_put(_cast_floats(frozen, cdt), frozen_sh)
        self.target_params = None
        if target_params is not None:
            self.target_params = jax.device_put(_cast_floats(target_params, tdt), target_sh)
        tx = make_optimizer(cfg, self.total_steps)
        # Adam moments live where their parameters live; counters are replicated.
        opt_sh = optax.tree_utils.tree_map_params(
            tx,
            lambda _, sh: sh,
            jax.eval_shape(tx.init, self.trainable),
            param_sh,
            transform_non_params=lambda _: repl,
        )
        self.opt_state = jax.jit(tx.init, out_shardings=opt_sh)(self.trainable)
        self._zeros = _jitted(_zeros_f32, (), (), param_sh)
        self._micro = _jitted(
            train_micro_step, ("spec",), ("grad_acc", "metric_acc"), (param_sh, repl)
        )
        self._apply = _jitted(
            train_apply_step,
            ("train_cfg", "total_steps"),
            ("trainable", "opt_state", "grad_acc", "metric_acc"),
            (param_sh, opt_sh, param_sh, repl, repl),
        )
        self._eval = _jitted(eval_step, ("spec",), (), repl)
        self.base_key = jax.random.key(cfg.seed)
        self.step = 0
        self.best_score: float | None = None
        self.best_step: int | None = None
        self.resumed_from: int | None = None
        self._metric_keys = None
        self._saved_step: int | None = None
        # ---- run directory
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt = Checkpointer(
            ckpt_dir, max_to_keep=cfg.keep_checkpoints, async_save=cfg.async_checkpoint
        )
        self.best_ckpt = Checkpointer(
            self.run_dir / "best", max_to_keep=1, async_save=cfg.async_checkpoint
        )
        if resume:
            self._restore()
        check = cfg.memory_check
        if check == "compiled" or (check == "auto" and jax.default_backend() != "cpu"):
            self._check_compiled_memory()
        if self.is_main:
            with atomic_write(self.run_dir / "config.json") as f:
                json.dump(self.sidecar, f, indent=1, default=str)
            self._trim_metrics_log()

    # -- construction helpers ----------------------------------------------------------------------

    @classmethod
    def for_drafter(
        cls,
        cfg: TrainConfig,
        drafter_cfg: DrafterConfig,
        target_params,
        *,
        train_data,
        run_dir,
        eval_data=None,
        mesh=None,
        seed: int | None = None,
        resume: bool = True,
    ) -> Trainer:
        """A DSpark / DFlash / Eagle3 drafter (`drafter_cfg.kind`) initialised for its target
        (`drafter_cfg.target`), trained with `train.losses.loss_fn`. `target_params` is the
        target's `nnx.State` (also the source of the frozen embedding / LM head copies)."""
        from dspark_jax.drafters import init_params
        from dspark_jax.train import losses

        if cfg.anchor_chunk >= 0 and drafter_cfg.kind != "eagle3":
            # a chunk of all anchors or more is no chunking
            chunk = cfg.anchor_chunk if cfg.anchor_chunk < drafter_cfg.num_anchors else 0
            drafter_cfg = drafter_cfg.replace(anchor_chunk=chunk)
        check_compatible(drafter_cfg.target, drafter_cfg, target_params=target_params)
        params = init_params(drafter_cfg, seed=seed, target_params=target_params)
        return cls(
            cfg,
            functools.partial(losses.loss_fn, drafter_cfg),
            params.trainable,
            params.frozen,
            train_data=train_data,
            eval_data=eval_data,
            run_dir=run_dir,
            target_cfg=drafter_cfg.target,
            target_params=target_params,
            mesh=mesh,
            drafter_cfg=drafter_cfg,
            resume=resume,
        )

    def _check_resumable(self, ckpt_dir: Path) -> None:
        """Refuse to resume a run whose trajectory-defining config differs (before any write)."""
        side = self.run_dir / "config.json"
        if not side.exists():
            return
        try:
            old = json.loads(side.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(
                f"{side} is corrupt ({e}); restore it or use a new run_dir"
            ) from e
        cur = json.loads(json.dumps(self.sidecar, default=str))
        diffs = []
        for k in sorted(set(old) | set(cur)):
            a, b = old.get(k), cur.get(k)
            if k == "train" and isinstance(a, dict) and isinstance(b, dict):
                for f in sorted(set(a) | set(b)):
                    if f not in TrainConfig.RESUMABLE_CHANGES and a.get(f) != b.get(f):
                        diffs.append(f"train.{f}: {a.get(f)!r} -> {b.get(f)!r}")
            elif a != b:
                diffs.append(f"{k} differs")
        if diffs:
            raise ConfigError(
                f"{self.run_dir} holds a run with another configuration ({'; '.join(diffs)}); "
                "use a new run_dir, pass resume=False to a fresh directory, or restore the config"
            )

    def _state(self):
        return {"trainable": self.trainable, "opt_state": self.opt_state}

    def _restore(self) -> None:
        got = self.ckpt.restore(abstract_like(self._state()))
        if got is None:
            return
        step, state, meta = got
        self.trainable, self.opt_state = state["trainable"], state["opt_state"]
        self.step = int(meta["step"])
        if int(meta["data_position"]) != self.step * self.cfg.global_batch_size:
            raise CheckpointError(
                f"checkpoint {step}: data position {meta['data_position']} does not match "
                f"step x global_batch_size; the batch size changed, use a new run_dir"
            )
        key_data = np.asarray(meta["rng"], np.uint32)
        self.base_key = jax.random.wrap_key_data(key_data)
        self.best_score, self.best_step = meta.get("best_score"), meta.get("best_step")
        self.resumed_from = self._saved_step = step
        # best checkpoints from after the restored step belong to the discarded future: the
        # resumed run recomputes them (bit for bit), so they are written again if still best
        self.best_ckpt.drop_steps_after(step)
        log.info("resumed from %s step %d", self.ckpt.directory, step)

    def _trim_metrics_log(self) -> None:
        """Drop log lines of steps after the restored checkpoint (they will be redone)."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        keep = []
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line of a killed run
            if rec.get("step", 0) <= self.step:
                keep.append(line)
        with atomic_write(path) as f:
            f.write("".join(x + "\n" for x in keep))

    def _check_compiled_memory(self) -> None:
        """Compile the micro-step for the largest bucket ahead of time and compare XLA's
        per-device memory analysis with the plan; refuse when XLA's total exceeds the limit."""
        proto = self.train_source.get(int(self.loader.usable[0]))
        shape = (self.cfg.micro_batch_size, max(self.cfg.seq_buckets))
        batch = {}
        for name, v in dict(proto, attention_mask=np.zeros((1,), np.uint8)).items():
            full = shape + tuple(np.shape(v)[1:])
            sh = parallel.batch_sharding(self.mesh, full)
            batch[name] = jax.ShapeDtypeStruct(full, np.asarray(v).dtype, sharding=sh)
        grad_acc, metric_acc = self._init_accumulators(batch)
        lowered = self._micro.lower(
            self.spec,
            self.trainable,
            self.frozen,
            self.target_params,
            grad_acc,
            metric_acc,
            batch,
            self.base_key,
            np.int32(0),
            np.int32(0),
        )
        got = memory_lib.compiled_bytes(lowered.compile())
        self.compiled_memory = got
        if got is None:
            return
        plan = self.memory_plan
        if self.is_main:
            print(
                f"XLA memory analysis of the micro-step per device: arguments "
                f"{got['argument'] / memory_lib.GIB:.2f} GiB, temporaries "
                f"{got['temp'] / memory_lib.GIB:.2f} GiB (plan: activations + logits "
                f"{(plan.activations + plan.logits) / memory_lib.GIB:.2f} GiB)",
                flush=True,
            )
        if plan.limit is not None and got["total"] > memory_lib.HEADROOM * plan.limit:
            compiled_plan = dataclasses.replace(
                plan, activations=got["temp"], logits=0, params=got["argument"], optimizer=0
            )
            memory_lib.check_fits(
                self.cfg, compiled_plan, self.mesh, self.target_cfg, self.drafter_cfg
            )

    # -- data --------------------------------------------------------------------------------------

    def _device_batch(self, source, mb: loader_lib.MicroBatch) -> dict[str, jax.Array]:
        """Global [B, L, ...] arrays; each process reads only the rows of its own devices."""
        b, length = mb.shape
        local = parallel.batch_sharding(self.mesh, (b, length)).addressable_devices_indices_map(
            (b, length)
        )
        cache: dict[tuple, dict[str, np.ndarray]] = {}
        for idx in local.values():
            sl = idx[0]
            k = sl.indices(b)
            if k not in cache:
                cache[k] = loader_lib.load_rows(source, mb, sl, pad_id=self.cfg.pad_id)
        fields = next(iter(cache.values()))
        out = {}
        for name, v in fields.items():
            shape = (b, length) + tuple(v.shape[2:])
            sharding = parallel.batch_sharding(self.mesh, shape)

            def cb(index, name=name):
                return cache[index[0].indices(b)][name][(slice(None),) + tuple(index[1:])]

            out[name] = jax.make_array_from_callback(shape, sharding, cb)
        return out

    # -- training ----------------------------------------------------------------------------------

    def _init_accumulators(self, batch):
        grad_acc = self._zeros(self.trainable)
        if self._metric_keys is None:
            spec = self.spec

            def shapes(tr, fr, tp, b, k):
                lb = _loss_batch(spec, tp, b)
                loss, m = spec.loss.fn(_cast_floats(tr, spec.compute_dtype), fr, lb, k)
                return dict(m, loss=loss)

            out = jax.eval_shape(
                shapes, self.trainable, self.frozen, self.target_params, batch, self.base_key
            )
            self._metric_keys = {k: v.shape for k, v in out.items()}
        metric_acc = {
            k: jax.device_put(np.zeros(s, np.float32), parallel.replicated(self.mesh))
            for k, s in self._metric_keys.items()
        }
        return grad_acc, metric_acc

    def run(self, max_steps: int | None = None, *, save_at_end: bool = True) -> TrainResult:
        """Train until the schedule ends (or `max_steps` more steps), evaluating, logging and
        checkpointing at the configured intervals; ends with a committed checkpoint (unless
        `save_at_end=False`, for benchmarks)."""
        cfg = self.cfg
        end = (
            self.total_steps if max_steps is None else min(self.total_steps, self.step + max_steps)
        )
        history: list[dict[str, Any]] = []
        evals: list[dict[str, Any]] = []
        pending: list[tuple[int, dict[str, jax.Array]]] = []
        bar = None
        if cfg.progress_bar and self.is_main and end > self.step:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step")
        grad_acc = metric_acc = None
        t0, tokens = time.perf_counter(), 0

        def flush():
            if not pending:
                return
            host = jax.device_get([m for _, m in pending])
            lines = []
            for (s, _), m in zip(pending, host):
                rec = {"step": s, "split": "train", **{k: _jsonable(v) for k, v in m.items()}}
                history.append(rec)
                lines.append(rec)
            pending.clear()
            self._log(lines)
            if bar is not None:
                last = lines[-1]
                bar.set_postfix(loss=f"{last['loss']:.4f}", lr=f"{last['lr']:.2e}")

        while self.step < end:
            s = self.step
            micro = self.loader.micro_batches(s * cfg.global_batch_size)
            for a, mb in enumerate(micro):
                batch = self._device_batch(self.train_source, mb)
                if grad_acc is None:
                    grad_acc, metric_acc = self._init_accumulators(batch)
                grad_acc, metric_acc = self._micro(
                    self.spec,
                    self.trainable,
                    self.frozen,
                    self.target_params,
                    grad_acc,
                    metric_acc,
                    batch,
                    self.base_key,
                    np.int32(s),
                    np.int32(a),
                )
                tokens += int(self.train_source.lengths[mb.indices[mb.indices >= 0]].sum())
            self.trainable, self.opt_state, grad_acc, metric_acc, metrics = self._apply(
                self._update_cfg,
                self.total_steps,
                self.trainable,
                self.opt_state,
                grad_acc,
                metric_acc,
                np.int32(s),
            )
            self.step = s + 1
            pending.append((self.step, metrics))
            if bar is not None:
                bar.update(1)
            if cfg.log_interval and self.step % cfg.log_interval == 0:
                flush()
            if cfg.eval_interval and self.step % cfg.eval_interval == 0 and self.eval_plan:
                flush()
                evals.append(self.evaluate())
            if cfg.checkpoint_interval and self.step % cfg.checkpoint_interval == 0:
                flush()
                self.save()
        flush()  # fetches the last step's metrics: every dispatched step has finished
        dt = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        if save_at_end and self._saved_step != self.step:
            self.save()
        self.ckpt.wait()
        self.best_ckpt.wait()
        log.info("trained to step %d (%.1f tokens/s)", self.step, tokens / max(dt, 1e-9))
        return TrainResult(
            self.step,
            history,
            evals,
            self.best_score,
            self.best_step,
            self.resumed_from,
            tokens,
            dt,
        )

    def evaluate(self) -> dict[str, Any]:
        """Held-out metrics at the current step; saves `best/` when `best_metric` improved."""
        sums: dict[str, np.ndarray] = {}
        for i, mb in enumerate(self.eval_plan):
            batch = self._device_batch(self.eval_source, mb)
            m = jax.device_get(
                self._eval(
                    self.spec,
                    self.trainable,
                    self.frozen,
                    self.target_params,
                    batch,
                    self.base_key,
                    np.int32(i),
                )
            )
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + np.asarray(v, np.float64)
        res = summarize(sums, len(self.eval_plan))
        rec = {"step": self.step, "split": "eval", **{k: _jsonable(v) for k, v in res.items()}}
        score = res.get(self.cfg.best_metric)
        if score is None:
            log.warning("eval metrics lack %r; no best checkpoint kept", self.cfg.best_metric)
        elif math.isfinite(score) and (self.best_score is None or score > self.best_score):
            self.best_score, self.best_step = float(score), self.step
            rec["best"] = True
            self.best_ckpt.save(
                self.step,
                {"trainable": self.trainable},
                {"metrics": rec, "config": self.sidecar},
            )
        self._log([rec])
        return rec

    def save(self) -> None:
        """Start an asynchronous checkpoint of the current step (every process must call it)."""
        meta = {
            "data_position": self.step * self.cfg.global_batch_size,
            "rng": np.asarray(jax.random.key_data(self.base_key)).tolist(),
            "best_score": self.best_score,
            "best_step": self.best_step,
            "config": self.sidecar,
        }
        self.ckpt.save(self.step, self._state(), meta)
        self._saved_step = self.step

    def _log(self, records: list[dict[str, Any]]) -> None:
        if not self.is_main or not records:
            return
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")

    def close(self) -> None:
        self.ckpt.close()
        self.best_ckpt.close()


def _drafter_json(cfg: DrafterConfig) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d["target"] = cfg.target.to_json()
    return d


def load_best_params(run_dir: str | os.PathLike, abstract_trainable):
    """`(step, trainable, meta)` of the best checkpoint in `run_dir/best` (restored into the
    structure, dtypes and shardings of `abstract_trainable`)."""
    got = Checkpointer(Path(run_dir) / "best", async_save=False).restore(
        {"trainable": abstract_trainable}
    )
    if got is None:
        raise CheckpointError(f"{run_dir}/best holds no checkpoint; was an evaluation ever run?")
    step, state, meta = got
    return step, state["trainable"], meta
