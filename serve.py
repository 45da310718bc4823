#!/usr/bin/env python
"""Speculative generation from a trained run directory (the HTTP server is a later issue).

    python serve.py generate --run-dir runs/tiny --drafter dspark --prompt "What is 12 plus 30?"
    python serve.py generate --run-dir runs/tiny --prompt "..." --temperature 0 --policy dspark

Loads the target (HF checkpoint) and the drafter's best checkpoint from the run directory,
applies the chat template, decodes speculatively (exact: the output follows the target's
distribution at any temperature / top-k / top-p) and prints the text with τ.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="speculative generation for one or more prompts")
    g.add_argument("--run-dir", required=True)
    g.add_argument("--drafter", default="dspark", choices=("dspark", "dflash", "eagle3"))
    g.add_argument("--prompt", action="append", required=True, help="repeatable (a batch)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--policy", default="fixed", choices=("fixed", "threshold", "dspark"),
        help="verification length: fixed γ, static confidence threshold, or Algorithm 1 "
        "(DSpark only; uses the calibrated confidences and --cost-profile)",
    )  # fmt: skip
    g.add_argument("--threshold", type=float, default=0.5)
    g.add_argument("--cost-profile", default="", help="decode_cost.py JSON (SPS(B) table)")
    args = ap.parse_args(argv)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dspark_jax.config import ConfigError
    from dspark_jax.pipeline_config import PipelineConfig, from_json
    from dspark_jax.train.data import encode_prompt
    from dspark_jax.train.pipeline import Pipeline

    cfg_path = os.path.join(args.run_dir, "config.json")
    if not os.path.exists(cfg_path):
        print(f"error: {cfg_path} not found; run train.py first", file=sys.stderr)
        return 2
    saved = json.load(open(cfg_path))
    try:
        cfg = from_json(PipelineConfig, saved)
        pipe = Pipeline(cfg, log=lambda *_: None)
        tok = pipe.tokenizer()
        dec = pipe.decoder(args.drafter)
        policy = _policy(args, pipe, dec)
        prompts = [encode_prompt(tok, p).tolist() for p in args.prompt]
        t0 = time.perf_counter()
        res = dec.generate(
            prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, seeds=[args.seed + i for i in range(len(prompts))],
            stop_ids=pipe.stop_ids(), policy=policy,
        )  # fmt: skip
        dt = time.perf_counter() - t0
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p, r in zip(args.prompt, res):
        text = tok.decode(r.tokens, skip_special_tokens=True)
        tau = (sum(r.num_accepted) + len(r.num_accepted) - sum(r.eos)) / max(len(r.num_accepted), 1)
        print(
            f">>> {p}\n{text}\n[{len(r.tokens)} tokens, {len(r.num_accepted)} rounds, τ={tau:.2f}]"
        )
    print(f"[{sum(len(r.tokens) for r in res) / dt:.1f} tokens/s incl. compilation]")
    return 0


def _policy(args, pipe, dec):
    if args.policy == "fixed":
        return None
    import numpy as np

    from dspark_jax.sched import policies
    from dspark_jax.sched.sts import STS

    if dec.dcfg.kind != "dspark":
        raise ValueError(f"--policy {args.policy} needs confidences: use --drafter dspark")
    sts_path = pipe.stage_dir("calibrate") / "sts.json"
    sts = STS.load(sts_path) if sts_path.exists() else STS.identity(dec.dcfg.block_size)
    if args.policy == "threshold":
        pol = policies.StaticThreshold(args.threshold)
    else:
        from dspark_jax.sched.cost import CostProfile

        if not args.cost_profile:
            raise ValueError("--policy dspark needs --cost-profile (benchmarks/decode_cost.py)")
        pol = policies.CausalGreedy(CostProfile.load(args.cost_profile))

    def choose(conf_logits):
        return pol(sts.probs(np.asarray(conf_logits)))

    return choose


if __name__ == "__main__":
    sys.exit(main())
