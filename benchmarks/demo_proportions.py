"""Choose the demo's proportions by measurement: target depth x width vs drafter depth (issue 13).

Random weights (timing only), batch 1, temperature 1, one process, every component timed once per
repetition in a shuffled order (interleaved), medians reported. For each candidate target:

* `step_ms`: one plain decode token inside `generate()`'s device loop (marginal cost of 64 more
  tokens, so prefill and dispatch are excluded);
* `verify_ms[T]`: one blocked target forward of T tokens against a filled KV cache (T = γ+1 is
  the verify forward; `--verify-sweep` adds T = 1..16);
* per drafter (DSpark with 1/2/3 backbone layers, Eagle3): `draft_ms` (its context update and
  γ drafts, sampled, inside the verify loop as a round runs them; `propose_call_ms` the proposal
  as a program of its own, what results before s22 call `propose_ms`) and `round_ms` (one
  `ServingEngine.step()` of a 1-slot engine at fixed γ: scheduler, packed round, read-back,
  host commit; `eval.speed.round_breakdown`);
* `resident`: the first drafter's round with `--rounds-per-call` device-resident rounds per host
  call (the demo's 16), its host and drafting shares, as the demo's speed section reports them;
* derived: `draft_share_of_verify` = drafting / verify(γ+1), `round_in_steps` = round / step,
  and `ideal_speedup` = τ · step / round at the plausible τ given by `--tau`.

    python benchmarks/demo_proportions.py [--reps 9] [--tau 3.3] [--out FILE]
    python benchmarks/demo_proportions.py --smoke   # seconds: the same path and keys for one
        # target, `smoke` (testing.smoke_models' 4 x 64 target, its DSpark drafter and Eagle3,
        # γ = 2), a 16-token prompt, 1 repetition, 2 resident rounds, T = 1 and γ + 1 only

Prints one JSON object. Absolute times on a shared CPU are noise; read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from dspark_jax import drafters  # noqa: E402
from dspark_jax.config import DrafterConfig, TargetConfig, default_target_layer_ids  # noqa: E402
from dspark_jax.eval import speed  # noqa: E402
from dspark_jax.models import init_params  # noqa: E402
from dspark_jax.testing import smoke_drafter_config, smoke_models  # noqa: E402

VOCAB = 2048
# (layers, hidden, intermediate, heads, kv heads): comparable parameter budgets in the layers
CANDIDATES = {
    "6x256": (6, 256, 512, 4, 2),
    "12x192": (12, 192, 384, 3, 1),
    "16x160": (16, 160, 320, 2, 1),
    "12x256": (12, 256, 512, 4, 2),
    "24x128": (24, 128, 256, 2, 1),
    "32x112": (32, 112, 224, 2, 1),
    # the chosen width, deeper: twice and three times the chosen target's cost (s24)
    "32x160": (32, 160, 320, 2, 1),
    "48x160": (48, 160, 320, 2, 1),
}
DEFAULT_TARGETS = ("6x256", "12x192", "16x160", "12x256")  # the others: --targets (s21, s24)


def target_config(name: str) -> TargetConfig:
    n, h, i, nh, kv = CANDIDATES[name]
    return TargetConfig(
        architecture="qwen3", vocab_size=VOCAB, hidden_size=h, intermediate_size=i,
        num_layers=n, num_heads=nh, num_kv_heads=kv, head_dim=h // nh if h // nh <= 96 else 64,
        rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=1024,
        target_layer_ids=default_target_layer_ids(n),
    )  # fmt: skip


def drafter_config(kind: str, tcfg: TargetConfig, layers: int, gamma: int) -> DrafterConfig:
    if kind == "eagle3":
        return DrafterConfig.eagle3(tcfg, block_size=gamma)
    kw = dict(block_size=gamma, num_layers=layers, num_anchors=64, mask_token_id=VOCAB - 1)
    if kind == "dflash":
        return DrafterConfig.dflash(tcfg, **kw)
    return DrafterConfig.dspark(tcfg, markov_rank=64, **kw)


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure_target(name: str, args) -> dict:
    if name == "smoke":  # the smoke runs' models (their programs shared with the other smokes')
        tcfg, tp, _, _ = smoke_models()
    else:
        tcfg = target_config(name)
        tp = init_params(tcfg, 0)
    g, plen = args.gamma, args.prompt_len
    prompt = [
        int(x) for x in jax.random.randint(jax.random.key(1), (plen,), 4, tcfg.vocab_size - 1)
    ]
    kinds = [("dspark", n) for n in args.dspark_layers] + [("eagle3", 1)]
    ds = {}
    for kind, layers in kinds:
        if name == "smoke" and kind == "dspark":
            dcfg = smoke_drafter_config(tcfg)
        else:
            dcfg = drafter_config(kind, tcfg, layers, g)
        label = f"{kind}{layers}L" if kind != "eagle3" else "eagle3"
        ds[label] = (dcfg, drafters.init_params(dcfg, target_params=tp))
    ts = (1, 2, 4, 8, 12, 16) if args.verify_sweep else (1,)
    # the serving engine's own programs, interleaved, medians (eval/speed.py)
    bd = speed.round_breakdown(tcfg, tp, ds, prompt, temperature=1.0, reps=args.reps,
                               verify_tokens=ts, resident_rounds=args.rounds_per_call)  # fmt: skip
    step = bd["step_ms"]
    verify = bd["verify_forward_ms"][g + 1]
    out = {
        "target": {"layers": tcfg.num_layers, "hidden": tcfg.hidden_size,
                   "intermediate": tcfg.intermediate_size, "feature_layers": tcfg.target_layer_ids,
                   "params": int(sum(x.size for x in jax.tree.leaves(tp)))},
        "step_ms": step,
        "verify_ms": bd["verify_forward_ms"],
        "verify_in_steps": bd["verify_forward_in_steps"],
        "compilations_during_timing": bd["compilations_during_timing"],
        "drafters": {},
    }  # fmt: skip
    for label, row in bd["drafters"].items():
        p, r = row["draft_ms"], row["round_ms"]
        out["drafters"][label] = {
            "draft_ms": p,
            "propose_call_ms": row["propose_call_ms"],
            "round_ms": r,
            "host_ms": row["host_ms"],
            "draft_share_of_verify": p / verify,
            "draft_share_of_round": p / r,
            "round_in_steps": r / step,
            "ideal_speedup_at_tau": args.tau * step / r,
        }
    if "resident" in bd:  # the first drafter with device-resident rounds, as the demo serves
        rs = bd["resident"]
        out["resident"] = {**rs, "ideal_speedup_at_tau": args.tau * step / rs["round_ms"]}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default=",".join(DEFAULT_TARGETS))
    ap.add_argument("--dspark-layers", default="1,2,3")
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--tau", type=float, default=3.3)
    ap.add_argument(
        "--rounds-per-call",
        type=int,
        default=16,
        help="device-resident rounds per host call of the first drafter (the demo's 16)",
    )
    ap.add_argument("--verify-sweep", action="store_true", help="verify forward for T = 1..16")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="seconds-sized run, the same keys")
    args = ap.parse_args(argv)
    if args.smoke:
        args.targets, args.dspark_layers, args.gamma, args.prompt_len = "smoke", "1", 2, 16
        args.reps, args.rounds_per_call, args.verify_sweep = 1, 2, False
    try:
        args.dspark_layers = [int(x) for x in args.dspark_layers.split(",") if x]
    except ValueError:
        ap.error(f"--dspark-layers {args.dspark_layers!r}: give integers, comma-separated")
    unknown = [n for n in args.targets.split(",") if n not in CANDIDATES and not args.smoke]
    if unknown:
        ap.error(f"--targets: unknown {','.join(unknown)}; choose from {','.join(CANDIDATES)}")
    if args.rounds_per_call < 1 or args.reps < 1:
        ap.error("--rounds-per-call and --reps must be at least 1")
    t0 = time.time()
    res = {"gamma": args.gamma, "tau_assumed": args.tau, "reps": args.reps, "targets": {}}
    for name in args.targets.split(","):
        res["targets"][name] = measure_target(name, args)
    res["seconds"] = time.time() - t0
    res["load_avg_1min"] = os.getloadavg()[0]
    text = json.dumps(res, indent=1, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return res


if __name__ == "__main__":
    main()
