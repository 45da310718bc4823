"""Speculative generation from a trained run directory, and the OpenAI-compatible HTTP server.

    python serve.py generate --run-dir runs/tiny --drafter dspark --prompt "What is 12 plus 30?"
    python serve.py generate --run-dir runs/tiny --prompt "..." --temperature 0 --policy dspark
    python serve.py serve --run-dir runs/tiny --host 127.0.0.1 --port 8000
    python serve.py serve --run-dir runs/qwen3_4b_dspark --mesh 1,1,8   # tensor parallel, 8 devices
    python serve.py bench --url http://127.0.0.1:8000 --requests 1000
    python serve.py export --run-dir runs/tiny --drafter dspark --out ckpt/dspark-tiny

Loads the target (HF checkpoint) and the drafter's best checkpoint from the run directory,
applies the chat template, decodes speculatively (exact: the output follows the target's
distribution at any temperature / top-k / top-p) and prints the text with τ.
"""

from __future__ import annotations

import argparse
import sys
import time

from dspark_jax.cli import serve_http
from dspark_jax.cli.common import positive_int, report, start_runtime, user_errors
from dspark_jax.launch import add_distributed_flags, init_distributed


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="speculative generation for one or more prompts")
    g.add_argument("--run-dir", required=True)
    g.add_argument("--drafter", default="dspark", choices=("dspark", "dflash", "eagle3"))
    g.add_argument("--prompt", action="append", required=True, help="repeatable (a batch)")
    g.add_argument("--max-new-tokens", type=positive_int, default=128)
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
    g.add_argument("--drafter-context-window", type=int, default=None, metavar="W",
                   help="DSpark/DFlash: draft from the last W context positions only (default: "
                        "as trained; may narrow the trained window, not widen it)")  # fmt: skip
    g.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    g.add_argument("--mesh", default="", metavar="DATA,FSDP,TENSOR",
                   help="device mesh, e.g. 1,1,8 = tensor parallel over 8 devices")  # fmt: skip
    add_distributed_flags(g)  # every process gets the same prompts (SPMD)
    serve_http.add_subcommands(sub)  # `serve`, `bench` (HTTP server, load test) and `export`
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.cmd == "bench":  # an HTTP client: no jax, no runtime line before its JSON
        return serve_http.run(args)
    start_runtime()  # warm-up compiles every bucket; a restart reads them back
    if args.cmd in ("serve", "export"):
        return serve_http.run(args)
    return generate(args)


def generate(args) -> int:
    """`serve.py generate`: decode the prompts speculatively and print them with τ."""
    # loaded here, after the flags are parsed: models, jax and transformers (~2.5 s)
    from dspark_jax.engine.sharding import mesh_from_flag
    from dspark_jax.run.rundir import RunDir
    from dspark_jax.spec.sampling import validate_sampling_params
    from dspark_jax.templates import encode_prompt

    try:
        # the knobs and the policy's inputs are checked before any model is loaded
        validate_sampling_params(args.temperature, args.top_k, args.top_p)
        init_distributed(args.coordinator, args.num_processes, args.process_id, args.distributed)
        run = RunDir(args.run_dir, mesh=mesh_from_flag(args.mesh))
        policy = _policy(args, run)
        tok = run.tokenizer()
        prompts = [encode_prompt(tok, p).tolist() for p in args.prompt]
        dec = run.decoder_for(args.drafter, [len(p) for p in prompts], args.max_new_tokens,
                              context_window=args.drafter_context_window)  # fmt: skip
        if policy:
            name, kw = policy
            dec.set_policy(name, **kw)
        t0 = time.perf_counter()
        res = dec.generate(
            prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, seeds=[args.seed + i for i in range(len(prompts))],
            stop_ids=run.stop_ids(),
        )  # fmt: skip
        dt = time.perf_counter() - t0
    except user_errors() as e:
        return report(e, args.debug)
    for p, r in zip(args.prompt, res):
        text = tok.decode(r.tokens, skip_special_tokens=True)
        tau = (sum(r.num_accepted) + len(r.num_accepted) - sum(r.eos)) / max(len(r.num_accepted), 1)
        print(
            f">>> {p}\n{text}\n[{len(r.tokens)} tokens, {len(r.num_accepted)} rounds, τ={tau:.2f}]"
        )
    print(f"[{sum(len(r.tokens) for r in res) / dt:.1f} tokens/s incl. compilation]")
    return 0


def _policy(args, run):
    """The verification policy as `(name, kwargs)` for the decoder's `set_policy`, or None for
    fixed γ (the engine's default); its inputs are checked before the decoder is built."""
    # jax: imported after the flags are parsed (serve.py imports this module before its re-run)
    from dspark_jax.compat import check_threshold, load_cost_profile
    from dspark_jax.sched.sts import STS

    if args.policy == "fixed":
        return None
    if args.drafter != "dspark":
        raise ValueError(f"--policy {args.policy} needs confidences: use --drafter dspark")
    sts = run.sts("dspark") or STS.identity(run.config.drafters.block_size)
    if args.policy == "threshold":
        check_threshold(args.threshold, "--threshold")
        return "threshold", dict(threshold=args.threshold, sts=sts)
    cost = load_cost_profile(args.cost_profile) if args.cost_profile else run.cost_profile()
    if cost is None:
        raise ValueError(
            f"--policy dspark needs a cost profile — pass --cost-profile FILE or put one at "
            f"{run.cost_profile_path()} (benchmarks/decode_cost.py writes it)"
        )
    return "alg1", dict(cost_profile=cost, sts=sts)


if __name__ == "__main__":
    sys.exit(main())
