"""Meshes, the logical-axis table, and sharded forward == single-device forward (8 CPU devices)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from dspark_jax import parallel
from dspark_jax.config import MeshConfig
from dspark_jax.errors import ConfigError
from dspark_jax.models.transformer import forward_jit, init_cache, init_params
from dspark_jax.testing import positions_like, random_params, random_tokens, tiny_target_config

TOL = 1e-5
B = 8

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


def _leaf(tree, *path):
    for k in path:
        tree = tree[k]
    return tree.get_value()


def test_make_mesh_auto_axes():
    mesh = parallel.make_mesh(MeshConfig(data=-1, tensor=4))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 4}
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert dict(parallel.make_mesh().shape) == {"data": 8, "fsdp": 1, "tensor": 1}
    with pytest.raises(ConfigError, match="needs 6 devices but 8 are available"):
        parallel.make_mesh(MeshConfig(data=3, tensor=2))
    with pytest.raises(ConfigError, match="cannot be split into fsdp=3"):
        parallel.make_mesh(MeshConfig(fsdp=3))


def test_logical_to_spec_falls_back_when_not_divisible():
    m24 = parallel.make_mesh(MeshConfig(data=2, tensor=4))
    m42 = parallel.make_mesh(MeshConfig(data=4, fsdp=2))
    to_spec = parallel.logical_to_spec
    assert to_spec(("vocab", "embed"), (256, 64), m24) == P("tensor", None)  # fsdp=1 dropped
    assert to_spec(("vocab", "embed"), (250, 64), m24) == P(None, None)  # 250 % 4 != 0
    assert to_spec(("vocab", "embed"), (256, 64), m42) == P(None, "fsdp")
    assert to_spec(("batch", None), (8, 5), m42) == P(("data", "fsdp"), None)
    assert to_spec(("batch", None), (4, 5), m42) == P("data", None)  # minor axis dropped
    assert to_spec(("batch",), (3,), m42) == P(None)
    assert to_spec(("embed", "embed"), (64, 64), m42) == P("fsdp", None)  # an axis used once
    with pytest.raises(ConfigError, match="no rule in parallel.LOGICAL_RULES"):
        to_spec(("nonsense",), (4,), m24)


def test_param_shardings_follow_the_table():
    cfg = tiny_target_config("qwen2", tie_word_embeddings=False)
    mesh = parallel.make_mesh(MeshConfig(data=2, tensor=4))
    abstract = jax.eval_shape(lambda: init_params(cfg))
    sh = parallel.param_shardings(abstract, mesh)
    attn = ("layers", 0, "self_attn")
    assert _leaf(sh, "embed_tokens").spec == P("tensor", None)
    assert _leaf(sh, *attn, "q_proj", "kernel").spec == P(None, "tensor")
    assert _leaf(sh, *attn, "q_proj", "bias").spec == P("tensor")
    assert _leaf(sh, *attn, "o_proj", "kernel").spec == P("tensor", None)
    assert _leaf(sh, "layers", 0, "mlp", "down_proj", "kernel").spec == P("tensor", None)
    assert _leaf(sh, "norm", "weight").spec == P(None)
    assert _leaf(sh, "lm_head", "kernel").spec == P(None, "tensor")
    params = parallel.shard_params(random_params(cfg, 0), mesh)
    q = _leaf(params, *attn, "q_proj", "kernel")
    assert q.sharding == _leaf(sh, *attn, "q_proj", "kernel")
    assert q.addressable_shards[0].data.shape == (64, 16)


CASES = [
    # qwen2: q/k/v biases and an untied head whose vocab (250) is not divisible by tensor=4;
    # qwen3: tied embeddings, fsdp-sharded weights.
    ("qwen2", dict(vocab_size=250, tie_word_embeddings=False), MeshConfig(data=2, tensor=4)),
    ("qwen3", dict(), MeshConfig(data=4, fsdp=2)),
]


@pytest.mark.parametrize("arch,overrides,mesh_cfg", CASES, ids=[c[0] for c in CASES])
def test_sharded_forward_equals_single_device(arch, overrides, mesh_cfg):
    """Full-sequence pass and cache path (prefill 8, verify 4) on the mesh == one device."""
    cfg = tiny_target_config(arch, **overrides)
    params = random_params(cfg, seed=7)
    tokens = random_tokens(0, (B, 12), cfg.vocab_size)
    ref, _ = forward_jit(cfg, params, tokens, positions_like(tokens))

    mesh = parallel.make_mesh(mesh_cfg)
    sharded = parallel.shard_params(params, mesh)
    put = lambda x: jax.device_put(x, parallel.batch_sharding(mesh, x.shape))
    full, _ = forward_jit(cfg, sharded, put(tokens), put(positions_like(tokens)))
    cache = parallel.shard_cache(init_cache(cfg, B, 16), mesh)
    assert cache.k[0].sharding.spec[0] == (("data", "fsdp") if mesh_cfg.fsdp > 1 else "data")
    steps = []
    for start, n in ((0, 8), (8, 4)):
        tok = tokens[:, start : start + n]
        out, cache = forward_jit(cfg, sharded, put(tok), put(positions_like(tok, start)), cache)
        cache = cache.with_lengths(jnp.full((B,), start + n))
        steps.append(out)

    assert len(full.logits.sharding.device_set) == 8  # the work really was spread
    assert len(cache.k[0].sharding.device_set) == 8
    assert np.abs(np.asarray(ref.logits)).max() > 0.5  # not comparing near-zeros
    for f in ("logits", "features", "hidden"):
        want = np.asarray(getattr(ref, f))
        d = np.max(np.abs(np.asarray(getattr(full, f)) - want))
        assert d <= TOL, (f, "full sequence", d)
        got = np.concatenate([np.asarray(getattr(o, f)) for o in steps], axis=1)
        d2 = np.max(np.abs(got - want))
        print(f"{arch} {f}: max |d| full {d:.1e}, cache path {d2:.1e}")
        assert d2 <= TOL, (f, "cache path", d2)


def test_batch_sharding():
    mesh = parallel.make_mesh(MeshConfig(data=4, fsdp=2))
    assert parallel.batch_sharding(mesh, (8, 3)).spec == P(("data", "fsdp"), None)
    assert parallel.batch_sharding(mesh, (4, 3)).spec == P("data", None)
    assert parallel.batch_sharding(mesh, 2).spec == P(("data", "fsdp"))
    x = jax.device_put(jnp.arange(16).reshape(8, 2), parallel.batch_sharding(mesh, (8, 2)))
    assert x.addressable_shards[0].data.shape == (1, 2)
