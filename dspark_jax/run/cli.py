"""What `train.py` and `serve.py` share: the user-facing error types and their one-line report.

A user mistake (bad config value, missing or malformed file, corrupt checkpoint, invalid sampling
knob, a request that does not fit) ends the process with exit code 2 and one line on stderr,
`error: <what> — <how to fix>`; the traceback only with `--debug`.
"""

from __future__ import annotations

import sys
import traceback

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
