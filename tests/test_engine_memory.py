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
    fits = ServingEngine(tcfg, dcfg, tp, dp, **KW).memory_plan
    created = []
    import dspark_jax.engine.programs as programs

    real = programs._created
    monkeypatch.setattr(programs, "_created", lambda *a: created.append(1) or real(*a))
    gib = fits.total / 0.9 / 2**30 * 0.5  # half of what it needs
    for layout, knob in (("slots", "num_slots"), ("paged", "num_pages")):
        with pytest.raises(ConfigError, match=knob) as e:
            ServingEngine(tcfg, dcfg, tp, dp, kv_layout=layout, device_memory_gib=gib, **KW)
        assert "\n" not in str(e.value)
    assert not created
    with pytest.raises(ConfigError, match="device_memory_gib"):
        ServingEngine(tcfg, dcfg, tp, dp, device_memory_gib=-1, **KW)
    ok = ServingEngine(tcfg, dcfg, tp, dp, device_memory_gib=gib * 4, **KW).memory_plan
    assert ok.fits and ok.limit == int(gib * 4 * 2**30)
