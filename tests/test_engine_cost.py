"""benchmarks/decode_cost.py measures the engine's packed round (slot and paged KV layouts) and
writes a CostProfile whose layout and buckets are the engine's, so Algorithm 1 charges what the
engine runs."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib

from dspark_jax.engine import ServingEngine
from dspark_jax.sched import CausalGreedy, CostProfile

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
    res = bench.main(args)  # both KV layouts, interleaved; the default (paged) engine's written
    assert set(res["layouts"]) == {"slots", "paged"} and res["profile_layout"] == "paged"
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
    # the profile as measured, with the engine's buckets: Algorithm 1 walks its curve without
    # the bucket cliffs, then fills the bucket (sched.policies); the async capacity search
    # charges the buckets exactly
    assert eng.scheduler.policy == CausalGreedy(prof)
    assert eng.scheduler.token_buckets == prof.token_buckets
    eng.set_policy("async", cost_profile=prof)
    assert eng.scheduler.policy.cost == prof  # used as measured, nothing re-bucketed
    assert set(prof.tokens) <= set(eng.token_buckets)  # every point is a bucket the engine runs
    assert all(t > 0 for t in prof.steps_per_s)


def test_scheduler_lengths_equal_the_policy_functions_and_the_bucket_fill():
    """Algorithm 1 / async top-K as the engine runs them equal the plain `sched.policies`
    functions (Algorithm 1 on the unbucketed curve) followed by the bucket fill, ties included."""
    import numpy as np

    from dspark_jax.engine.scheduler import Scheduler
    from dspark_jax.sched import causal_greedy_lengths, top_k_lengths

    g, buckets = 4, (2, 4, 8, 16, 24, 40)
    rng = np.random.default_rng(0)
    for beta in (0.02, 0.3, 3.0):
        cost = CostProfile.from_step_time(1.0, beta, max_tokens=64)
        flat = dataclasses.replace(cost, token_buckets=())
        kw = dict(policy_gamma=None, threshold=0.5, cost=cost, sts=None, token_buckets=buckets,
                  has_confidence=True)  # fmt: skip
        alg1, asy = Scheduler("alg1", g, **kw), Scheduler("async", g, **kw)
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


def test_public_causal_greedy_verifies_what_the_engine_verifies():
    """One Algorithm 1: `sched.CausalGreedy` on a profile with the engine's token buckets gives
    the lengths the engine's scheduler verifies (it is what the engine calls), the bucket fill
    included. The plain walk of the bucketed curve stops at the first bucket cliff: on the demo
    run's measured profile it verifies half as many tokens or fewer (often only the R anchors)."""
    import numpy as np

    from dspark_jax.engine.scheduler import Scheduler
    from dspark_jax.sched import causal_greedy_lengths

    measured = json.loads((ROOT / "benchmarks/results/decode_cost.tiny_run.json").read_text())
    sps = measured["steps_per_s"]
    buckets = tuple(measured["token_buckets"])  # (1, 2, 4, ..., 256)
    prof = CostProfile(tuple(map(int, sps)), tuple(sps.values()), token_buckets=buckets)
    g, rng = measured["gamma"], np.random.default_rng(0)
    kw = dict(policy_gamma=None, threshold=0.5, sts=None, token_buckets=buckets,
              has_confidence=True)  # fmt: skip
    for r in (1, 4, 8, 16, 32):
        conf = rng.uniform(0.6, 1.0, (r, g))
        rho, caps = np.log(conf / (1 - conf)), np.full(r, g)
        for cost in (prof, dataclasses.replace(prof, token_buckets=())):  # either way round
            engine = Scheduler("alg1", g, cost=cost, **kw)
            public = CausalGreedy(dataclasses.replace(cost, token_buckets=buckets))
            c = engine.calibrate(rho)
            got = engine.lengths(rho, caps)
            np.testing.assert_array_equal(public(c, max_len=caps), got)
            verified = r + int(got.sum())
            assert verified in buckets and verified >= 4 * r, (r, verified)
        plain = r + int(causal_greedy_lengths(c, prof, caps).sum())  # stopped at a cliff
        assert 2 * plain <= verified, (r, plain, verified)
