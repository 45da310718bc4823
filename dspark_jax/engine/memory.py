"""The serving engine's memory per device, planned before its state is created (and plain
decoding's, for the regenerate stage: `plan_decode_memory`).

    plan = plan_engine_memory(programs_args...)      # EnginePrograms does this
    plan.summary()   # "engine memory per device: params .., target KV .., drafter KV .., ..."
    check_engine_memory(plan, config)                # ConfigError naming the knobs to lower

Exact for what the engine holds: the target's and the drafter's parameters and the state (the
target K/V: slots or page pools; the drafter's context K/V; the per-slot rows, whose pending
draft distributions [N, γ, V] grow with the vocabulary), each as one device holds it under the
shardings the programs place it with. Estimated for the transients of the largest call (its
logits and their sampling buffers, fp32, over the largest token bucket or prefill chunk, split
over "tensor" with the vocabulary). The limit is `device_memory_gib` when set, else what the
devices report (none on CPU: printed, never refused), with the trainer's headroom.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import numpy as np

from dspark_jax import parallel
from dspark_jax.errors import ConfigError
from dspark_jax.models import transformer as tf
from dspark_jax.train.memory import (
    GIB,
    HEADROOM,
    _gib,
    _MemoryPlan,
    reported_limit,
    sharded_bytes,
)

_LOGIT_BUFFERS = 3  # logits, probabilities, and the sort / filter buffer of the filtered mode


class _DevicePlan(_MemoryPlan):
    """The engine's and plain decoding's plans: `summary()` names what (`_WHAT`) and lists the
    subclass's `parts()`, then the total against the limit."""

    _WHAT: ClassVar[str]

    def parts(self) -> str:
        raise NotImplementedError

    def summary(self) -> str:
        lim = "(no device memory limit reported)"
        if self.limit is not None:
            lim = f"of {_gib(self.limit)} ({HEADROOM:.0%} usable)"
        return f"{self._WHAT} memory per device: {self.parts()}; total {_gib(self.total)} {lim}"


@dataclasses.dataclass(frozen=True)
class EngineMemoryPlan(_DevicePlan):
    _WHAT = "engine"
    _PARTS = ("params", "target_kv", "drafter_kv", "rows", "activations")

    params: int
    target_kv: int
    drafter_kv: int
    rows: int
    activations: int
    limit: int | None

    def parts(self) -> str:
        return (
            f"params {_gib(self.params)}, target KV {_gib(self.target_kv)}, drafter KV "
            f"{_gib(self.drafter_kv)}, slot rows {_gib(self.rows)}, largest call "
            f"~{_gib(self.activations)}"
        )


def _bytes(tree, shardings) -> int:
    """One device's bytes of `tree` (arrays or ShapeDtypeStructs) under `shardings` (a tree
    like it, or one sharding for every leaf)."""
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)
    return sharded_bytes(tree, shardings)


def _param_bytes(params, mesh, seen: set | None = None) -> int:
    """One device's bytes of target or drafter params; on one device an array the drafter
    shares with the target (`seen`) counts once, on a mesh each tree is placed on its own."""
    if isinstance(params, tuple):  # (target, drafter) or DrafterParams
        return sum(_param_bytes(p, mesh, seen) for p in params)
    if mesh is None:
        seen = set() if seen is None else seen
        total = 0
        for x in jax.tree.leaves(params):
            if id(x) not in seen:
                seen.add(id(x))
                total += math.prod(x.shape) * np.dtype(x.dtype).itemsize
        return total

    return sharded_bytes(params, parallel.param_shardings(params, mesh))


def device_limit(mesh, device_memory_gib: float) -> int | None:
    """`device_memory_gib` when > 0, else the smallest `bytes_limit` of the local devices the
    engine runs on (None when they report none, as on CPU)."""
    if device_memory_gib > 0:
        return int(device_memory_gib * GIB)
    devices = jax.local_devices()[:1] if mesh is None else mesh.local_devices
    return reported_limit(devices)


