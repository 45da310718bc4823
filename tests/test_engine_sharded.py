"""The serving engine on 8 simulated CPU devices (tests/conftest.py): params and slot state placed
by the logical-axis table, greedy output equal to one device's token for token, no retrace."""

from __future__ import annotations

import jax
import pytest

from dspark_jax import drafters, parallel
from dspark_jax.config import DrafterConfig, MeshConfig
from dspark_jax.engine import RequestParams, ServingEngine
from dspark_jax.engine.sharding import mesh_from_flag
from dspark_jax.errors import ConfigError
from dspark_jax.testing import CompileCounter, random_params, tiny_target_config
from tests.engine_models import agreeing_pair

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

G = 4
PROMPTS = [[3, 9, 1], [5, 6, 7, 8, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48], [1, 2], [7] * 20]
MAX_NEW = [24, 17, 20, 9, 21]
KW = dict(
    num_slots=4, max_len=64, prompt_buckets=(8, 16), token_buckets=(8, 20),
    cache_buckets=(64,), modes=("greedy",),
)  # fmt: skip


def _run(eng):
    handles = []
    for k, (p, m) in enumerate(zip(PROMPTS, MAX_NEW)):
        handles.append(eng.submit(p, RequestParams(m, temperature=0.0)))
        if k % 2:
            eng.step()  # arrivals mid-flight
    while eng.has_work():
        eng.step()
    return [h.result() for h in handles]


def _one_device(tcfg, dcfg, tp, dp):
    eng = ServingEngine(tcfg, dcfg, tp, dp, **KW)
    return _run(eng)


@pytest.fixture(scope="module")
def pair():
    return agreeing_pair(vocab=64, gamma=G)


@pytest.fixture(scope="module")
def reference(pair):
    tcfg, tp, dcfg, dp = pair
    return _one_device(tcfg, dcfg, tp, dp)


@pytest.mark.parametrize("shape", [(1, 1, 8), (1, 2, 4)])
def test_sharded_engine_greedy_equals_one_device(pair, reference, shape):
    tcfg, tp, dcfg, dp = pair
    data, fsdp, tensor = shape
    mesh = parallel.make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))
    eng = ServingEngine(tcfg, dcfg, tp, dp, mesh=mesh, kv_layout="slots", **KW)
    # placed by the table: vocab-sharded LM head, kv-head-sharded caches
    head = eng.programs.tparams["lm_head"]["kernel"].get_value()
    assert head.sharding.spec == parallel.logical_to_spec(("embed", "vocab"), head.shape, mesh)
    assert len(eng.programs.state.cache.k[0].sharding.device_set) == 8
    eng.warmup()
    before = eng.compilations
    with CompileCounter() as cc:
        outs = _run(eng)
    assert cc.count == 0, cc.names
    assert eng.compilations == before
    rounds = 0
    for o, ref in zip(outs, reference):
        assert o.tokens == ref.tokens
        assert o.num_accepted == ref.num_accepted
        rounds += len(o.num_accepted)
    assert rounds < sum(MAX_NEW)  # drafts were really accepted
    sh = eng.programs.state.cache.k[0].sharding
    assert sh.spec == parallel.cache_shardings(eng.programs.state.cache, mesh).k[0].spec


def test_paged_engine_on_a_mesh_equals_one_device(pair, reference):
    """kv_layout="paged" on a 2 x 2 x 2 mesh: the target's and the drafter's page pools with
    their K/V heads over "tensor", the rows over ("data", "fsdp"); a pool of 12 pages of 8 forces
    preemptions by recompute. Greedy tokens equal the one-device slot engine's, no retrace after
    warm-up, every page free at the end."""
    tcfg, tp, dcfg, dp = pair
    mesh = parallel.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    eng = ServingEngine(tcfg, dcfg, tp, dp, mesh=mesh, kv_layout="paged", page_size=8,
                        num_pages=12, **KW)  # fmt: skip
    state = eng.programs.state
    pool_spec = jax.sharding.PartitionSpec(None, None, "tensor", None)
    assert state.cache.k[0].sharding.spec == pool_spec
    assert jax.tree.leaves(state.ctx.k)[0].sharding.spec == pool_spec
    assert state.anchor.sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"))
    eng.warmup()
    with CompileCounter() as cc:
        outs = _run(eng)
    assert cc.count == 0, cc.names
    assert eng.page_pool.preemptions > 0
    for o, ref in zip(outs, reference):
        assert o.tokens == ref.tokens
    assert eng.programs.state.cache.k[0].sharding.spec == pool_spec
    eng.page_pool.check()
    assert eng.page_pool.used_pages == 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_sharded_engine_other_drafters(kind):
    """DFlash's and Eagle3's contexts (their own layouts) on a tensor x data mesh."""
    tcfg = tiny_target_config("qwen3", vocab_size=64, max_position_embeddings=128)
    tp = random_params(tcfg, 0)
    if kind == "eagle3":
        dcfg = DrafterConfig.eagle3(tcfg, block_size=3)
    else:
        dcfg = DrafterConfig.dflash(tcfg, num_layers=1, block_size=3, mask_token_id=63)
    dp = drafters.init_params(dcfg, seed=1, target_params=tp)
    ref = _one_device(tcfg, dcfg, tp, dp)
    mesh = parallel.make_mesh(MeshConfig(data=2, tensor=4))
    outs = _run(ServingEngine(tcfg, dcfg, tp, dp, mesh=mesh, **KW))
    assert [o.tokens for o in outs] == [r.tokens for r in ref]


def test_mesh_flag():
    assert dict(mesh_from_flag("1,1,8").shape) == {"data": 1, "fsdp": 1, "tensor": 8}
    assert dict(mesh_from_flag("-1,1,4").shape) == {"data": 2, "fsdp": 1, "tensor": 4}
    assert mesh_from_flag("") is None  # simulated CPU devices: one device unless asked
    with pytest.raises(ConfigError, match="data,fsdp,tensor"):
        mesh_from_flag("8")
    with pytest.raises(ConfigError, match="needs 6 devices"):
        mesh_from_flag("3,1,2")
