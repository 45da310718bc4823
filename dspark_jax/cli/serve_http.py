"""`serve.py serve`, `bench` and `export`: their arguments, and the checks made before any model
loads.

    python serve.py serve --run-dir runs/tiny [--host 127.0.0.1 --port 8000]
    python serve.py serve --target ckpt/Qwen3-0.6B --drafter ckpt/dspark-qwen3 --policy alg1
    python serve.py bench --url http://127.0.0.1:8000 --requests 1000
    python serve.py export --run-dir runs/tiny --drafter dspark --out ckpt/dspark-tiny

Speculative knobs are fixed per server at start-up: the drafter, the verification policy
(default Algorithm 1, `alg1`, on DSpark's STS-calibrated confidences) and its cost profile
(`--cost-profile`, else the run's `cost_profile.json`, else a profile shipped with the package:
dspark_jax/data/decode_cost*.json, the one measured on the model closest in size, with a warning
in the log that it was measured on another model).

The flags are checked here, before any model loads; the commands that load one (`serve`,
`export`) run in cli/serve_engine.py, which `run` imports only then: it imports jax, the engine,
orbax and transformers, and `serve.py bench` (an HTTP client) never needs them.
"""

from __future__ import annotations

import logging

from dspark_jax import runtime
from dspark_jax.cli import bench
from dspark_jax.cli.common import report, user_errors
from dspark_jax.compat import check_threshold, load_cost_profile
from dspark_jax.config import DRAFTER_KINDS
from dspark_jax.launch import add_distributed_flags

POLICIES = ("alg1", "async", "threshold", "fixed", "mtp1")

log = logging.getLogger("dspark.serve")


def add_subcommands(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (FastAPI + uvicorn)")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", help="a run directory written by train.py")
    src.add_argument("--target", help="a Hugging Face target checkpoint directory")
    s.add_argument("--drafter", default="dspark",
                   help="with --run-dir: dspark | dflash | eagle3; with --target: the drafter "
                        "checkpoint directory")  # fmt: skip
    s.add_argument("--tokenizer", default="", help="with --target (default: the target's dir)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--model-name", default="", help="the `model` clients send (default: dir name)")
    s.add_argument("--policy", default=None, choices=POLICIES,
                   help="verification lengths (default alg1 = Algorithm 1; fixed for drafters "
                        "without confidences)")  # fmt: skip
    s.add_argument("--gamma", type=int, default=None, help="fixed policy: drafts verified")
    s.add_argument("--threshold", type=float, default=0.5, help="threshold policy")
    s.add_argument("--cost-profile", default="", help="decode_cost.py JSON for alg1 / async")
    s.add_argument("--num-slots", type=int, default=8,
                   help="rows: requests running at once at most (the page pool may admit fewer)")  # fmt: skip
    s.add_argument("--max-len", type=int, default=0,
                   help="prompt + completion tokens of a request, max (0: the target's "
                        "context)")  # fmt: skip
    s.add_argument("--drafter-context-window", type=int, default=None, metavar="W",
                   help="DSpark/DFlash: draft from the last W context positions only (default: "
                        "the window the drafter was trained with; may narrow it, not widen)")  # fmt: skip
    s.add_argument("--max-queue", type=int, default=256, help="waiting requests before 429")
    s.add_argument("--kv-layout", default="paged", choices=("paged", "slots"),
                   help="paged (default): K/V in a pool of pages, admission by free pages, "
                        "preemption by recompute; slots: every --num-slots row reserves "
                        "--max-len positions")  # fmt: skip
    s.add_argument("--page-size", type=int, default=16, help="positions per page")
    s.add_argument("--kv-memory-gb", type=float, default=0.0, metavar="GIB",
                   help="the page pool's memory per device (default: what the devices report, "
                        "less the params and the largest call; CPUs report none: --num-slots x "
                        "--max-len positions)")  # fmt: skip
    s.add_argument("--num-pages", type=int, default=0,
                   help="the page pool in pages, instead of --kv-memory-gb")  # fmt: skip
    s.add_argument("--device-memory-gib", type=float, default=0.0,
                   help="the devices' memory for the engine's plan (0: as they report; CPUs "
                        "report none); an engine that cannot fit is refused before its KV cache is created")  # fmt: skip
    s.add_argument("--prefill-tokens-per-step", type=int, default=0,
                   help="prompt tokens prefilled per engine step (whole 512-token chunks, at "
                        "least one; 0: no bound): a long prompt is prefilled over several "
                        "steps while running requests keep decoding")  # fmt: skip
    s.add_argument("--seed", type=int, default=0, help="root seed of the engine's sampling")
    s.add_argument("--mesh", default="", metavar="DATA,FSDP,TENSOR",
                   help="device mesh, e.g. 1,1,8 = tensor parallel over 8 devices (default: all "
                        "accelerator devices data parallel; one device on CPU)")  # fmt: skip
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGINT/SIGTERM: seconds open requests may take to finish")  # fmt: skip
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $DSPARK_API_KEY; unset: no authentication)")  # fmt: skip
    s.add_argument("--max-body-bytes", type=int, default=4 << 20,
                   help="larger request bodies are refused with 413 (default 4 MiB)")  # fmt: skip
    s.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take from arrival (queue included) before it is "
                        "cancelled and answered 504; 0: no limit")  # fmt: skip
    s.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    s.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    add_distributed_flags(s)  # process 0 serves HTTP, the others follow its rounds

    b = sub.add_parser("bench", help="load test (or --duration soak) of a server on 127.0.0.1")
    bench.add_arguments(b)

    e = sub.add_parser("export", help="a run's best drafter as a Hugging Face drafter checkpoint")
    e.add_argument("--run-dir", required=True, help="a run directory written by train.py")
    e.add_argument("--drafter", default="dspark", choices=DRAFTER_KINDS)
    e.add_argument("--out", required=True, help="a new (or empty) directory to write")
    e.add_argument("--debug", action="store_true", help="show tracebacks of errors")


