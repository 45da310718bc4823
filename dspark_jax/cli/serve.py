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

from dspark_jax.cli import serve_http
from dspark_jax.cli.common import positive_int, start_runtime
from dspark_jax.launch import add_distributed_flags


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
    # heavy: the engine, orbax, transformers: 1.0-1.7 s to import with jax loaded (python -X
    # importtime, 2-core machine); `serve.py --help` and `bench` never pay it
    from dspark_jax.cli import serve_engine

    return serve_engine.generate(args)


if __name__ == "__main__":
    sys.exit(main())
