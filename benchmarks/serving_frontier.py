"""The serving frontier: per-user speed vs aggregate throughput under closed-loop load, per policy.

One `ServingEngine` (slots = the largest concurrency, every bucket compiled once by warmup());
policies are swapped on the host (`set_policy`, nothing recompiles). For each concurrency c and
each policy (policies interleaved, `--repeats` times, the median-throughput repeat reported), c
client threads each submit a request, wait for it and submit the next, for
`--rounds-per-client` requests each. Per point: per-user tokens/s (mean over requests of tokens /
latency), aggregate tokens/s (all tokens / wall time), mean accepted length τ and draft tokens
verified per round (from the engine's metrics).

    python benchmarks/serving_frontier.py --run-dir runs/tiny --temperature 1 --prompt-len 96
                                       # the demo's models and held-out prompts, sampled
    python benchmarks/serving_frontier.py --synthetic      # test models that agree often
    python benchmarks/serving_frontier.py --smoke          # seconds: the same path and keys
                                                           # (synthetic unless --run-dir)

`--smoke`: concurrency 1 and 2, one request per client, 8 new tokens, one repeat, one token
bucket (one round program to compile), γ = 3 for the synthetic models, the cost profile (when
the run has none, or --synthetic without --cost-profile) measured in one step per point; the
JSON and PNG go to a temporary directory unless --out.

Prints one JSON object with a `summary` (alg1_over_fixed_envelope_min,
alg1_over_mtp1_at_matched_speed, retraces_after_warmup) and writes a PNG next to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from dspark_jax.engine import RequestParams, ServingEngine  # noqa: E402
from dspark_jax.eval.decode_cost import measure_profile  # noqa: E402
from dspark_jax.sched import CostProfile  # noqa: E402
from dspark_jax.testing import agreeing_pair  # noqa: E402

OUT = "benchmarks/results/serving_frontier.json"


def load_models(args):
    if args.synthetic:
        gamma = 3 if args.smoke else 7
        tcfg, tp, dcfg, dp = agreeing_pair(vocab=64, gamma=gamma, max_position_embeddings=1024)
        cost = CostProfile.load(args.cost_profile) if args.cost_profile else None
        return tcfg, tp, dcfg, dp, None, cost
    from dspark_jax.run.rundir import RunDir

    run = RunDir(args.run_dir)
    tcfg, tp = run.target()
    dcfg, dp = run.drafter("dspark")
    cost = CostProfile.load(args.cost_profile) if args.cost_profile else run.cost_profile()
    return tcfg, tp, dcfg, dp, run.sts("dspark"), cost


def run_prompts(run_dir: str, max_tokens: int) -> list[list[int]]:
    """The run's held-out prompts (corpus/heldout_*.jsonl, first turn, chat template applied)
    of at most `max_tokens` tokens, domains interleaved."""
    import pathlib

    from dspark_jax.run.rundir import RunDir
    from dspark_jax.templates import encode_prompt

    tok = RunDir(run_dir).tokenizer()
    per_domain = []
    for f in sorted((pathlib.Path(run_dir) / "corpus").glob("heldout_*.jsonl")):
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        ids = [encode_prompt(tok, r["turns"][0]).tolist() for r in rows]
        per_domain.append([p for p in ids if len(p) <= max_tokens])
    out = [p for group in zip(*per_domain) for p in group]
    if len(out) < 8:
        sys.exit(f"error: only {len(out)} held-out prompts of <= {max_tokens} tokens in "
                 f"{run_dir}/corpus — raise --prompt-len")  # fmt: skip
    return out


def policies(gamma: int, threshold: float):
    out = {"mtp1": ("mtp1", {})}
    for g in (3, 7):
        if g <= gamma:
            out[f"fixed{g}"] = ("fixed", {"gamma": g})
    if gamma not in (3, 7):
        out[f"fixed{gamma}"] = ("fixed", {"gamma": gamma})
    out["threshold"] = ("threshold", {"threshold": threshold})
    out["alg1"] = ("alg1", {})
    out["async"] = ("async", {})
    return out


def closed_loop(
    eng, prompts, c: int, per_client: int, max_new: int, seed0: int, temperature: float = 0.0
) -> dict:
    lat, toks = [], []
    lock = threading.Lock()

    def client(i):
        for k in range(per_client):
            p = prompts[(i * per_client + k) % len(prompts)]
            t0 = time.perf_counter()
            h = eng.submit(p, RequestParams(max_new, temperature=temperature, seed=seed0 + i))
            out = h.result(timeout=600)
            dt = time.perf_counter() - t0
            with lock:
                lat.append(dt)
                toks.append(len(out.tokens))

    m0 = eng.metrics()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    m1 = eng.metrics()
    rounds = m1.rounds - m0.rounds
    emitted = m1.accepted_tokens - m0.accepted_tokens
    slot_rounds = (m1.draft_tokens - m0.draft_tokens) / eng.gamma  # request-rounds
    return {
        "concurrency": c,
        "requests": len(lat),
        "per_user_tokens_per_s": float(np.mean(np.asarray(toks) / np.asarray(lat))),
        "aggregate_tokens_per_s": float(sum(toks) / wall),
        "mean_accepted_length": float((emitted + slot_rounds) / max(slot_rounds, 1)),
        "verified_tokens_per_round": float((m1.verified_tokens - m0.verified_tokens) / rounds),
        "requests_per_round": float(slot_rounds / max(rounds, 1)),
        "latency_p50_s": float(np.percentile(lat, 50)),
    }


def scheduler_host_us(eng, table, cost, sts, reps: int = 200) -> dict:
    """Host time of each policy's `Scheduler.lengths` at R = slots (median of `reps` calls, µs):
    it sits between a round's read-back and the next dispatch, so it is round time."""
    from dspark_jax.engine.scheduler import Scheduler

    rho = np.random.default_rng(0).normal(2.0, 1.0, (eng.num_slots, eng.gamma))
    caps = np.full(eng.num_slots, eng.gamma)
    out = {}
    for name, (pol, kw) in table.items():
        sch = Scheduler(pol, eng.gamma, policy_gamma=kw.get("gamma"),
                        threshold=kw.get("threshold", 0.5), cost=cost, sts=sts,
                        token_buckets=eng.token_buckets,
                        has_confidence=eng.scheduler.has_confidence)  # fmt: skip
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            sch.lengths(rho, caps)
            ts.append(time.perf_counter() - t0)
        out[name] = float(np.median(ts) * 1e6)
    return out


