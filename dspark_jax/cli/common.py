"""What `train.py` and `serve.py` share: the user-facing error types and their one-line report,
and the runtime start-up (dspark_jax/runtime/) printed once.

A user mistake (bad config value, missing or malformed file, corrupt checkpoint, invalid sampling
knob, a request that does not fit) ends the process with exit code 2 and one line on stderr,
`error: <what> — <how to fix>`; the traceback only with `--debug`.
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
import traceback

from dspark_jax import runtime
from dspark_jax.runtime import compile_cache, xla_cpu

EXIT_USER_ERROR = 2


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean "the input is wrong", not "the program is wrong".

    All the project's own error types (dspark_jax/errors.py) are ValueErrors."""
    return (ValueError, OSError)


def format_error(e: BaseException) -> str:
    if isinstance(e, FileNotFoundError) and e.strerror:  # raised by the OS, not by us
        msg = f"file not found: {e.filename} — check the path"
    elif isinstance(e, PermissionError) and e.strerror:
        msg = f"permission denied: {e.filename} — choose a location you can read / write"
    elif isinstance(e, OSError) and e.strerror:
        where = f" ({e.filename})" if e.filename else ""
        msg = f"{e.strerror}{where} — check the path and free disk space"
    else:
        msg = str(e) or type(e).__name__
    return " ".join(msg.split())  # one line


def report(e: BaseException, debug: bool = False) -> int:
    """Print `e` as one line (plus the traceback with `debug`) and return the exit code."""
    if debug:
        traceback.print_exception(e)
    print(f"error: {format_error(e)}", file=sys.stderr)
    return EXIT_USER_ERROR


def start_runtime(*, announce: bool = True) -> None:
    """Before anything touches devices or compiles: the persistent compilation cache (a restart
    reads back every compiled bucket) and the unrolled threefry (the same random bits, drawn
    faster on CPU: xla_cpu.py); then one line on stdout saying what the process runs with.
    `kill -USR1 <pid>` prints every thread's Python stack to stderr (a run that seems stuck)."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    runtime.patient_cpu_collectives()
    cache = compile_cache.enable_compilation_cache()
    threefry = xla_cpu.unrolled_threefry()
    if announce:
        print(runtime.describe(cache, threefry), flush=True)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n
