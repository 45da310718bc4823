"""Meshes and the one logical-axis -> mesh-axis table.

Layers name logical axes only (`logical=` metadata on every `nnx.Param`, e.g. ("embed", "heads")).
This module is the single place that decides where each logical axis lives on the device mesh
("data", "fsdp", "tensor"). Everything else asks it for shardings:

    mesh = make_mesh(MeshConfig(data=2, tensor=4))
    params = shard_params(params, mesh)           # or load_target(path, mesh=mesh)
    tokens = jax.device_put(tokens_BxT, batch_sharding(mesh, tokens_BxT.shape))
    cache = shard_cache(init_cache(cfg, B, S), mesh)

Meshes use `AxisType.Auto` on every axis: recent jax defaults `make_mesh` to Explicit axes, under
which ordinary (sharding-unaware) layers fail to trace. With Auto axes the shardings placed on the
inputs propagate through `jax.jit` (GSPMD), so one forward runs unchanged on 1 or N devices.

A dimension whose size is not divisible by its mesh axes is replicated on that dimension rather
than refused, so odd vocabularies or few KV heads still load (at the cost of memory, not of
correctness).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from dspark_jax.config import MeshConfig
from dspark_jax.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")

# The one table. Keys are the logical names used by layers (params) and by activations/caches;
# values are a mesh axis, a tuple of mesh axes (major to minor), or None (replicated).
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    # parameters
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",  # n_q * d_h (flattened q / o projections)
    "kv": "tensor",  # n_kv * d_h (flattened k / v projections)
    "mlp": "tensor",
    "norm": None,
    # activations and caches
    "batch": ("data", "fsdp"),
    "seq": None,
    "kv_heads": "tensor",  # n_kv in the KV cache
    "head_dim": None,
}


def make_mesh(config: MeshConfig | None = None, devices: Sequence | None = None) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh with Auto axis types over `devices` (default: all).

    `config.data == -1` takes all devices left after fsdp and tensor. The product of the three
    sizes must equal the number of devices.
    """
    config = config or MeshConfig()
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    fsdp, tensor, data = config.fsdp, config.tensor, config.data
    for name, size in (("fsdp", fsdp), ("tensor", tensor)):
        if size < 1:
            raise ConfigError(f"MeshConfig.{name}={size} must be >= 1")
    if data == -1:
        if n % (fsdp * tensor):
            raise ConfigError(
                f"{n} devices cannot be split into fsdp={fsdp} x tensor={tensor}; choose sizes "
                f"whose product divides {n}"
            )
        data = n // (fsdp * tensor)
    if data < 1 or data * fsdp * tensor != n:
        raise ConfigError(
            f"mesh data={config.data} x fsdp={fsdp} x tensor={tensor} needs "
            f"{data * fsdp * tensor} devices but {n} are available; set data=-1 to use the rest"
        )
    shape = (data, fsdp, tensor)
    auto = (AxisType.Auto,) * len(MESH_AXES)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
    except TypeError:  # older jax without the `devices` argument
        dev = np.asarray(devices).reshape(shape)
        return Mesh(dev, MESH_AXES, axis_types=auto)


def _mesh_axes(logical_name: str | None, rules) -> tuple[str, ...]:
    if logical_name is None:
        return ()
    if logical_name not in rules:
        raise ConfigError(
            f"logical axis {logical_name!r} has no rule in parallel.LOGICAL_RULES; add it there "
            f"(known: {sorted(rules)})"
        )
    axes = rules[logical_name]
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def logical_to_spec(
    logical: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules: dict | None = None,
) -> PartitionSpec:
    """PartitionSpec for an array of `shape` whose dims carry the `logical` names.

    Mesh axes of size 1 are dropped; when a dim is not divisible by the product of its mesh axes,
    the minor axes are dropped until it is (possibly down to replicated). A mesh axis is used at
    most once per array.
    """
    rules = LOGICAL_RULES if rules is None else rules
    if len(logical) != len(shape):
        raise ConfigError(f"logical axes {tuple(logical)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    spec = []
    for name, dim in zip(logical, shape):
        axes = [a for a in _mesh_axes(name, rules) if mesh.shape[a] > 1 and a not in used]
        while axes and dim % math.prod(mesh.shape[a] for a in axes):
            axes.pop()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*spec)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_shardings(params: nnx.State, mesh: Mesh, rules: dict | None = None) -> nnx.State:
    """A tree like `params` (same Variables) whose values are NamedShardings.

    Reads each Variable's `logical` metadata; a Variable without it is replicated. Works on real
    and on abstract (`nnx.eval_shape`) states, so shardings can be known before loading weights.
    """

    def one(v):
        shape = v.get_value().shape  # a jax.Array or, for abstract states, a ShapeDtypeStruct
        logical = v.get_metadata().get("logical")
        if logical is None:
            spec = PartitionSpec()
        else:
            spec = logical_to_spec(logical, shape, mesh, rules)
        return v.replace(NamedSharding(mesh, spec))

    return jax.tree.map(one, params, is_leaf=_is_var)


