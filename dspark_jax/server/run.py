"""Running the HTTP app: in the foreground until a signal (serve.py), or in a thread (tests)."""

from __future__ import annotations

import signal
import threading
import time

import uvicorn
from fastapi import FastAPI


def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, **kw):
    """Start uvicorn for `app` in a daemon thread; returns `(server, thread, port)` once it
    listens. Stop with `server.should_exit = True; thread.join()` (tests, benchmarks)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=kw.pop("log_level", "warning"),
                            lifespan="on", **kw)  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, bound


def run_server(app: FastAPI, host: str, port: int, *, drain_timeout_s: float = 30.0,
               log_level: str = "info") -> None:  # fmt: skip
    """Serve until SIGINT/SIGTERM; then stop accepting, let open requests finish (up to
    `drain_timeout_s`, then cancel them), drain the engine and return normally."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=int(max(drain_timeout_s, 1)))  # fmt: skip
    # uvicorn re-raises the signal it shut down on, under the handler it found installed; the
    # drain is done by then, so that handler ignores it and the process exits normally.
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in handled}
    try:
        uvicorn.Server(config).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
