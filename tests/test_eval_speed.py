"""The report's speed section on real tiny models: every program warmed before timing (0
compilations while timed), the round's components (timed on the ServingEngine's own programs)
add up, the ideal speedup is τ·step/round."""

from __future__ import annotations

from dspark_jax import drafters as dr
from dspark_jax.engine import ServingEngine
from dspark_jax.eval import speed
from dspark_jax.models import init_params
from dspark_jax.testing import tiny_drafter_config, tiny_target_config


def test_breakdown_and_measured_speedup_time_only_compiled_code():
    tcfg = tiny_target_config()
    tp = init_params(tcfg, 0)
    ds = {}
    for kind in ("dspark", "dflash"):
        dcfg = tiny_drafter_config(kind, target=tcfg, num_layers=1)
        ds[kind] = (dcfg, dr.init_params(dcfg, target_params=tp))
    prompt = list(range(5, 25))
    bd = speed.round_breakdown(
        tcfg, tp, ds, prompt, reps=2, verify_tokens=(1, 4), resident_rounds=3
    )
    assert bd["compilations_during_timing"] == 0
    assert set(bd["verify_forward_ms"]) == {1, 4, 5}  # γ+1 = 5 always included
    for row in bd["drafters"].values():
        parts = row["propose_ms"] + row["verify_forward_ms"] + row["commit_ms"] + row["host_ms"]
        assert abs(parts - row["round_ms"]) < 1e-9 and row["round_ms"] > 0
        assert row["device_round_ms"] > 0  # (vs round_ms it is a timing, not a test: benchmarks)
    assert "sequential_head_share_of_round" in bd
    # device-resident: the first drafter, every timed step ran its K rounds on the device
    res = bd["resident"]
    assert res["drafter"] == "dspark" and res["rounds_per_call"] == 3
    assert res["rounds_timed"] == 2 * 3
    assert abs(res["device_ms"] + res["host_ms"] - res["round_ms"]) < 1e-9
    assert abs(res["host_share_of_round"] - res["host_ms"] / res["round_ms"]) < 1e-12
    speed.add_ideal(bd, {"dspark": 3.0})
    r = bd["drafters"]["dspark"]
    assert abs(r["ideal_speedup"] - 3.0 * bd["step_ms"] / r["round_ms"]) < 1e-12
    assert "ideal_speedup" not in bd["drafters"]["dflash"]

    dec = ServingEngine(
        tcfg, ds["dspark"][0], tp, ds["dspark"][1], num_slots=1, max_len=128,
        prompt_buckets=(16, 32), rounds_per_call=4,
    )  # fmt: skip
    m = speed.measured_speedup(
        dec, tcfg, tp, [prompt[:7], prompt], max_new_tokens=12, temperature=1.0
    )
    assert m["compilations_during_timing"] == 0 and m["speedup"] > 0
    assert m["rounds_per_call"] == 4 and 1 <= m["tokens_per_round"] <= 5
    md = "\n".join(speed.markdown_speed(bd, m))
    assert "ideal speedup" in md and "compilations during timing: 0" in md
    assert "Device-resident rounds (dspark, 3 rounds per host call, 6 rounds timed)" in md