def plan_engine_memory(tcfg, config, tparams, dparams, abstract_state, state_shardings, mesh):
    """The plan of an engine with `config` (`abstract_state`: `jax.eval_shape` of its state;
    `state_shardings`: a tree like it or one sharding)."""
    sh = state_shardings
    if isinstance(sh, jax.sharding.Sharding):
        sh = jax.tree.map(lambda _: state_shardings, abstract_state)
    st = abstract_state
    target_kv = _bytes(st.cache, sh.cache)
    drafter_kv = _bytes((st.ctx.k, st.ctx.v), (sh.ctx.k, sh.ctx.v))
    rows = _bytes(st, sh) - target_kv - drafter_kv
    tensor = 1 if mesh is None else dict(mesh.shape).get("tensor", 1)
    width = max(
        max(config.token_buckets), max(config.prompt_buckets), config.num_slots * config.gamma
    )
    vocab = tcfg.vocab_size // tensor if tcfg.vocab_size % tensor == 0 else tcfg.vocab_size
    activations = _LOGIT_BUFFERS * width * vocab * 4
    return EngineMemoryPlan(
        params=_param_bytes((tparams, dparams), mesh, set()),
        target_kv=target_kv,
        drafter_kv=drafter_kv,
        rows=rows,
        activations=activations,
        limit=device_limit(mesh, config.device_memory_gib),
    )


@dataclasses.dataclass(frozen=True)
class DecodeMemoryPlan(_DevicePlan):
    """Plain batched decoding's (`models.generate`: the regenerate stage) memory per device:
    params and the KV cache of `rows` x `cache_len` positions exact, as placed on the params'
    mesh (`decoding.on_params_mesh`); the prefill's largest transients estimated."""

    _WHAT = "decoding"
    _PARTS = ("params", "kv", "activations")

    params: int
    kv: int
    activations: int
    limit: int | None

    def parts(self) -> str:
        return (
            f"params {_gib(self.params)}, KV cache {_gib(self.kv)}, largest call "
            f"~{_gib(self.activations)}"
        )


def plan_decode_memory(tcfg, tparams, rows: int, cache_len: int,
                       device_memory_gib: float = 0.0) -> DecodeMemoryPlan:  # fmt: skip
    """The plan of `models.generate` on `rows` rows of up to `cache_len` positions (prompts
    up to that long), on the mesh `tparams` are placed on (none: one device)."""
    leaf = jax.tree.leaves(tparams)[0]
    mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
    mesh = mesh if mesh is not None and mesh.size > 1 else None
    cache = jax.eval_shape(lambda: tf.init_cache(tcfg, rows, cache_len))
    if mesh is None:
        kv = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in cache.k + cache.v)
        dp = tensor = 1
    else:
        sh = parallel.cache_shardings(cache, mesh)
        kv = sharded_bytes((cache.k, cache.v), (sh.k, sh.v))
        shape = dict(mesh.shape)
        dp, tensor = shape.get("data", 1) * shape.get("fsdp", 1), shape.get("tensor", 1)
    # the prefill of every row's prompt: the MLP's two inner activations and a few hidden-wide
    # buffers per token, then the last token's logits and their sampling buffers (fp32)
    tokens = math.ceil(rows / dp) * cache_len
    width = 2 * tcfg.intermediate_size // tensor + 4 * tcfg.hidden_size
    item = np.dtype(jax.tree.leaves(tparams)[0].dtype).itemsize
    act = tokens * width * item + _LOGIT_BUFFERS * math.ceil(rows / dp) * tcfg.vocab_size * 4
    return DecodeMemoryPlan(
        params=_param_bytes(tparams, mesh),
        kv=kv,
        activations=act,
        limit=device_limit(mesh, device_memory_gib),
    )


def check_engine_memory(plan: EngineMemoryPlan, config) -> None:
    """ConfigError naming what to lower when `plan` cannot fit its devices."""
    if plan.fits:
        return
    kv = "the page pool (--kv-memory-gb or --num-pages)" if config.kv_layout == "paged" else (
        "num_slots (--num-slots) or max_len (--max-len), or use kv_layout='paged' "
        "(--kv-layout paged) and size its pool by num_pages"
    )  # fmt: skip
    raise ConfigError(
        f"the serving engine needs ~{_gib(plan.total)} per device ({plan.parts()}) but "
        f"the devices have {_gib(plan.limit)} ({HEADROOM:.0%} usable): lower {kv}, or shard "
        "over more devices (--mesh with a larger tensor axis)"
    )
