"""The report's speed section on real tiny models: every program warmed before timing (0
compilations while timed), the round's components (timed on the ServingEngine's own programs)
add up, the ideal speedup is τ·step/round."""

from __future__ import annotations

from dspark_jax import drafters as dr
from dspark_jax.engine import ServingEngine
from dspark_jax.eval import speed, speed_report
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
        parts = row["draft_ms"] + row["verify_forward_ms"] + row["commit_ms"] + row["host_ms"]
        assert abs(parts - row["round_ms"]) < 1e-9 and row["round_ms"] > 0
        assert row["draft_ms"] >= 0 and "propose_call_ms" in row
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
    m = speed_report.measured_speedup(
        dec, tcfg, tp, [prompt[:7], prompt], max_new_tokens=12, temperature=1.0
    )
    assert m["compilations_during_timing"] == 0 and m["speedup"] > 0
    assert m["rounds_per_call"] == 4 and 1 <= m["tokens_per_round"] <= 5
    md = "\n".join(speed_report.markdown_speed(bd, m))
    assert "ideal speedup" in md and "compilations during timing: 0" in md
    assert "Device-resident rounds (dspark, 3 rounds per host call, 6 rounds timed)" in md
    # drafting below the timer's resolution (tiny models): no share of it, no division by 0
    bd["sequential_head_share_of_propose"] = None
    assert "— of its proposal" in "\n".join(speed_report.markdown_speed(bd, m))


def test_the_drafting_timer_runs_a_rounds_drafter_work_after_each_forward():
    """The drafting column is the verify loop with the drafter's context update and proposal
    after each forward, less the same loop without: the drafter's work is inside the loop's
    body (nothing hoisted out of it: every proposal reads the context the forward just wrote,
    and its drafts are the next forward's tokens), and it changes what the loop computes."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dspark_jax.engine import RequestParams
    from dspark_jax.engine.config import SAMPLING, sampling_rows

    tcfg = tiny_target_config()
    tp = init_params(tcfg, 0)
    dcfg = tiny_drafter_config("dspark", target=tcfg, num_layers=1)
    dp = dr.init_params(dcfg, target_params=tp)
    eng = ServingEngine(tcfg, dcfg, tp, dp, num_slots=1, policy="fixed", max_len=96,
                        prompt_buckets=(20,), token_buckets=(dcfg.block_size + 1,),
                        kv_layout=speed.BREAKDOWN_LAYOUT)  # fmt: skip
    params = RequestParams(40, temperature=1.0, seed=0)
    eng.submit(list(range(5, 25)), params)
    eng.step()
    progs = eng.programs
    scfg, sp = SAMPLING["sampled"], sampling_rows([params], "sampled")
    drafts = jnp.zeros((dcfg.block_size,), jnp.int32) + progs.state.anchor[0]
    seeds = np.zeros(1, np.uint32)

    def args(d):
        return (progs.tcfg, progs.config.max_len, progs.one_set, dcfg if d else None,
                scfg if d else None, progs.params[0].tree(),
                progs.params[1].tree() if d else None, progs.state, drafts,
                progs.key if d else None, seeds if d else None, sp if d else None)  # fmt: skip

    def loop_body_eqns(d):
        jaxpr = jax.make_jaxpr(speed._forward, static_argnums=(0, 1, 2, 3, 4))(*args(d))
        loops = [e for e in jaxpr.eqns if e.primitive.name in ("while", "scan")]
        assert len(loops) == 1, "one device loop"
        return str(loops[0])

    plain, drafting = loop_body_eqns(False), loop_body_eqns(True)
    # the proposal's draw (an argmax over the vocabulary per draft slot, in its own scan) is
    # inside the timed loop's body, and only with the drafter
    assert "argmax" in drafting and "argmax" not in plain
    with_d = speed._forward(*args(True))
    without = speed._forward(*args(False))
    assert np.isfinite(float(with_d)) and float(with_d) != float(without)
