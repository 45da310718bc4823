"""The serving engine on a device mesh: target and drafter parameters and the slot state placed by
the one logical-axis table (`parallel.LOGICAL_RULES`).

    mesh = parallel.make_mesh(MeshConfig(data=1, tensor=8))      # tensor parallelism
    eng = ServingEngine(tcfg, dcfg, tparams, dparams, num_slots=8, mesh=mesh)

Parameters follow their `logical` metadata (vocab / heads / kv / mlp over "tensor", embed over
"fsdp"). The slot state is batch-major: slots over ("data", "fsdp"), the target's and the
drafter's K/V heads over "tensor", the pending draft distributions' vocabulary over "tensor". A
dimension that its mesh axes do not divide is replicated (`parallel.logical_to_spec`), so any slot
count and any head count run on any mesh.

`engine.programs.EnginePrograms` places the params with `place_params`, creates the slot state
directly with `state_shardings` (of its `jax.eval_shape`) and pins its programs' outputs to the
very shardings the state was created with, so a round never changes the arguments' shardings and
never recompiles after warm-up. GSPMD inserts the collectives; greedy
output equals one device's token for token (tests/test_engine_sharded.py).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding

from dspark_jax import parallel
from dspark_jax.config import MeshConfig
from dspark_jax.errors import ConfigError


def mesh_from_flag(text: str) -> Mesh | None:
    """`--mesh data,fsdp,tensor` (e.g. "1,1,8" = tensor parallelism over 8 devices; data may be
    -1 = the rest). Empty: every device in data parallel on an accelerator with several, else
    None (one device, no mesh; simulated CPU devices are not used unless asked for)."""
    if not text:
        several = jax.device_count() > 1 and jax.default_backend() != "cpu"
        return parallel.make_mesh(MeshConfig()) if several else None
    try:
        data, fsdp, tensor = (int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(
            f"--mesh {text!r} must be three integers data,fsdp,tensor — e.g. --mesh 1,1,8"
        ) from None
    return parallel.make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))


def _named(mesh: Mesh, logical, shape) -> NamedSharding:
    return NamedSharding(mesh, parallel.logical_to_spec(logical, shape, mesh))


def _context_shardings(ctx, mesh: Mesh):
    """The drafter context: K/V [N, n_kv, S, d_h] (a tuple per layer for DSpark/DFlash, one array
    for Eagle3), lengths [N], Eagle3's g [N, H]."""
    kv = ("batch", "kv_heads", "seq", "head_dim")

    def one(name, x):
        if name in ("k", "v"):
            return jax.tree.map(lambda a: _named(mesh, kv, a.shape), x)
        return _named(mesh, ("batch",) + (None,) * (len(x.shape) - 1), x.shape)

    return type(ctx)(**{name: one(name, getattr(ctx, name)) for name in ctx._fields})


def state_shardings(state, mesh: Mesh):
    """A `SlotState`-shaped tree of NamedShardings (`state` may be real or a `jax.eval_shape`)."""

    def rows(x, *rest):
        return _named(mesh, ("batch",) + rest + (None,) * (len(x.shape) - 1 - len(rest)), x.shape)

    return type(state)(
        cache=parallel.cache_shardings(state.cache, mesh),
        ctx=_context_shardings(state.ctx, mesh),
        anchor=rows(state.anchor),
        rounds=rows(state.rounds),
        prop_tokens=rows(state.prop_tokens),
        prop_probs=rows(state.prop_probs, None, "vocab"),
        prop_conf=rows(state.prop_conf),
    )


def paged_state_shardings(state, mesh: Mesh):
    """A `paged_device.PagedState`-shaped tree of NamedShardings: every page pool [P, page, n_kv,
    d] (the target's and the drafter's) with its K/V heads over "tensor" and its pages on every
    device of a tensor group (any row's table may name any page), the per-row fields as the slot
    state's (rows over ("data", "fsdp"))."""
    pool = lambda a: _named(mesh, (None, None, "kv_heads", "head_dim"), a.shape)

    def rows(x, *rest):
        return _named(mesh, ("batch",) + rest + (None,) * (len(x.shape) - 1 - len(rest)), x.shape)

    ctx = state.ctx
    pools = lambda x: jax.tree.map(pool, x)
    return type(state)(
        cache=type(state.cache)(pools(state.cache.k), pools(state.cache.v)),
        ctx=type(ctx)(pools(ctx.k), pools(ctx.v), _context_shardings(ctx.rows, mesh)),
        pos=rows(state.pos),
        anchor=rows(state.anchor),
        rounds=rows(state.rounds),
        prop_tokens=rows(state.prop_tokens),
        prop_probs=rows(state.prop_probs, None, "vocab"),
        prop_conf=rows(state.prop_conf),
    )


def place_params(params, mesh: Mesh):
    """Target params (`nnx.State`) or `DrafterParams` (a NamedTuple of them) on `mesh`."""
    if isinstance(params, tuple) and hasattr(params, "_fields"):
        return type(params)(*(place_params(p, mesh) for p in params))
    return parallel.shard_params(params, mesh)
