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
The profile written is the first layout's of `--kv-layouts` (default `paged,slots`: the default
engine's). The measurement itself is
`dspark_jax.eval.decode_cost` (benchmarks/serving_frontier.py measures with it too).

    python benchmarks/decode_cost.py --model tiny  [--out benchmarks/results/decode_cost.tiny.json]
    python benchmarks/decode_cost.py --model demo  # the demo's 16 x 160 target, random weights
    python benchmarks/decode_cost.py --run-dir runs/tiny   # the demo's target + DSpark drafter
                                                           # (writes <run>/cost_profile.json)
    python benchmarks/decode_cost.py --smoke   # seconds: the same path and keys, tiny sizes
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from dspark_jax import drafters  # noqa: E402
from dspark_jax.compat import device_name, target_shape_key  # noqa: E402
from dspark_jax.config import DrafterConfig  # noqa: E402
from dspark_jax.engine import ServingEngine  # noqa: E402
from dspark_jax.eval.decode_cost import (  # noqa: E402
    engine_layout,
    measure_points,
    overhead,
    profile_from,
    time_points,
)
from dspark_jax.models import init_params  # noqa: E402
from dspark_jax.models.transformer import param_count  # noqa: E402
from dspark_jax.testing import (  # noqa: E402
    small_target_config,
    smoke_models,
    tiny_drafter_config,
    tiny_target_config,
)

MODELS = {"tiny": tiny_target_config, "small": small_target_config, "demo": None}
SMOKE_HELP = (
    "seconds-sized run of the same code path and JSON keys: 1 slot, testing.smoke_models (γ = 2) "
    "unless --run-dir, 16-token context, 2 steps, 1 repeat; the profile to a temporary file "
    "unless --out"
)


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
        default="paged,slots",
        help="engines timed (interleaved); the first one's profile is written",
    )
    ap.add_argument("--page-size", type=int, default=16, help="the paged engine's page")
    ap.add_argument("--out", default="", help="profile JSON path")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args(argv)
    if args.smoke:
        # device_check --smoke's serving engine: one process compiles it once for both
        args.num_slots, args.max_len, args.context = 1, 36, 16
        args.steps, args.repeats = 2, 1
        args.out = args.out or os.path.join(tempfile.mkdtemp(prefix="decode_cost_"), "cost.json")

    if args.run_dir:
        from dspark_jax.run.rundir import RunDir

        run = RunDir(args.run_dir)
        tcfg, tp = run.target()
        dcfg, dp = run.drafter("dspark")
        out = args.out or str(run.cost_profile_path())
        name = f"run:{args.run_dir}"
    elif args.smoke:
        tcfg, tp, dcfg, dp = smoke_models()
        out = args.out
        name = "smoke"
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
