"""The serving engine's memory plan (`engine.memory`): exact for what the engine holds, on one
device and on a mesh, for both KV layouts; an engine that cannot fit is refused before its state
is created, naming what to lower."""

from __future__ import annotations

import jax
import pytest

from dspark_jax import parallel
from dspark_jax.config import MeshConfig
from dspark_jax.engine import ServingEngine
from dspark_jax.errors import ConfigError
from tests.engine_models import agreeing_pair

KW = dict(num_slots=4, max_len=64, modes=("greedy",))


@pytest.fixture(scope="module")
def pair():
    return agreeing_pair(vocab=64, gamma=4)


def _device0_bytes(tree) -> int:
    dev = jax.devices()[0]
    total = 0
    for x in jax.tree.leaves(tree):
        total += sum(s.data.nbytes for s in x.addressable_shards if s.device == dev)
    return total


@pytest.mark.parametrize("layout", ["slots", "paged"])
@pytest.mark.parametrize("mesh_shape", [None, (2, 1, 4)])
def test_plan_equals_what_one_device_holds(pair, layout, mesh_shape):
    if mesh_shape is not None and jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    tcfg, tp, dcfg, dp = pair
    mesh = None
    if mesh_shape is not None:
        data, fsdp, tensor = mesh_shape
        mesh = parallel.make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))
    eng = ServingEngine(tcfg, dcfg, tp, dp, kv_layout=layout, mesh=mesh, **KW)
    plan, st = eng.memory_plan, eng.programs.state
    assert plan.target_kv == _device0_bytes(st.cache)
    assert plan.drafter_kv == _device0_bytes((st.ctx.k, st.ctx.v))
    assert plan.target_kv + plan.drafter_kv + plan.rows == _device0_bytes(st)
    if mesh is not None:  # params as placed (target and drafter trees placed separately)
        placed = _device0_bytes((eng.programs.tparams, eng.programs.dparams))
        assert plan.params == placed
    assert plan.limit is None and plan.fits  # CPUs report no limit
    assert "engine memory per device" in plan.summary()


def test_an_engine_that_cannot_fit_is_refused_before_its_state(pair, monkeypatch):
    tcfg, tp, dcfg, dp = pair
    eng = ServingEngine(tcfg, dcfg, tp, dp, **KW)
    fits, page_bytes = eng.memory_plan, eng.pool_plan.page_bytes
    created = []
    import dspark_jax.engine.programs as programs

    real = programs._created
    monkeypatch.setattr(programs, "_created", lambda *a: created.append(1) or real(*a))
    gib = fits.total / 0.9 / 2**30 * 0.5  # half of what it needs
    pool = fits.target_kv + fits.drafter_kv
    pages = pool // page_bytes
    for kw, knob in ((dict(kv_layout="slots"), "num_slots"),
                     (dict(num_pages=int(pages)), "--kv-memory-gb or --num-pages"),
                     (dict(kv_memory_gib=pool / 2**30), "--kv-memory-gb or --num-pages"),
                     (dict(device_memory_gib=1e-4), "give it more memory")):  # fmt: skip
        with pytest.raises(ConfigError, match=knob) as e:
            ServingEngine(tcfg, dcfg, tp, dp, **{"device_memory_gib": gib, **kw, **KW})
        assert "\n" not in str(e.value)
    assert not created
    with pytest.raises(ConfigError, match="device_memory_gib"):
        ServingEngine(tcfg, dcfg, tp, dp, device_memory_gib=-1, **KW)
    ok = ServingEngine(tcfg, dcfg, tp, dp, device_memory_gib=gib * 4, **KW).memory_plan
    assert ok.fits and ok.limit == int(gib * 4 * 2**30)