def _aggregate_at(points, speed):
    """Aggregate throughput of a policy's curve at a per-user speed (linear in between, clamped
    at the ends)."""
    pts = sorted(points, key=lambda p: p["per_user_tokens_per_s"])
    x = [p["per_user_tokens_per_s"] for p in pts]
    y = [p["aggregate_tokens_per_s"] for p in pts]
    return float(np.interp(speed, x, y))


def summarize(results: dict) -> dict:
    fixed = [k for k in results if k.startswith("fixed")]
    ratios_env, ratios_mtp = [], []
    mtp = results.get("mtp1", [])
    lo = min(p["per_user_tokens_per_s"] for p in mtp) if mtp else 0
    hi = max(p["per_user_tokens_per_s"] for p in mtp) if mtp else 0
    for p in results.get("alg1", []):
        u, a = p["per_user_tokens_per_s"], p["aggregate_tokens_per_s"]
        if fixed:
            env = max(_aggregate_at(results[k], u) for k in fixed)
            ratios_env.append(a / env)
        if mtp and lo <= u <= hi:
            ratios_mtp.append(a / _aggregate_at(mtp, u))
    same_c = []
    for p in results.get("alg1", []):
        best = max(
            (q["aggregate_tokens_per_s"] for k in fixed for q in results[k]
             if q["concurrency"] == p["concurrency"]),
            default=None,
        )  # fmt: skip
        if best:
            same_c.append(p["aggregate_tokens_per_s"] / best)
    return {
        "alg1_over_best_fixed_same_concurrency": same_c,
        "alg1_over_fixed_envelope_min": min(ratios_env) if ratios_env else None,
        "alg1_over_fixed_envelope_per_concurrency": ratios_env,
        "alg1_over_mtp1_at_matched_speed": max(ratios_mtp) if ratios_mtp else None,
        "alg1_points_within_mtp1_speed_range": len(ratios_mtp),
    }


