"""`serve.py bench`: the flags of the bounded load test of a server on this machine
(dspark_jax/eval/load_test.py) or, with `--duration` (and `--chaos`), of the soak
(dspark_jax/eval/soak.py); its JSON on stdout (and `--out`) and its exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import httpx

from dspark_jax import runtime
from dspark_jax.eval import load_test
from dspark_jax.eval.load_test import run_load
from dspark_jax.eval.soak import run_soak
from dspark_jax.io import write_text_atomic


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="127.0.0.1 / localhost only")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", default="1,4,16,32", help="comma-separated phases")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    ap.add_argument("--api-key", default=None,
                    help="the server's API key (default: $DSPARK_API_KEY)")  # fmt: skip
    ap.add_argument("--duration", type=float, default=None,
                    help="soak: send for this many seconds (dspark_jax/eval/soak.py) instead of "
                         "--requests; concurrency = the largest of --concurrency")  # fmt: skip
    ap.add_argument("--chaos", type=float, default=0.0,
                    help="with --duration: share of requests that are injected faults "
                         "(disconnects, cancellations, bad/oversized bodies, bad keys, bursts)")  # fmt: skip
    ap.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 << 20,
        help="the server's --max-body-bytes (sizes the oversized bodies)",
    )
    ap.add_argument("--burst", type=int, default=64, help="requests per burst (--chaos)")
    ap.add_argument("--out", default=None, help="also write the JSON here (atomically)")


def _run(args, conc, key):
    if args.duration is None:
        if args.chaos:
            raise ValueError("--chaos needs --duration (a soak); the bounded test has its own mix")
        return run_load(args.url, args.requests, conc, seed=args.seed, timeout_s=args.timeout,
                        api_key=key)  # fmt: skip
    if args.duration <= 0 or not 0 <= args.chaos <= 1 or args.burst < 1:
        raise ValueError(f"need --duration > 0, 0 <= --chaos <= 1, --burst >= 1; got "
                         f"{args.duration}, {args.chaos}, {args.burst}")  # fmt: skip
    return run_soak(args.url, args.duration, max(conc), args.chaos, seed=args.seed,
                    timeout_s=args.timeout, api_key=key, max_body_bytes=args.max_body_bytes,
                    burst=args.burst)  # fmt: skip


def run_cli(args) -> int:
    """Run with parsed `add_arguments` flags; print the JSON; 0 if every check held, 1 if one
    failed, 2 for a usage error or an unreachable server."""
    try:
        if args.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {args.requests}")
        conc = tuple(int(c) for c in args.concurrency.split(","))
        if not conc or min(conc) < 1:
            raise ValueError(f"--concurrency must be positive integers, got {args.concurrency!r}")
        key = runtime.settings().api_key if args.api_key is None else args.api_key
        res = asyncio.run(_run(args, conc, key))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except httpx.HTTPError as e:
        print(f"error: cannot reach {args.url} ({e}) — start the server first: python serve.py "
              "serve --run-dir DIR --port PORT", file=sys.stderr)  # fmt: skip
        return 2
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        write_text_atomic(args.out, text + "\n")
    return 0 if res["summary"]["ok"] else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=load_test.__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    add_arguments(ap)
    return run_cli(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