def shard_params(params: nnx.State, mesh: Mesh, rules: dict | None = None) -> nnx.State:
    """`params` placed on `mesh` by the logical-axis table (a copy; the input is not donated)."""
    return put(params, param_shardings(params, mesh, rules))


def put(tree, shardings):
    """`jax.device_put(tree, shardings)` that also works when the shardings span several
    processes and a value sits on this process's devices only (a loaded checkpoint): every
    process holds the whole value, so each places its own shards from a host copy (a
    device-to-device transfer would cross hosts, which the CPU and GPU backends refuse)."""

    def one(x, sh):
        local = isinstance(x, jax.Array) and x.is_fully_addressable
        if local and not sh.is_fully_addressable:
            x = np.asarray(x)
        return x

    host = jax.tree.map(one, tree, shardings)
    return jax.device_put(host, shardings)


def batch_sharding(mesh: Mesh, shape: Sequence[int] | int = 2) -> NamedSharding:
    """Sharding for a batch-major array: dim 0 over ("data", "fsdp"), the rest replicated.

    `shape` is the array's shape (so a batch not divisible by data*fsdp falls back gracefully) or
    just its number of dims (then the batch is assumed divisible).
    """
    if isinstance(shape, int):
        return NamedSharding(mesh, PartitionSpec(_mesh_axes("batch", LOGICAL_RULES)))
    logical = ("batch",) + (None,) * (len(shape) - 1)
    return NamedSharding(mesh, logical_to_spec(logical, shape, mesh))


def global_batch(mesh: Mesh, local: np.ndarray, batch: int) -> jax.Array:
    """The global [batch, ...] array (placed by `batch_sharding`) of which this process holds
    rows `local` (its `process_block` of the batch, in process order), assembled by
    `jax.make_array_from_process_local_data`: no process reads or sends another's rows."""
    shape = (batch, *local.shape[1:])
    return jax.make_array_from_process_local_data(batch_sharding(mesh, shape), local, shape)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def cache_shardings(cache, mesh: Mesh, rules: dict | None = None):
    """A KVCache-shaped tree of NamedShardings: K/V [B, n_kv, S, d_h] over
    ("batch", "kv_heads", "seq", "head_dim"), lengths [B] over "batch".

    `cache` may be a real KVCache or its `jax.eval_shape`.
    """

    def kv(x):
        spec = logical_to_spec(("batch", "kv_heads", "seq", "head_dim"), x.shape, mesh, rules)
        return NamedSharding(mesh, spec)

    lengths = NamedSharding(mesh, logical_to_spec(("batch",), cache.lengths.shape, mesh, rules))
    return cache._replace(
        k=tuple(kv(x) for x in cache.k), v=tuple(kv(x) for x in cache.v), lengths=lengths
    )


def shard_cache(cache, mesh: Mesh, rules: dict | None = None):
    """`cache` placed on `mesh` by `cache_shardings`."""
    return put(cache, cache_shardings(cache, mesh, rules))


def local_mesh(config: MeshConfig | None = None) -> Mesh:
    """A mesh over this process's devices only (for work that differs between processes, e.g.
    each process regenerating its own shard of the prompts): `config`'s fsdp x tensor when it
    divides the local device count, else tensor parallel over every local device."""
    config = config or MeshConfig()
    devices = jax.local_devices()
    fsdp, tensor = config.fsdp, config.tensor
    if len(devices) % (fsdp * tensor):
        fsdp, tensor = 1, len(devices)
    return make_mesh(MeshConfig(data=-1, fsdp=fsdp, tensor=tensor), devices=devices)
