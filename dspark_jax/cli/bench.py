"""`serve.py bench` (and benchmarks/serving_load.py): the flags of the bounded load test of a
server on this machine (dspark_jax/eval/load_test.py), its JSON on stdout and its exit code.
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


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="127.0.0.1 / localhost only")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", default="1,4,16,32", help="comma-separated phases")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    ap.add_argument("--api-key", default=None,
                    help="the server's API key (default: $DSPARK_API_KEY)")  # fmt: skip


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
        res = asyncio.run(run_load(args.url, args.requests, conc, seed=args.seed,
                                   timeout_s=args.timeout, api_key=key))  # fmt: skip
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except httpx.HTTPError as e:
        print(f"error: cannot reach {args.url} ({e}) — start the server first: python serve.py "
              "serve --run-dir DIR --port PORT", file=sys.stderr)  # fmt: skip
        return 2
    print(json.dumps(res, indent=1))
    return 0 if res["summary"]["ok"] else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=load_test.__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    add_arguments(ap)
    return run_cli(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