def plot(results: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, pts in results.items():
        pts = sorted(pts, key=lambda p: p["concurrency"])
        ax.plot([p["aggregate_tokens_per_s"] for p in pts],
                [p["per_user_tokens_per_s"] for p in pts], "o-", label=name)  # fmt: skip
    ax.set_xlabel("aggregate tokens/s")
    ax.set_ylabel("per-user tokens/s")
    ax.set_title("serving frontier (closed loop, concurrency 1..N)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--run-dir")
    src.add_argument("--synthetic", action="store_true")
    ap.add_argument(
        "--smoke", action="store_true", help="seconds-sized run (synthetic unless --run-dir)"
    )
    ap.add_argument("--cost-profile", default="")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--rounds-per-client", type=int, default=4, help="requests per client")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="interleaved repeats per point (the median-throughput one is reported)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy; the demo evaluates at 1"
    )
    ap.add_argument("--policies", nargs="*", default=None)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    cost_steps, cost_repeats, host_reps = 6, 2, 200
    if args.smoke:
        args.synthetic = not args.run_dir
        args.concurrency, args.rounds_per_client, args.repeats = [1, 2], 1, 1
        args.max_new_tokens = 8
        args.prompt_len = args.prompt_len if args.run_dir else 8
        cost_steps, cost_repeats, host_reps = 1, 1, 5
        if args.out == OUT:
            args.out = os.path.join(tempfile.mkdtemp(prefix="serving_frontier_"), "frontier.json")
    elif not (args.run_dir or args.synthetic):
        ap.error("one of --run-dir, --synthetic or --smoke is required")

    tcfg, tp, dcfg, dp, sts, cost = load_models(args)
    n = max(args.concurrency)
    max_len = args.prompt_len + args.max_new_tokens + dcfg.block_size + 8
    eng = ServingEngine(
        tcfg, dcfg, tp, dp, num_slots=n, max_len=max_len, prompt_buckets=(args.prompt_len,),
        modes=("greedy" if args.temperature == 0 else "sampled",), policy="fixed", sts=sts,
        **({"token_buckets": (n * (dcfg.block_size + 1),)} if args.smoke else {}),
    )  # fmt: skip
    if cost is None:  # measured on this engine (dspark_jax.eval.decode_cost)
        cost, _ = measure_profile(eng, context=args.prompt_len, steps=cost_steps,
                                  repeats=cost_repeats)  # fmt: skip
    t0 = time.perf_counter()
    eng.warmup()
    warm = eng.compilations
    rng = np.random.default_rng(0)
    if args.run_dir:  # the demo's own held-out prompts (code, prose, math)
        prompts = run_prompts(args.run_dir, args.prompt_len)
    else:
        prompts = [rng.integers(0, tcfg.vocab_size - 1, args.prompt_len).tolist()
                   for _ in range(64)]  # fmt: skip
    eng.start()
    table = {
        k: v for k, v in policies(eng.gamma, args.threshold).items()
        if not args.policies or k in args.policies
    }  # fmt: skip
    results = {name: [] for name in table}
    # concurrency outer, policies inner in a rotating order: the machine's load drifts over a
    # run (shared CPU), so every policy at one concurrency is measured at about the same time
    names = list(table)
    for i, c in enumerate(args.concurrency):
        reps: dict[str, list] = {name: [] for name in names}
        for k in range(args.repeats):
            j = (i + k) % len(names)
            for name in names[j:] + names[:j]:
                pol, kw = table[name]
                eng.set_policy(pol, cost_profile=cost, sts=sts, **kw)
                reps[name].append(closed_loop(
                    eng, prompts, c, args.rounds_per_client, args.max_new_tokens, 1000 * c,
                    args.temperature,
                ))  # fmt: skip
        for name in names:  # the repeat with the median aggregate throughput
            pts = sorted(reps[name], key=lambda p: p["aggregate_tokens_per_s"])
            point = dict(pts[len(pts) // 2])
            point["aggregate_tokens_per_s_repeats"] = [p["aggregate_tokens_per_s"] for p in pts]
            results[name].append(point)
            print(name, json.dumps(point), file=sys.stderr)
    for pts in results.values():
        pts.sort(key=lambda p: p["concurrency"])
    eng.shutdown(drain=True)
    summary = summarize(results)
    summary["retraces_after_warmup"] = eng.compilations - warm
    summary["scheduler_host_us_per_round"] = scheduler_host_us(eng, table, cost, sts, host_reps)
    summary["warmup_and_run_s"] = time.perf_counter() - t0
    out = {"config": vars(args), "gamma": eng.gamma, "results": results, "summary": summary}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    plot(results, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps(out["summary"], indent=1))
    return out


if __name__ == "__main__":
    main()
