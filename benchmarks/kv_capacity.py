"""KV capacity: the serving engine on a paged KV cache against slots, at equal KV memory.

Both engines hold the same number of K/V positions: the slot engine `--slots` slots of
`--max-len` positions each, the paged engine a pool of `--slots * --max-len / --page` pages
shared by `--paged-slots` rows. The workload (seeded): `--requests - 1` prompts of 64..6000
tokens, Zipf-like (most short, a few long), plus one prompt of `--long` tokens (>= 8000 at the
default max_len 8192), all greedy, submitted at once; both engines run it to the end after a
warm-up. Random weights (the tiny 4-layer target and a 1-layer DSpark drafter): acceptance is
low, only memory, concurrency and throughput are compared.

    python benchmarks/kv_capacity.py [--max-len 8192] [--slots 2] [--paged-slots 32]
                                     [--requests 24] [--page 16] [--long 8000]
    python benchmarks/kv_capacity.py --smoke   # seconds: the same path and keys; max_len 256,
                                               # 4 paged slots, 4 requests, one bucket each

Prints ONE JSON object: `config`, `slots` / `paged` (tokens, seconds, tokens_per_s,
max_concurrent, retraces_after_warmup, and for paged preemptions, peak_used_pages,
pages_leaked) and `summary` (concurrent_requests_paged_over_slots,
tokens_per_s_paged_over_slots, batched_equals_serial: the paged engine's tokens, more requests
batched, equal the slot engine's, whose tokens do not depend on batching (tests/test_engine.py),
longest_prompt_served, pages_leaked, retraces_after_warmup, default_layout: the layout an
engine built with no `kv_layout` gets, which is the paged engine's here).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from dspark_jax import drafters  # noqa: E402
from dspark_jax.config import DrafterConfig  # noqa: E402
from dspark_jax.engine import RequestParams, ServingEngine  # noqa: E402
from dspark_jax.testing import random_params, tiny_target_config  # noqa: E402

GAMMA = 4


def _models(max_len):
    tcfg = tiny_target_config("qwen2", vocab_size=256, max_position_embeddings=max(max_len, 512))
    tp = random_params(tcfg, 0)
    dcfg = DrafterConfig.dspark(tcfg, num_layers=1, block_size=GAMMA, mask_token_id=255,
                                num_anchors=8)  # fmt: skip
    return tcfg, tp, dcfg, drafters.init_params(dcfg, seed=1, target_params=tp)


def _workload(n, long, rng, lo=64, hi=6000):
    """n - 1 prompts of lo..hi tokens, Zipf-like (lo·k, k ~ Zipf(1.5): 38% are lo, 8% hi), and
    one of `long` tokens placed in the middle of the queue."""
    lens = [int(min(hi, lo * k)) for k in rng.zipf(1.5, n - 1)]
    lens.insert((n - 1) // 2, long)
    return [[int(t) for t in rng.integers(0, 250, m)] for m in lens]


def _run(eng, prompts, max_new):
    eng.warmup()
    warm = eng.compilations
    handles = [eng.submit(p, RequestParams(max_new, temperature=0.0, seed=0)) for p in prompts]
    peak, t0 = 0, time.perf_counter()
    while eng.has_work():
        eng.step()
        peak = max(peak, len(eng.slots.running()))
    secs = time.perf_counter() - t0
    outs = [h.result().tokens for h in handles]
    n_tok = sum(len(o) for o in outs)
    row = dict(tokens=n_tok, seconds=round(secs, 3), tokens_per_s=round(n_tok / secs, 2),
               max_concurrent=peak, retraces_after_warmup=eng.compilations - warm)  # fmt: skip
    pool = eng.page_pool
    if pool is not None:
        pool.check()
        row.update(preemptions=pool.preemptions, peak_used_pages=pool.peak_used,
                   pages_leaked=pool.used_pages, num_pages=pool.num_pages)  # fmt: skip
    return row, outs


def _gaps(eng, short, long, max_new):
    """A short request decoding while `long` is admitted: the longest gap between its tokens,
    in steps and seconds (warm engine, slot layout)."""
    eng.warmup()
    warm = eng.compilations
    h = eng.submit(short, RequestParams(max_new, temperature=0.0))
    eng.step()
    eng.submit(long, RequestParams(2, temperature=0.0))
    last_t, gap_steps, gap_s, idle, done = time.perf_counter(), 0, 0.0, 0, False
    while not done:
        mine = [d for d in eng.step() if d.request_id == h.id]
        now = time.perf_counter()
        got = any(d.tokens for d in mine)
        idle = 0 if got else idle + 1
        gap_steps = max(gap_steps, idle + 1)
        if got:
            gap_s, last_t = max(gap_s, now - last_t), now
        done = any(d.finished for d in mine)
    return dict(longest_gap_steps=gap_steps, longest_gap_s=round(gap_s, 3),
                retraces_after_warmup=eng.compilations - warm)  # fmt: skip


def _stall(models, common, a):
    """`stall`: the longest gap of a short request's tokens while a `--stall-long` prompt is
    prefilled, unbounded vs `--stall-budget` prompt tokens per step (chunked prefill)."""
    rng = np.random.default_rng(1)
    short, long = rng.integers(0, 250, 64).tolist(), rng.integers(0, 250, a.stall_long).tolist()
    rows = {}
    for name, budget in (("unbounded", 0), ("chunked", a.stall_budget)):
        eng = ServingEngine(*models, num_slots=2, prefill_tokens_per_step=budget, **common)
        rows[name] = _gaps(eng, short, long, a.max_new * 4)
    rows["gap_s_chunked_over_unbounded"] = round(
        rows["chunked"]["longest_gap_s"] / rows["unbounded"]["longest_gap_s"], 3
    )
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--paged-slots", type=int, default=32, help="the paged engine's rows")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--long", type=int, default=8000, help="the longest prompt's tokens")
    ap.add_argument("--stall-long", type=int, default=6000, help="`stall`: the long prompt")
    ap.add_argument("--stall-budget", type=int, default=512, help="`stall`: chunked budget")
    ap.add_argument("--stall-only", action="store_true", help="only the `stall` key")
    ap.add_argument("--smoke", action="store_true", help="seconds-sized run, the same keys")
    a = ap.parse_args(argv)
    if a.smoke:
        a.max_len, a.slots, a.paged_slots, a.requests, a.max_new = 256, 2, 4, 4, 4
        a.long, a.stall_long, a.stall_budget = 200, 160, 64
    tcfg, tp, dcfg, dp = _models(a.max_len)
    top = a.max_len - a.max_new - GAMMA - 1  # longer prompts do not fit a slot: refused
    prompts = _workload(a.requests, min(a.long, top), np.random.default_rng(0), hi=min(6000, top))
    caches = (512, 2048, a.max_len) if a.max_len > 2048 else (a.max_len // 4, a.max_len)
    common = dict(max_len=a.max_len, prompt_buckets=(64, 512), token_buckets=(8, 20, 40, 80),
                  cache_buckets=caches, modes=("greedy",))  # fmt: skip
    if a.smoke:  # one program per kind to compile
        tokens = max(a.slots, a.paged_slots) * (GAMMA + 1)
        common.update(prompt_buckets=(64,), token_buckets=(tokens,), cache_buckets=(a.max_len,))
    stall = _stall((tcfg, dcfg, tp, dp), common, a)
    if a.stall_only:
        out = dict(config=vars(a), stall=stall)
        print(json.dumps(out))
        return out
    num_pages = a.slots * a.max_len // a.page  # equal KV memory
    slots_eng = ServingEngine(tcfg, dcfg, tp, dp, num_slots=a.slots, kv_layout="slots", **common)
    # the default layout, its pool sized by the same memory
    paged_eng = ServingEngine(tcfg, dcfg, tp, dp, num_slots=a.paged_slots, page_size=a.page,
                              num_pages=num_pages, **common)  # fmt: skip
    s_row, s_out = _run(slots_eng, prompts, a.max_new)
    p_row, p_out = _run(paged_eng, prompts, a.max_new)
    summary = dict(
        concurrent_requests_paged_over_slots=round(p_row["max_concurrent"] / s_row["max_concurrent"], 3),
        tokens_per_s_paged_over_slots=round(p_row["tokens_per_s"] / s_row["tokens_per_s"], 3),
        batched_equals_serial=p_out == s_out,
        longest_prompt_served=max(len(p) for p, o in zip(prompts, p_out) if len(o) == a.max_new),
        pages_leaked=p_row["pages_leaked"],
        retraces_after_warmup=s_row["retraces_after_warmup"] + p_row["retraces_after_warmup"],
        default_layout=paged_eng.config.kv_layout,
    )  # fmt: skip
    config = dict(vars(a), kv_positions=a.slots * a.max_len, num_pages=num_pages, gamma=GAMMA,
                  target="tiny qwen2 (4 layers, 64 wide), random", platform=platform.machine())  # fmt: skip
    out = dict(config=config, slots=s_row, paged=p_row, summary=summary, stall=stall)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
