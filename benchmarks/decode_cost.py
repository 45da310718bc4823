"""Cost curve of the serving engine's packed verification round, written as the scheduler's
`CostProfile`.

What is timed is exactly what a scheduled round pays: `ServingEngine.step()` with R running
requests each verifying g drafts (a `FixedGamma(g)` policy), i.e. one packed target forward over
the token bucket holding R * (g + 1) tokens, `verify_core`, the commit, the next block's
proposal and the host's single read-back. Points (R, g) cover every token bucket of the engine;
each point's step time is the minimum over interleaved repetitions (other processes only add
time). The profile folds the points by the bucket they run in (`layout="tokens"`, the engine's
`token_buckets`), so Algorithm 1 charges exactly what the engine runs.

Also reported, as ratios inside this run: the step time of the largest bucket over the smallest
one (how much verifying every draft of every slot costs over verifying none) and a least-squares
fit `alpha + beta * tokens` with its R^2 (how well the cost tracks R + sum l_r).

Both KV layouts are timed in the same run, their points interleaved: the slot cache (every slot
`max_len` positions) and the paged cache (a pool of `--page-size` pages holding as many
positions, so equal KV memory). Each gets its own fit (`layouts`), and `paging_overhead` is the
paged engine's step time over the slot engine's (geometric mean over the points, and per point).
The profile written is the first layout's of `--kv-layouts`.

    python benchmarks/decode_cost.py --model tiny  [--out benchmarks/results/decode_cost.tiny.json]
    python benchmarks/decode_cost.py --model demo  # the demo's 16 x 160 target, random weights
    python benchmarks/decode_cost.py --run-dir runs/tiny   # the demo's target + DSpark drafter
                                                           # (writes <run>/cost_profile.json)
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dspark_jax import drafters  # noqa: E402
from dspark_jax.compat import device_name, target_shape_key  # noqa: E402
from dspark_jax.config import DrafterConfig  # noqa: E402
from dspark_jax.engine import RequestParams, ServingEngine  # noqa: E402
from dspark_jax.models import init_params  # noqa: E402
from dspark_jax.models.transformer import param_count  # noqa: E402
from dspark_jax.sched import CostProfile, FixedGamma  # noqa: E402
from dspark_jax.testing import (  # noqa: E402
    small_target_config,
    tiny_drafter_config,
    tiny_target_config,
)

MODELS = {"tiny": tiny_target_config, "small": small_target_config, "demo": None}


def demo_models(gamma: int):
    """The demo preset's target (configs/tiny.py, 16 x 160) and DSpark drafter, random weights."""
    from dspark_jax.cli.train import load_config

    cfg = load_config("configs/tiny.py")
    tcfg, d = cfg.target.model, cfg.drafters
    dcfg = DrafterConfig.dspark(
        tcfg, block_size=gamma, num_layers=d.num_layers, num_anchors=d.num_anchors,
        mask_token_id=tcfg.vocab_size - 1, markov_rank=d.markov_rank,
    )  # fmt: skip
    return tcfg, dcfg


def random_models(name: str, gamma: int):
    if name == "demo":
        tcfg, dcfg = demo_models(gamma)
    else:
        tcfg = MODELS[name]()
        dcfg = tiny_drafter_config("dspark", target=tcfg, block_size=gamma, num_layers=1)
    tp = init_params(tcfg, 0)
    return tcfg, tp, dcfg, drafters.init_params(dcfg, target_params=tp)


def measure_points(num_slots: int, gamma: int) -> list[tuple[int, int]]:
    """(R, g) points: R in powers of two up to num_slots (and num_slots), g in {0, 1, .., γ}
    thinned to at most 4 values."""
    rs = sorted(
        {1 << i for i in range(num_slots.bit_length()) if 1 << i <= num_slots} | {num_slots}
    )
    gs = sorted({0, 1, max(1, gamma // 2), gamma})
    return [(r, g) for r in rs for g in gs]


def time_points(engines: dict, points, *, context: int, steps: int, repeats: int) -> dict:
    """{layout: {(R, g): seconds per engine step}}, min over `repeats` repetitions; each point
    is timed on every engine in turn (interleaved, so a busy machine slows both alike)."""
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


def engine_layout(eng: ServingEngine) -> dict:
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", choices=sorted(MODELS))
    ap.add_argument("--run-dir", default="", help="use the run's target + DSpark drafter")
    ap.add_argument("--num-slots", type=int, default=8)
    ap.add_argument("--gamma", type=int, default=4, help="random models only (block size)")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per point and repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--kv-layouts",
        default="slots,paged",
        help="engines timed (interleaved); the first one's profile is written",
    )
    ap.add_argument("--page-size", type=int, default=16, help="the paged engine's page")
    ap.add_argument("--out", default="", help="profile JSON path")
    args = ap.parse_args(argv)

    if args.run_dir:
        from dspark_jax.run.rundir import RunDir

        run = RunDir(args.run_dir)
        tcfg, tp = run.target()
        dcfg, dp = run.drafter("dspark")
        out = args.out or str(run.cost_profile_path())
        name = f"run:{args.run_dir}"
    else:
        tcfg, tp, dcfg, dp = random_models(args.model, args.gamma)
        default = "decode_cost.json" if args.model == "small" else f"decode_cost.{args.model}.json"
        out = args.out or os.path.join(os.path.dirname(__file__), "results", default)
        name = args.model
    max_len = min(args.max_len, tcfg.max_position_embeddings)
    engines, warm_s, compiled = {}, {}, {}
    for layout in args.kv_layouts.split(","):
        engines[layout] = ServingEngine(
            tcfg, dcfg, tp, dp, num_slots=args.num_slots, max_len=max_len,
            prompt_buckets=(args.context,), modes=("greedy",), kv_layout=layout,
            page_size=args.page_size,
        )  # fmt: skip
        t0 = time.perf_counter()
        engines[layout].warmup()
        warm_s[layout] = time.perf_counter() - t0
        compiled[layout] = engines[layout].compilations
    best = time_points(
        engines,
        measure_points(args.num_slots, dcfg.block_size),
        context=args.context,
        steps=args.steps,
        repeats=args.repeats,
    )
    meta = {
        "target": target_shape_key(tcfg),  # what the profile is refused for elsewhere
        "device": device_name(),
        "model": name,
        "params": param_count(tp),
        "context": args.context,
    }
    layouts = {}
    for layout, eng in engines.items():
        prof, d = profile_from(eng, best[layout], {**meta, **engine_layout(eng)})
        layouts[layout] = {
            "warmup_s": warm_s[layout],
            "retraces_after_warmup": eng.compilations - compiled[layout],
            **d["cost_profile"]["meta"]["summary"],
            "steps_per_s": dict(zip(map(str, prof.tokens), prof.steps_per_s)),
        }
        if len(layouts) == 1:
            written, first = d, layout
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(written, f, indent=1)
    os.replace(tmp, out)
    result = {"out": out, "profile_layout": first, **written["cost_profile"]["meta"],
              "layouts": layouts}  # fmt: skip
    if {"slots", "paged"} <= set(engines):
        result["paging_overhead"] = overhead(best, "paged", "slots")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
