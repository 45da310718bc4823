"""benchmarks/decode_cost.py measures the engine's packed round and writes a CostProfile whose
layout and buckets are the engine's, so Algorithm 1 charges what the engine runs."""

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
    res = bench.main(args)
    assert res["retraces_after_warmup"] == 0
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
