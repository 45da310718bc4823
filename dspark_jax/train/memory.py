"""Memory plan of drafter training: per-device bytes before the first step, and a refusal.

`plan_memory` estimates, per device of the mesh, what one micro-step holds:

  params       trainable master weights (fp32) + frozen drafter tables + target (exact: each
               array's shard shape under the logical-axis table)
  optimizer    Adam moments (2 x fp32) + the fp32 gradient accumulator + one gradient in the
               compute dtype (exact, sharded like the parameters)
  activations  what the backward pass keeps: per drafter layer the projections and MLP
               intermediates and the fp32 attention scores/probabilities of the query tokens
               (DSpark/DFlash: b x anchors-in-a-chunk x γ queries over L + γ keys; Eagle3: b x L
               queries per TTT step, γ steps), the context K/V, plus the online target's output
               features and one target layer's transient (its fp32 scores)
  logits       fp32 [queries, V / tensor] buffers of the loss: draft logits, log-softmax,
               target logits, target probabilities and the logits' gradient

with b = micro_batch_size / (data x fsdp) sequences per device and L = the largest bucket. It is
an estimate in the spirit of MaxText's / levanter's pre-flight numbers; where a compiled executable
is at hand, `compiled_bytes` reads XLA's own `memory_analysis()` and the trainer prints both.

`check_memory` refuses (ConfigError, one line) when the estimate exceeds `HEADROOM` of the smallest
local device's memory and names the field to change, with a value that fits when one exists.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import numpy as np

from dspark_jax.config import DrafterConfig, TargetConfig, TrainConfig
from dspark_jax.errors import ConfigError

GIB = 1024**3
HEADROOM = 0.9  # fraction of a device's memory a plan may use (XLA workspace, fragmentation)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def resolve_dtypes(cfg: TrainConfig, backend: str | None = None) -> TrainConfig:
    """`compute_dtype="auto"` -> bfloat16 on accelerators, float32 on CPU; `target_dtype="auto"`
    -> the compute dtype."""
    backend = backend or jax.default_backend()
    cdt = cfg.compute_dtype
    if cdt == "auto":
        cdt = "float32" if backend == "cpu" else "bfloat16"
    tdt = cdt if cfg.target_dtype == "auto" else cfg.target_dtype
    if (cdt, tdt) == (cfg.compute_dtype, cfg.target_dtype):
        return cfg
    return cfg.replace(compute_dtype=cdt, target_dtype=tdt)


class _MemoryPlan:
    """What the memory plans (frozen dataclasses: this one, `engine.memory`'s) share: `total`,
    the sum of the fields `_PARTS` names, and whether it `fits` in `HEADROOM` of the field
    `limit` (None: no limit known, it fits)."""

    _PARTS: ClassVar[tuple[str, ...]]
    limit: int | None

    @property
    def total(self) -> int:
        return sum(getattr(self, part) for part in self._PARTS)

    @property
    def fits(self) -> bool:
        return self.limit is None or self.total <= HEADROOM * self.limit


@dataclasses.dataclass(frozen=True)
class MemoryPlan(_MemoryPlan):
    """Per-device bytes of one training micro-step (see the module docstring)."""

    _PARTS = ("params", "optimizer", "activations", "logits")

    params: int
    optimizer: int
    activations: int
    logits: int
    local_batch: int  # sequences per device per micro-step
    seq_len: int
    limit: int | None  # bytes of the smallest local device, None when unknown (CPU)

    def summary(self) -> str:
        lim = "unknown (no device memory limit reported)"
        if self.limit is not None:
            lim = f"{self.limit / GIB:.1f} GiB ({HEADROOM:.0%} usable)"
        return (
            f"memory plan per device ({self.local_batch} seq x {self.seq_len} tokens per "
            f"micro-step): params {_gib(self.params)}, optimizer {_gib(self.optimizer)}, "
            f"activations {_gib(self.activations)}, logits {_gib(self.logits)}; total "
            f"{_gib(self.total)} of {lim}"
        )

    def to_json(self) -> dict[str, Any]:
        return dict(dataclasses.asdict(self), total=self.total)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB // 2 else f"{n / 1024**2:.1f} MiB"


def device_limit(mesh, cfg: TrainConfig) -> int | None:
    """`TrainConfig.device_memory_gib` when set, else the smallest `bytes_limit` the mesh's local
    devices report (None on CPU, which reports none)."""
    if cfg.device_memory_gib > 0:
        return int(cfg.device_memory_gib * GIB)
    return reported_limit(mesh.local_devices)


def reported_limit(devices) -> int | None:
    """The smallest `bytes_limit` that `devices` report (None when none does, as on CPU)."""
    limits = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 (backends without the query)
            stats = None
        if stats and stats.get("bytes_limit"):
            limits.append(int(stats["bytes_limit"]))
    return min(limits) if limits else None


def sharded_bytes(tree, shardings, itemsize: int | None = None) -> int:
    """Bytes one device holds of `tree` placed with `shardings` (same structure), at the arrays'
    own dtypes or at `itemsize` bytes per element."""
    leaves = jax.tree.leaves(tree)
    shs = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    total = 0
    for x, sh in zip(leaves, shs):
        n = math.prod(sh.shard_shape(tuple(x.shape)))
        total += n * (itemsize or np.dtype(x.dtype).itemsize)
    return total


def _drafter_activations(d: DrafterConfig, b: int, seq: int, c: int, t: int) -> tuple[int, int]:
    """(activation, logits) bytes of one drafter forward kept for the backward pass."""
    tc = d.target
    h, inter, v = tc.hidden_size, tc.intermediate_size, tc.vocab_size
    heads = max(tc.num_heads // t, 1)
    nkv, hd = d.kv_geometry  # the draft layers' (Gemma 4: the global layers')
    kv_w = max(nkv * hd // t, 1)
    q_w = tc.num_heads * hd // t
    v_local = v // t if v % t == 0 else v
    gamma = d.block_size
    if d.kind == "eagle3":
        queries, keys, copies = b * seq, seq + gamma, gamma
        ctx = b * seq * 2 * kv_w * c
        logit_bufs = 1 + 3 * gamma  # target logits, then per step logits, log-softmax, grad
        layers = 1
    else:
        n = d.anchor_chunk or d.num_anchors
        queries, keys, copies = b * n * gamma, seq + gamma, 1
        ctx = d.num_layers * b * seq * 2 * kv_w * c  # context K/V of every layer, all anchors
        logit_bufs = 5
        layers = d.num_layers
    per_layer = queries * (4 * h + 2 * q_w + 3 * inter // t) * c + 2 * queries * heads * keys * 4
    acts = layers * copies * per_layer + ctx + b * seq * (tc.num_feature_layers + 1) * h * c
    logits = logit_bufs * queries * v_local * 4
    return acts, logits


def _target_transient(tc: TargetConfig, b: int, seq: int, c: int, t: int) -> int:
    """One online target layer's live buffers (no gradient): projections, MLP, fp32 scores."""
    heads = max(tc.num_heads // t, 1)
    proj = b * seq * (4 * tc.hidden_size + 3 * tc.intermediate_size // t) * c
    return proj + 2 * b * heads * seq * seq * 4


def _variable_bytes(cfg, target_cfg, drafter_cfg, b: int, seq: int, t: int) -> tuple[int, int]:
    """(activations, logits) per device for `b` local sequences of `seq` tokens."""
    c = _DTYPE_BYTES[cfg.compute_dtype]
    acts = logits = 0
    if drafter_cfg is not None:
        acts, logits = _drafter_activations(drafter_cfg, b, seq, c, t)
    if target_cfg is not None and cfg.feature_mode == "online":
        acts += _target_transient(target_cfg, b, seq, c, t)
    return acts, logits


def plan_memory(
    cfg: TrainConfig,
    mesh,
    *,
    trainable,
    trainable_shardings,
    frozen,
    frozen_shardings,
    target_params=None,
    target_shardings=None,
    target_cfg: TargetConfig | None = None,
    drafter_cfg: DrafterConfig | None = None,
) -> MemoryPlan:
    """The per-device plan of `cfg` on `mesh`; the trees may be real or abstract
    (`jax.eval_shape`) states, the shardings trees of NamedShardings like them."""
    cfg = resolve_dtypes(cfg)
    c = _DTYPE_BYTES[cfg.compute_dtype]
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    b = -(-cfg.micro_batch_size // shards)
    seq = max(cfg.seq_buckets)
    master = sharded_bytes(trainable, trainable_shardings, 4)
    params = master + sharded_bytes(frozen, frozen_shardings, c)
    if target_params is not None and cfg.feature_mode == "online":
        params += sharded_bytes(target_params, target_shardings, _DTYPE_BYTES[cfg.target_dtype])
    optimizer = 3 * master + master * c // 4  # mu, nu, accumulator (fp32) + one gradient
    acts, logits = _variable_bytes(cfg, target_cfg, drafter_cfg, b, seq, mesh.shape["tensor"])
    return MemoryPlan(params, optimizer, acts, logits, b, seq, device_limit(mesh, cfg))


def _suggest(cfg, plan: MemoryPlan, mesh, target_cfg, drafter_cfg) -> str:
    """The one change (field = value) that brings `plan` under the limit, or the closest hint."""
    cfg = resolve_dtypes(cfg)
    budget = HEADROOM * plan.limit
    fixed = plan.params + plan.optimizer
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    t = mesh.shape["tensor"]

    def fits(b, d):
        return fixed + sum(_variable_bytes(cfg, target_cfg, d, b, plan.seq_len, t)) <= budget

    if fixed > budget:
        return (
            "parameters and optimizer state alone exceed it: shard them over more devices "
            "(mesh.fsdp / mesh.tensor) or set TrainConfig.target_dtype='bfloat16'"
        )
    for m in range(cfg.micro_batch_size - 1, 0, -1):
        if cfg.global_batch_size % m == 0 and m % shards == 0 and fits(m // shards, drafter_cfg):
            return (
                f"set TrainConfig.micro_batch_size={m} (gradient accumulation keeps "
                f"global_batch_size={cfg.global_batch_size})"
            )
    if drafter_cfg is not None and drafter_cfg.kind != "eagle3":
        n = drafter_cfg.num_anchors
        for chunk in sorted((k for k in range(1, n) if n % k == 0), reverse=True):
            if chunk < (drafter_cfg.anchor_chunk or n):
                if fits(1, dataclasses.replace(drafter_cfg, anchor_chunk=chunk)):
                    return (
                        f"set TrainConfig.micro_batch_size={shards} and TrainConfig.anchor_chunk="
                        f"{chunk} (anchors per rematerialized chunk)"
                    )
    return (
        "one sequence per device does not fit: lower the largest of TrainConfig.seq_buckets "
        "or add tensor parallelism (mesh.tensor)"
    )


def check_memory(
    cfg: TrainConfig,
    plan: MemoryPlan,
    mesh,
    target_cfg: TargetConfig | None = None,
    drafter_cfg: DrafterConfig | None = None,
) -> None:
    """Raise ConfigError naming the field to change when `plan` cannot fit the devices."""
    if plan.fits:
        return
    raise ConfigError(
        f"training needs ~{_gib(plan.total)} per device (params {_gib(plan.params)}, optimizer "
        f"{_gib(plan.optimizer)}, activations {_gib(plan.activations)}, logits "
        f"{_gib(plan.logits)}) but the devices have {_gib(plan.limit)} ({HEADROOM:.0%} usable): "
        f"{_suggest(cfg, plan, mesh, target_cfg, drafter_cfg)}; or TrainConfig.memory_check='off' to try anyway"
    )


def compiled_bytes(compiled) -> dict[str, int] | None:
    """XLA's per-device numbers of a compiled step (`jax.jit(f).lower(...).compile()`), or None
    where the backend gives no memory analysis."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # noqa: BLE001
        return None
    if ma is None:
        return None
    keys = ("argument", "output", "temp", "alias", "generated_code")
    out = {k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0) for k in keys}
    out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


def check_compiled(
    compiled,
    plan: MemoryPlan,
    cfg: TrainConfig,
    mesh,
    target_cfg: TargetConfig | None = None,
    drafter_cfg: DrafterConfig | None = None,
    *,
    verbose: bool = True,
) -> dict[str, int] | None:
    """XLA's memory analysis of the compiled micro-step (printed next to the plan when
    `verbose`); refuses like `check_memory` when XLA's total exceeds the limit. Returns
    `compiled_bytes(compiled)`."""
    got = compiled_bytes(compiled)
    if got is None:
        return None
    if verbose:
        print(
            f"XLA memory analysis of the micro-step per device: arguments "
            f"{got['argument'] / GIB:.2f} GiB, temporaries {got['temp'] / GIB:.2f} GiB (plan: "
            f"activations + logits {(plan.activations + plan.logits) / GIB:.2f} GiB)",
            flush=True,
        )
    if plan.limit is not None and got["total"] > HEADROOM * plan.limit:
        compiled_plan = dataclasses.replace(
            plan, activations=got["temp"], logits=0, params=got["argument"], optimizer=0
        )
        check_memory(cfg, compiled_plan, mesh, target_cfg, drafter_cfg)
    return got
