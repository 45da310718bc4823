"""Throughput of jitted chain verification and latency of the prefix schedulers.

Prints ONE JSON object:

* ``verify_ms_B{B}_g{γ}``: sampled verification (temperature 1, true draft distributions) of one
  round for ``B`` requests x ``γ`` draft slots over a ``--vocab`` vocabulary; also
  ``verify_tokens_per_s_B{B}_g{γ}`` (``B * (γ + 1)`` scored positions per round);
* baseline in the same run: ``greedy_verify_ms_B{B}_g{γ}`` and the ratio
  ``sampled_over_greedy_B{B}_g{γ}``;
* ``sched_us_R{R}``: Algorithm 1 (vectorised, ``causal_greedy_lengths``) for ``R`` requests x
  γ = 7; ``sched_engine_us_R{R}``: ``CausalGreedy`` as the engine runs it (the unbucketed walk
  and the token bucket's fill); ``sched_async_us_R{R}`` and ``sched_threshold_us_R{R}`` for the
  other policies; baseline ``sched_loop_us_R{R}`` (the paper's plain Python loop,
  ``causal_greedy_reference``, equal lengths to ``sched_us``'s) and ``sched_speedup_R{R}``.

    python benchmarks/verify_and_schedule.py [--vocab 32000] [--min-time 0.3]
    python benchmarks/verify_and_schedule.py --smoke   # seconds: the same keys, for B in
                                                       # {1, 2}, γ = 2, R in {1, 8}, V = 64
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.sched import AsyncTopK, CausalGreedy, CostProfile, StaticThreshold
from dspark_jax.sched.policies import causal_greedy_lengths, causal_greedy_reference
from dspark_jax.spec import RequestRng, SamplingConfig, validate_sampling_params, verify_core


def _time(fn, min_time: float, min_iters: int = 3) -> float:
    """Median seconds per call after one warm-up call; fn must block until its work is done."""
    fn()
    times, start = [], time.perf_counter()
    while len(times) < min_iters or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_verify(batch: int, gamma: int, vocab: int, min_time: float, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    target = jnp.asarray(rng.standard_normal((batch, gamma + 1, vocab), np.float32))
    draft_logits = rng.standard_normal((batch, gamma, vocab), np.float32)
    draft_probs = jax.nn.softmax(jnp.asarray(draft_logits), axis=-1)
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, gamma)), jnp.int32)
    lengths = jnp.full((batch,), gamma, jnp.int32)
    req = RequestRng(jax.random.key(seed), jnp.arange(batch), jnp.zeros(batch, jnp.int32))
    params = validate_sampling_params(1.0, batch_size=batch)
    sampled_cfg, greedy_cfg = SamplingConfig(), SamplingConfig(greedy=True)
    sampled = jax.jit(verify_core, static_argnames="cfg")
    greedy = jax.jit(verify_core, static_argnames="cfg")

    def run_sampled():
        jax.block_until_ready(
            sampled(target, tokens, draft_probs, lengths, req, params, cfg=sampled_cfg)
        )

    def run_greedy():
        jax.block_until_ready(greedy(target, tokens, None, lengths, None, None, cfg=greedy_cfg))

    t_s = _time(run_sampled, min_time)
    t_g = _time(run_greedy, min_time)
    key = f"B{batch}_g{gamma}"
    return {
        f"verify_ms_{key}": round(t_s * 1e3, 4),
        f"verify_tokens_per_s_{key}": round(batch * (gamma + 1) / t_s, 1),
        f"greedy_verify_ms_{key}": round(t_g * 1e3, 4),
        f"sampled_over_greedy_{key}": round(t_s / t_g, 3),
    }


def bench_schedulers(num_requests: int, gamma: int, min_time: float, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    conf = rng.uniform(0.3, 1.0, (num_requests, gamma))
    stale = rng.uniform(0.3, 1.0, (num_requests, gamma))
    # A realistic shape: flat until the device saturates, then step time grows with tokens;
    # verification padded to power-of-two token buckets.
    cost = CostProfile(
        (1, 64, 256, 1024, 4096),
        (100.0, 97.0, 80.0, 35.0, 9.0),
        token_buckets=tuple(2**i for i in range(13)),
    )
    engine, asynchronous, thresh = CausalGreedy(cost), AsyncTopK(cost), StaticThreshold(0.6)
    t_greedy = _time(lambda: causal_greedy_lengths(conf, cost), min_time, 20)
    t_engine = _time(lambda: engine(conf), min_time, 20)
    t_async = _time(lambda: asynchronous(conf, stale_conf=stale), min_time, 20)
    t_thresh = _time(lambda: thresh(conf), min_time, 20)
    t_loop = _time(lambda: causal_greedy_reference(conf, cost), min_time, 5)
    assert np.array_equal(causal_greedy_lengths(conf, cost), causal_greedy_reference(conf, cost))
    key = f"R{num_requests}"
    return {
        f"sched_us_{key}": round(t_greedy * 1e6, 2),
        f"sched_engine_us_{key}": round(t_engine * 1e6, 2),
        f"sched_async_us_{key}": round(t_async * 1e6, 2),
        f"sched_threshold_us_{key}": round(t_thresh * 1e6, 2),
        f"sched_loop_us_{key}": round(t_loop * 1e6, 2),
        f"sched_speedup_{key}": round(t_loop / t_greedy, 2),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--gammas", default="3,7,15")
    ap.add_argument("--requests", default="1,64,256")
    ap.add_argument("--sched-gamma", type=int, default=7)
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds of timing per entry")
    ap.add_argument("--smoke", action="store_true", help="seconds-sized run, the same keys")
    args = ap.parse_args(argv)
    if args.smoke:
        args.vocab, args.batches, args.gammas, args.requests = 64, "1,2", "2", "1,8"
        args.min_time = 0.0
    out = {
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "host": platform.machine(),
        "vocab": args.vocab,
        "verify_mode": "sampled T=1, true draft probs; baseline greedy",
        "sched_gamma": args.sched_gamma,
    }
    for b in map(int, args.batches.split(",")):
        for g in map(int, args.gammas.split(",")):
            out.update(bench_verify(b, g, args.vocab, args.min_time))
    for r in map(int, args.requests.split(",")):
        out.update(bench_schedulers(r, args.sched_gamma, args.min_time))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