def run(args) -> int:
    """Dispatch `serve` / `bench` / `export` (argparse namespace from `add_subcommands`)."""
    if args.cmd == "bench":
        return bench.run_cli(args)
    if args.cmd == "serve":
        # our start-up lines at --log-level; other libraries' (absl, orbax) at WARNING
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        log.setLevel(args.log_level.upper())
        try:
            check_limits(args)
            check_settings(args)
        except user_errors() as e:
            return report(e, args.debug)
    # heavy: jax, the engine, orbax, transformers: 1.9-3.0 s to import, 1.0-1.7 s with jax loaded
    # (python -X importtime, 2-core machine); `bench` and the flag checks above never pay it
    from dspark_jax.cli import serve_engine

    if args.cmd == "export":
        return serve_engine.export(args)
    return serve_engine.serve(args, api_key(args))


def check_limits(args) -> None:
    """The access-limit and length flags, checked before any model loads."""
    if args.max_len < 0:
        raise ValueError(f"--max-len must be >= 0 (0: the target's context), got {args.max_len}")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if args.request_timeout < 0:
        raise ValueError(f"--request-timeout must be >= 0 (0: no limit), got "
                         f"{args.request_timeout}")  # fmt: skip


def check_settings(args) -> None:
    """The policy flags, before any model loads (the engine checks them again): the threshold a
    probability, the cost profile file measured for this device and recording what it was
    measured for (γ against the drafter's block: `serve_engine.check_gamma`)."""
    check_threshold(args.threshold, "--threshold")
    if args.cost_profile:
        load_cost_profile(args.cost_profile)


def api_key(args) -> str:
    """`--api-key`, else $DSPARK_API_KEY (runtime.settings), else "" (no authentication)."""
    return runtime.settings().api_key if args.api_key is None else args.api_key
