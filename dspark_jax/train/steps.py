"""The jitted training steps and what is static about them.

    statics = StepStatics.of(train_cfg, loss_fn, target_cfg)     # micro and eval steps
    update = UpdateStatics.of(train_cfg, total_steps)             # the optimizer update
    micro = jitted(train_micro_step, ("statics",), ("grad_acc", "metric_acc"), out_shardings)

Each step's static argument is a small frozen dataclass that holds exactly the values the step
reads, built from the `TrainConfig` in one place (`of`): a field a step reads is a field of its
statics, never a default. Runs that differ only in other fields (intervals, seeds, data) share
the compiled steps.

Data on the mesh: `plan_data` builds the training stream (per-process shards) and the held-out
batches and checks the batch sizes against the mesh; `device_batch` assembles a global batch from
the rows each process holds.

The loss contract (`dspark_jax.train.losses`): `loss_fn(trainable, frozen, batch, rng) -> (loss,
metrics)`, or `loss_fn(trainable, frozen, batch, rng, loss_weights)` when the Trainer is given
`loss_weights` (a pytree of arrays, e.g. `losses.LossWeights`: an argument of the steps, not a
static, so other values re-use the compiled steps); `batch` holds `input_ids`, `loss_mask`, `attention_mask` [B, L] and `target_features`
[B, L, m*H], `target_hidden` [B, L, H] in the compute dtype. Metric keys ending in `_num` / `_den`
are summed over micro-batches, the others averaged.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dspark_jax import parallel
from dspark_jax.config import TargetConfig
from dspark_jax.errors import ConfigError, DatasetError
from dspark_jax.runtime.xla_cpu import training_compiler_options
from dspark_jax.spec.metrics import is_additive
from dspark_jax.train import loader as loader_lib
from dspark_jax.train.features import FeatureCacheReader, target_features
from dspark_jax.train.optimizer import OptimizerSettings, lr_schedule, make_optimizer

log = logging.getLogger(__name__)

LossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
EVAL_STREAM = 0x7EA1  # folded into the base key for held-out evaluation


class StaticFn:
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
        return isinstance(other, StaticFn) and self._key == other._key


@dataclasses.dataclass(frozen=True)
class StepStatics:
    """Everything static about the micro and eval steps."""

    loss: StaticFn
    target: TargetConfig | None  # the frozen target (online features), or None
    compute_dtype: str  # "float32" | "bfloat16" (resolved, never "auto")
    feature_mode: str  # "online" | "offline"

    @classmethod
    def of(cls, cfg, loss_fn: LossFn, target_cfg: TargetConfig | None) -> StepStatics:
        if cfg.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"resolve compute_dtype={cfg.compute_dtype!r} first (memory.py)")
        return cls(StaticFn(loss_fn), target_cfg, cfg.compute_dtype, cfg.feature_mode)

    @property
    def dtype(self):
        return jnp.bfloat16 if self.compute_dtype == "bfloat16" else jnp.float32


@dataclasses.dataclass(frozen=True)
class UpdateStatics:
    """Everything static about the optimizer update."""

    optimizer: OptimizerSettings
    accum_steps: int  # micro-batches per optimizer step
    total_steps: int  # the schedule's length

    @classmethod
    def of(cls, cfg, total_steps: int) -> UpdateStatics:
        return cls(OptimizerSettings.of(cfg), int(cfg.accum_steps), int(total_steps))


def cast_floats(tree, dtype):
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def _loss_batch(statics: StepStatics, target_params, batch):
    cdt = statics.dtype
    if statics.feature_mode == "online":
        feats, hidden = target_features(statics.target, target_params, batch["input_ids"])
    else:
        feats, hidden = batch["target_features"], batch["target_hidden"]
    # the loss contract (module docstring), checked at trace time: no runtime cost
    ids = batch["input_ids"]
    chex.assert_rank(ids, 2)
    chex.assert_type(ids, int)
    chex.assert_equal_shape([ids, batch["loss_mask"], batch["attention_mask"]])
    chex.assert_equal_shape_prefix([ids, feats, hidden], 2)
    if statics.target is not None:
        chex.assert_axis_dimension(feats, 2, statics.target.feature_size)
        chex.assert_axis_dimension(hidden, 2, statics.target.hidden_size)
    return {
        "input_ids": batch["input_ids"],
        "loss_mask": batch["loss_mask"],
        "attention_mask": batch["attention_mask"],
        "target_features": feats.astype(cdt),
        "target_hidden": hidden.astype(cdt),
    }


def _call_loss(statics, trainable, frozen, batch, rng, loss_weights):
    args = () if loss_weights is None else (loss_weights,)
    return statics.loss.fn(cast_floats(trainable, statics.dtype), frozen, batch, rng, *args)


def _micro_rng(base_key, step, micro):
    return jax.random.fold_in(jax.random.fold_in(base_key, step), micro)


def train_micro_step(
    statics,
    trainable,
    frozen,
    target_params,
    grad_acc,
    metric_acc,
    batch,
    base_key,
    step,
    micro,
    loss_weights=None,
):
    """One micro-batch: features, loss, gradient; adds the fp32 gradient and metrics into the
    (donated) accumulators. Static: `statics` (`StepStatics`) and the batch shape [B, L] (one
    compilation per bucket). Arrays: everything else (`step`, `micro` int32 scalars select the
    loss RNG: fold_in(fold_in(base_key, step), micro); `loss_weights`, None or a pytree the
    loss takes as its last argument)."""
    lb = _loss_batch(statics, target_params, batch)
    rng = _micro_rng(base_key, step, micro)

    def f(tr):
        return _call_loss(statics, tr, frozen, lb, rng, loss_weights)

    (loss, metrics), grads = jax.value_and_grad(f, has_aux=True)(trainable)
    grad_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_acc, grads)
    metrics = dict(metrics, loss=loss)
    metric_acc = {k: metric_acc[k] + jnp.asarray(metrics[k], jnp.float32) for k in metric_acc}
    return grad_acc, metric_acc


def train_apply_step(statics, trainable, opt_state, grad_acc, metric_acc, step):
    """Mean gradient over the step's micro-batches, clip, AdamW update (compiled once).

    Static: `statics` (`UpdateStatics`). Arrays: the rest.

    Returns new (trainable, opt_state), zeroed accumulators and the step's metrics: ratio metrics
    averaged over micro-batches, `_num`/`_den` summed, plus `grad_norm` (before clipping) and `lr`.
    """
    n = statics.accum_steps
    grads = jax.tree.map(lambda g: g / n, grad_acc)
    tx = make_optimizer(statics.optimizer, statics.total_steps)
    updates, opt_state = tx.update(grads, opt_state, trainable)
    trainable = optax.apply_updates(trainable, updates)
    metrics = {k: v if is_additive(k) else v / n for k, v in metric_acc.items()}
    metrics["grad_norm"] = optax.global_norm(grads)
    metrics["lr"] = lr_schedule(statics.optimizer, statics.total_steps)(step)
    zero = functools.partial(jax.tree.map, jnp.zeros_like)
    return trainable, opt_state, zero(grad_acc), zero(metric_acc), metrics


def eval_step(statics, trainable, frozen, target_params, batch, base_key, index, loss_weights=None):
    """Loss metrics of one held-out batch (no gradient). Static: `statics`, batch shape."""
    lb = _loss_batch(statics, target_params, batch)
    rng = jax.random.fold_in(jax.random.fold_in(base_key, EVAL_STREAM), index)
    loss, metrics = _call_loss(statics, trainable, frozen, lb, rng, loss_weights)
    return dict(metrics, loss=loss)


def metric_shapes(
    statics: StepStatics, trainable, frozen, target_params, batch, base_key, loss_weights=None
):
    """`{key: shape}` of the metrics (with `loss`) the loss returns for `batch` (abstract)."""

    def shapes(tr, fr, tp, b, k, w):
        loss, m = _call_loss(statics, tr, fr, _loss_batch(statics, tp, b), k, w)
        return dict(m, loss=loss)

    out = jax.eval_shape(shapes, trainable, frozen, target_params, batch, base_key, loss_weights)
    return {k: v.shape for k, v in out.items()}


def zeros_f32(tree):
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


def jitted(fn, static, donate, out_shardings):
    """`jax.jit(fn)` with fixed output shardings and the training steps' compiler options
    (`xla_cpu.training_compiler_options`), shared by every Trainer with the same layout.

    Pinning the outputs to the very sharding objects the inputs were placed with keeps the
    arguments' shardings identical from call to call, so each step compiles once per shape
    (without it, `P()` vs `P(None, None)` spellings of the same layout would retrace).
    """
    options = training_compiler_options()  # the training steps' XLA:CPU option (xla_cpu.py)
    key = (fn, static, donate, _TreeKey(out_shardings), tuple((options or {}).items()))
    if key not in _JITS:
        _JITS[key] = jax.jit(fn, static_argnames=static, donate_argnames=donate,
                             out_shardings=out_shardings, compiler_options=options)  # fmt: skip
    return _JITS[key]


# ------------------------------------------------------------------------------------------------
# Placement on the mesh


def shardings(tree, mesh):
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


def device_batch(
    mesh, source, mb: loader_lib.MicroBatch, pad_id: int, after=None
) -> dict[str, jax.Array]:
    """Global [B, L, ...] arrays of micro-batch `mb`; each process reads only the rows of its
    own devices (a source with its own `device_batch`, `host_data.HostSource`, gathers them on
    the mesh after the program that wrote `after`: `host_data.in_order`)."""
    if hasattr(source, "device_batch"):
        return source.device_batch(mesh, mb, pad_id, after)
    b, length = mb.shape
    local = parallel.batch_sharding(mesh, (b, length)).addressable_devices_indices_map((b, length))
    cache: dict[tuple, dict[str, np.ndarray]] = {}
    for idx in local.values():
        sl = idx[0]
        k = sl.indices(b)
        if k not in cache:
            cache[k] = loader_lib.load_rows(source, mb, sl, pad_id=pad_id)
    fields = next(iter(cache.values()))
    out = {}
    for name, v in fields.items():
        shape = (b, length) + tuple(v.shape[2:])
        sharding = parallel.batch_sharding(mesh, shape)

        def cb(index, name=name):
            return cache[index[0].indices(b)][name][(slice(None),) + tuple(index[1:])]

        out[name] = jax.make_array_from_callback(shape, sharding, cb)
    return out


def check_features(cfg, target_cfg, target_params, train_data, eval_data):
    """The target features' source fits `cfg.feature_mode`: online needs the target, offline a
    `FeatureCacheReader` built by this target. Returns the target params the steps read (None
    offline)."""
    if cfg.feature_mode == "online":
        if target_cfg is None or target_params is None:
            raise ConfigError(
                "feature_mode='online' needs target_cfg and target_params (the frozen target "
                "runs inside the train step); or build a feature cache and use 'offline'"
            )
        return target_params
    for name, d in (("train_data", train_data), ("eval_data", eval_data)):
        cache = getattr(d, "local", d)  # a per-host source over this process's cache
        if d is not None and not isinstance(cache, FeatureCacheReader):
            raise ConfigError(
                f"feature_mode='offline' needs {name} to be a FeatureCacheReader (build "
                "one with features.write_feature_cache); or use feature_mode='online'"
            )
        if d is not None and target_cfg is not None:
            d.check_target(target_cfg)
    return None


@dataclasses.dataclass
class DataPlan:
    """The training stream and the held-out batches of a run."""

    train_source: loader_lib.SampleSource
    loader: loader_lib.DataLoader
    eval_source: loader_lib.SampleSource | None
    eval_plan: list


def plan_data(cfg, mesh, train_data, eval_data) -> DataPlan:
    """Sources, the training loader (per-process data shards) and the evaluation batches;
    DatasetError / ConfigError (one line) for data or batch sizes that cannot work on `mesh`."""
    train_source = loader_lib.as_source(train_data)
    loader = loader_lib.DataLoader(
        train_source,
        global_batch=cfg.global_batch_size,
        micro_batch=cfg.micro_batch_size,
        buckets=cfg.seq_buckets,
        data_seed=cfg.data_seed,
        empty_sequences=cfg.empty_sequences,
        # a per-host source keeps the one-process order (`host_data`)
        num_shards=1
        if getattr(train_source, "one_process_order", False)
        else data_shards(mesh, cfg.micro_batch_size),
    )
    eval_source = None if eval_data is None else loader_lib.as_source(eval_data)
    eval_plan = []
    if eval_source is not None:
        eval_plan = loader_lib.eval_batches(
            eval_source,
            batch_size=cfg.eval_batch_size,
            buckets=cfg.seq_buckets,
            max_batches=cfg.max_eval_batches,
        )
        if not eval_plan:
            raise DatasetError(
                "the evaluation set has no sequence with a supervised token; pass other "
                "held-out data or eval_data=None"
            )
    check_batch_shards(cfg, mesh)
    if min(mesh.shape.values()) > 1 and jax.default_backend() == "cpu":
        log.warning(
            "mesh %s has data, fsdp and tensor all > 1: XLA on CPU (jax 0.10.2) computes "
            "wrong gradients for some layouts there (tests/test_distributed.py::"
            "test_xla_gradient_on_a_2x2x2_mesh_is_correct); prefer at most two axes > 1",
            dict(mesh.shape),
        )
    return DataPlan(train_source, loader, eval_source, eval_plan)


def check_batch_shards(cfg, mesh, field_prefix: str = "TrainConfig.") -> None:
    """Every data x fsdp shard of a micro-batch and an eval batch holds whole sequences; the
    error names the field as the caller's user spells it (`field_prefix`)."""
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    for name in ("micro_batch_size", "eval_batch_size"):
        b = getattr(cfg, name)
        if b % shards:
            raise ConfigError(
                f"{field_prefix}{name}={b} must be a multiple of the mesh's data x fsdp = "
                f"{shards} (each device gets whole sequences) — set it to a multiple of "
                f"{shards} or change the mesh's data / fsdp sizes"
            )


def abstract_batch(mesh, data: DataPlan, shape) -> dict[str, jax.ShapeDtypeStruct]:
    """A micro-batch of `shape` [B, L] as sharded `ShapeDtypeStruct`s (ahead-of-time lowering)."""
    src = data.train_source
    # a per-host source (`host_data.HostSource`) may not hold row 0: it names its fields
    proto = src.prototype() if hasattr(src, "prototype") else src.get(int(data.loader.usable[0]))
    batch = {}
    for name, v in dict(proto, attention_mask=np.zeros((1,), np.uint8)).items():
        full = tuple(shape) + tuple(np.shape(v)[1:])
        sh = parallel.batch_sharding(mesh, full)
        batch[name] = jax.ShapeDtypeStruct(full, np.asarray(v).dtype, sharding=sh)
    return batch


__all__ = [
    "EVAL_STREAM",
    "DataPlan",
    "LossFn",
    "StaticFn",
    "StepStatics",
    "UpdateStatics",
    "abstract_batch",
    "cast_floats",
    "check_features",
    "data_shards",
    "device_batch",
    "eval_step",
    "jitted",
    "metric_shapes",
    "plan_data",
    "shardings",
    "train_apply_step",
    "train_micro_step",
    "zeros_f32",
]
