"""benchmarks/decode_cost.py measures the engine's packed round (slot and paged KV layouts) and
writes a CostProfile whose layout and buckets are the engine's, so Algorithm 1 charges what the
engine runs."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib

from dspark_jax.engine import ServingEngine
from dspark_jax.sched import CostProfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("decode_cost", ROOT / "benchmarks/decode_cost.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_profile_layout_and_buckets_match_engine(tmp_path):
    bench = _bench()
    out = tmp_path / "cost.json"
    args = ["--model", "tiny", "--num-slots", "2", "--gamma", "2", "--max-len", "48"]
    args += ["--context", "8", "--steps", "2", "--repeats", "1", "--out", str(out)]
    res = bench.main(args)  # both KV layouts, interleaved; the slot engine's profile written
    assert set(res["layouts"]) == {"slots", "paged"} and res["profile_layout"] == "slots"
    assert all(v["retraces_after_warmup"] == 0 for v in res["layouts"].values())
    assert res["paging_overhead"]["geomean"] > 0
    prof = CostProfile.load(out)
    meta = json.loads(out.read_text())["cost_profile"]["meta"]
    assert prof.layout == "tokens"
    tcfg, tp, dcfg, dp = bench.random_models("tiny", 2)
    eng = ServingEngine(
        tcfg, dcfg, tp, dp, num_slots=2, max_len=48, prompt_buckets=(8,), modes=("greedy",),
        policy="alg1", cost_profile=prof,
    )  # fmt: skip
    assert prof.token_buckets == eng.token_buckets == tuple(meta["token_buckets"])
    assert meta["num_slots"] == eng.num_slots and meta["gamma"] == eng.gamma
    # Algorithm 1 walks the measured curve without the bucket cliffs (then fills the bucket);
    # the async capacity search charges the buckets exactly
    assert eng.scheduler.policy.cost == dataclasses.replace(prof, token_buckets=())
    assert eng.scheduler.fill_bucket and eng.scheduler.token_buckets == prof.token_buckets
    eng.set_policy("async", cost_profile=prof)
    assert eng.scheduler.policy.cost == prof  # used as measured, nothing re-bucketed
    assert set(prof.tokens) <= set(eng.token_buckets)  # every point is a bucket the engine runs
    assert all(t > 0 for t in prof.steps_per_s)


def test_scheduler_fast_path_equals_the_policy_functions():
    """Algorithm 1 / async top-K in the engine rank once per round (host time is round time);
    lengths equal the `sched.policies` functions followed by the bucket fill, ties included."""
    import numpy as np

    from dspark_jax.engine.scheduling import Scheduler
    from dspark_jax.sched import causal_greedy_lengths, top_k_lengths

    g, buckets = 4, (2, 4, 8, 16, 24, 40)
    rng = np.random.default_rng(0)
    for beta in (0.02, 0.3, 3.0):
        cost = CostProfile.from_step_time(1.0, beta, max_tokens=64)
        flat = dataclasses.replace(cost, token_buckets=())
        kw = dict(policy_gamma=None, threshold=0.5, cost=cost, sts=None, token_buckets=buckets,
                  has_confidence=True)  # fmt: skip
        alg1, asy = Scheduler("alg1", g, **kw), Scheduler("async", g, **kw)
        assert alg1._sps is not None
        for _ in range(60):
            r = int(rng.integers(1, 9))
            rho = rng.normal(1.0, 2.0, (r, g)).round(1)  # rounded: ties happen
            caps = rng.integers(0, g + 2, r)
            conf = alg1.calibrate(rho)

            def fill(lengths, r=r, conf=conf, caps=caps):
                total = r + int(lengths.sum())
                bucket = next(b for b in buckets if b >= total)
                return top_k_lengths(conf, int(lengths.sum()) + bucket - total, caps)

            ref = fill(causal_greedy_lengths(conf, flat, caps))
            assert np.array_equal(alg1.lengths(rho, caps), ref), (rho, caps)
            k = int(rng.integers(0, r * g + 1))
            asy._next_capacity = k
            assert np.array_equal(asy.lengths(rho, caps), fill(top_k_lengths(conf, k, caps)))