@pytest.mark.parametrize("mesh_shape", [None, (2, 1, 4)])
def test_page_pool_sized_from_a_memory_budget(pair, mesh_shape):
    """The default layout's pool from `kv_memory_gib` (per device: the pools' pages over
    "tensor"), from the devices' memory (what the rest of the plan leaves), or num_slots x
    max_len positions (CPUs report none); a budget keeps the rows' lookahead back from
    admission; the plan's summary names the pages, tokens and concurrency."""
    if mesh_shape is not None and jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    tcfg, tp, dcfg, dp = pair
    mesh = None
    if mesh_shape is not None:
        mesh = parallel.make_mesh(MeshConfig(*mesh_shape))
    eng = ServingEngine(tcfg, dcfg, tp, dp, mesh=mesh, kv_memory_gib=0.01, **KW)
    pp, st = eng.pool_plan, eng.programs.state
    assert pp.num_pages == eng.config.num_pages == int(0.01 * 2**30 // pp.page_bytes)
    assert pp.num_pages * pp.page_bytes == _device0_bytes((st.cache, st.ctx.k, st.ctx.v))
    assert eng.page_pool.watermark == pp.reserved == KW["num_slots"] * 1  # γ + 1 = 5 <= 16
    assert eng.config.kv_memory_gib == 0  # resolved: the config rebuilds the same engine
    assert ServingEngine(tcfg, dcfg, tp, dp, mesh=mesh, config=eng.config).config == eng.config
    text = pp.summary()
    assert f"{pp.num_pages} pages x 16 = {pp.tokens} tokens" in text and "kv_memory_gib" in text
    assert pp.concurrency(64) == KW["num_slots"]  # the rows bound it here, not the pages
    if mesh is not None:
        return
    dflt = ServingEngine(tcfg, dcfg, tp, dp, **KW).pool_plan  # CPUs report no memory
    assert dflt.tokens == KW["num_slots"] * KW["max_len"] and dflt.reserved == 0
    plan = ServingEngine(tcfg, dcfg, tp, dp, device_memory_gib=0.05, **KW)
    assert "the devices' memory" in plan.pool_plan.source
    m = plan.memory_plan
    assert m.fits and m.total > 0.9 * m.limit - plan.pool_plan.page_bytes


@pytest.mark.parametrize("mesh_shape", [None, (1, 4, 2)])
def test_decoding_plan_equals_the_cache_generate_places(pair, mesh_shape):
    """The regenerate stage's plan (`plan_decode_memory`): its KV cache is what plain decoding's
    first program holds per device, rows over (data, fsdp) and K/V heads over tensor on a mesh
    (`decoding.on_params_mesh`), and its params what the placed target holds."""
    if mesh_shape is not None and jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    import jax.numpy as jnp

    from dspark_jax.engine.memory import plan_decode_memory
    from dspark_jax.models.decoding import DecodeRequest, start
    from dspark_jax.spec.sampling import SamplingConfig

    tcfg, tp, _, _ = pair
    if mesh_shape is not None:
        data, fsdp, tensor = mesh_shape
        mesh = parallel.make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))
        tp = parallel.shard_params(tp, mesh)
    rows, cache_len = 8, 32
    plan = plan_decode_memory(tcfg, tp, rows, cache_len)
    req = DecodeRequest(jnp.full((rows,), 4, jnp.int32), jnp.full((1,), -1, jnp.int32),
                        jax.random.key(0), jnp.zeros((rows,), jnp.uint32), None)  # fmt: skip
    st = jax.jit(start, static_argnames=("cfg", "scfg", "cache_len"))(
        tcfg, tp, jnp.zeros((rows, 8), jnp.int32), jnp.full((rows,), 3, jnp.int32), req,
        scfg=SamplingConfig(greedy=True), cache_len=cache_len,
    )  # fmt: skip
    assert plan.kv == _device0_bytes((st.cache.k, st.cache.v))
    assert plan.params == _device0_bytes(tp)
    if mesh_shape is not None:  # rows over fsdp (4), the 2 K/V heads over tensor (2)
        assert plan.kv * 8 == plan_decode_memory(tcfg, jax.device_get(tp), rows, cache_len).kv
    assert plan.fits and "decoding memory per device" in plan.summary()


def test_a_regeneration_that_cannot_fit_is_refused_before_decoding(pair):
    """The regenerate stage prints its plan, then refuses (one line naming the knobs) when the
    run's device memory (`drafters.train.device_memory_gib`) cannot hold it."""
    from types import SimpleNamespace

    from dspark_jax.config.pipeline import DRAFTER_TRAIN
    from dspark_jax.run.regenerate_stage import check_regen_memory

    tcfg, tp, _, _ = pair
    logs = []
    train = DRAFTER_TRAIN.replace(device_memory_gib=0.002)
    p = SimpleNamespace(cfg=SimpleNamespace(drafters=SimpleNamespace(train=train)),
                        log=logs.append)  # fmt: skip
    check_regen_memory(p, tcfg, tp, 4, 64)  # fits in 2 MiB
    with pytest.raises(ConfigError, match="lower regenerate.batch_size") as e:
        check_regen_memory(p, tcfg, tp, 64, 512)
    assert "\n" not in str(e.value)
    assert all("decoding memory per device" in line for line in logs) and len(logs) == 2
