"""The serving engine's cost curve, measured: the `CostProfile` Algorithm 1 charges.

What is timed is exactly what a scheduled round pays: `ServingEngine.step()` with R running
requests each verifying g drafts (a `FixedGamma(g)` policy), i.e. one packed target forward over
the token bucket holding R * (g + 1) tokens, `verify_core`, the commit, the next block's
proposal and the host's single read-back. Points (R, g) cover every token bucket of the engine
(`measure_points`); each point's step time is the minimum over interleaved repetitions
(`time_points`: other processes only add time). `profile_from` folds the points by the bucket
they run in (`layout="tokens"`, the engine's `token_buckets`), so Algorithm 1 charges exactly
what the engine runs; `measure_profile` is the three for one engine.

Used by benchmarks/decode_cost.py (which writes the profile) and benchmarks/serving_frontier.py
(which measures one when the run has none).
"""

from __future__ import annotations

import time

import numpy as np

from dspark_jax.engine import RequestParams, ServingEngine
from dspark_jax.sched import CostProfile, FixedGamma

__all__ = [
    "engine_layout",
    "measure_points",
    "measure_profile",
    "overhead",
    "profile_from",
    "time_points",
]


def measure_points(num_slots: int, gamma: int) -> list[tuple[int, int]]:
    """(R, g) points: R in powers of two up to num_slots (and num_slots), g in {0, 1, .., γ}
    thinned to at most 4 values."""
    rs = sorted(
        {1 << i for i in range(num_slots.bit_length()) if 1 << i <= num_slots} | {num_slots}
    )
    gs = sorted({0, 1, max(1, gamma // 2), gamma})
    return [(r, g) for r in rs for g in gs]


def time_points(engines: dict, points, *, context: int, steps: int, repeats: int) -> dict:
    """{name: {(R, g): seconds per engine step}} for `engines` {name: ServingEngine}, min over
    `repeats` repetitions; each point is timed on every engine in turn (interleaved, so a busy
    machine slows all alike)."""
    if isinstance(engines, ServingEngine):
        raise TypeError("time_points takes {name: engine}; for one engine: {'slots': eng}")
    best = {k: {p: float("inf") for p in points} for k in engines}
    for _ in range(repeats):
        for r, g in points:
            for k, eng in engines.items():
                sec = _time_point(eng, r, g, context=context, steps=steps)
                best[k][(r, g)] = min(best[k][(r, g)], sec)
    return best


def _time_point(eng: ServingEngine, r: int, g: int, *, context: int, steps: int) -> float:
    rng = np.random.default_rng(r * 100 + g)  # the same prompts on every engine
    max_new = min(eng.max_len - context - eng.gamma - 1, (steps + 2) * (eng.gamma + 1))
    eng.set_policy(FixedGamma(g))
    handles = [
        eng.submit(
            rng.integers(0, eng.tcfg.vocab_size - 1, context).tolist(),
            RequestParams(max_new, temperature=0.0),
        )
        for _ in range(r)
    ]
    eng.step()  # admission + a first round, untimed
    t0 = time.perf_counter()
    done = 0
    for _ in range(steps):
        eng.step()
        done += 1
        if sum(1 for h in handles if not h.finished) < r:
            break
    sec = (time.perf_counter() - t0) / done
    for h in handles:
        h.cancel()
    while eng.has_work():
        eng.step()
    return sec


def profile_from(eng: ServingEngine, best: dict, meta: dict) -> tuple[CostProfile, dict]:
    """(profile, its JSON dict with the raw `measurements` and `meta` + a fit `summary`) from
    one engine's {(R, g): seconds} (`time_points(...)[name]`)."""
    buckets = eng.token_buckets
    by_bucket: dict[int, list[float]] = {}
    rows = []
    for (r, g), sec in sorted(best.items()):
        t = r * (g + 1)
        b = next(x for x in buckets if x >= t)
        by_bucket.setdefault(b, []).append(sec)
        rows.append(
            {"batch": r, "tokens_per_request": g + 1, "bucket": b, "steps_per_s": 1.0 / sec}
        )
    tokens = sorted(by_bucket)
    step = [float(np.mean(by_bucket[b])) for b in tokens]
    prof = CostProfile(tuple(tokens), tuple(1.0 / s for s in step), "tokens", buckets)
    x, y = np.asarray(tokens, float), np.asarray(step)
    beta, alpha = np.polyfit(x, y, 1) if len(x) > 1 else (0.0, y[0])
    pred = alpha + beta * x
    ss = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - pred) ** 2)) / ss if ss > 0 else 1.0
    summary = {
        "largest_over_smallest_bucket": step[-1] / step[0],
        "tokens_range": [tokens[0], tokens[-1]],
        "fit_alpha_s": float(alpha),
        "fit_beta_s_per_token": float(beta),
        "fit_r2": r2,
        "alpha_in_tokens": float(alpha / beta) if beta > 0 else None,
    }
    d = prof.to_dict()
    d["cost_profile"]["measurements"] = rows
    d["cost_profile"]["meta"] = {**meta, "summary": summary}
    return prof, d


def measure_profile(
    eng: ServingEngine, *, context: int, steps: int, repeats: int, meta: dict | None = None
) -> tuple[CostProfile, dict]:
    """`profile_from` of one engine timed at `measure_points(eng.num_slots, eng.gamma)`."""
    points = measure_points(eng.num_slots, eng.gamma)
    best = time_points({"engine": eng}, points, context=context, steps=steps, repeats=repeats)
    return profile_from(eng, best["engine"], meta or {})


def engine_layout(eng: ServingEngine) -> dict:
    """The engine's shape as a profile's `meta` records it."""
    c = eng.config
    return {
        "engine": "ServingEngine packed round",
        "kv_layout": c.kv_layout,
        "num_slots": eng.num_slots,
        "gamma": eng.gamma,
        "max_len": eng.max_len,
        "token_buckets": list(eng.token_buckets),
        "cache_buckets": list(eng.cache_buckets),
        **({"page_size": c.page_size, "num_pages": c.num_pages} if c.kv_layout == "paged" else {}),
    }


def overhead(best: dict, over: str, base: str) -> dict:
    """`over`'s step time over `base`'s: geometric mean over the points, and per point."""
    ratios = {f"{r}x{g + 1}": best[over][(r, g)] / best[base][(r, g)] for r, g in best[base]}
    return {
        "geomean": float(np.exp(np.mean(np.log(list(ratios.values()))))),
        "per_point_requests_x_tokens": ratios,
    }
