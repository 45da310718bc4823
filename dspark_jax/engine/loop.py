"""How a `ServingEngine` is driven outside its caller's own `step()` calls: `BackgroundLoop`
runs the step in a thread while there is work (what the HTTP server uses, `start` / `shutdown`),
and `params_from_knobs` turns `generate()`'s keyword knobs into one RequestParams per prompt.

    loop = BackgroundLoop(step, has_work, on_error, work)   # work: the engine's Condition
    loop.start(); ...; loop.stop(timeout)
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from dspark_jax.engine.requests import RequestError, RequestParams


def params_from_knobs(
    n, *, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, stop_ids=()
) -> list[RequestParams]:
    def rows(name, v, kind):
        a = np.asarray(v)
        if a.ndim == 0:
            return [kind(a)] * n
        if a.shape != (n,):
            raise RequestError(f"{name} must be a scalar or one per prompt ({n}), got {a.shape}")
        return [kind(x) for x in a]

    seeds = list(range(n)) if seeds is None else seeds
    cols = zip(
        rows("max_new_tokens", max_new_tokens, int),
        rows("temperature", temperature, float),
        rows("top_k", top_k, int),
        rows("top_p", top_p, float),
        rows("min_p", min_p, float),
        rows("seeds", seeds, int),
    )
    stop = tuple(int(s) for s in stop_ids)
    return [RequestParams(n_new, t, k, p, m, sd, stop) for n_new, t, k, p, m, sd in cols]


class BackgroundLoop:
    """A daemon thread that calls `step()` while `has_work()`, waiting on `work` (a Condition
    on the engine's lock, notified on every submission) otherwise. An exception in a step is
    handed to `on_error` and the loop keeps serving."""

    def __init__(self, step: Callable, has_work: Callable, on_error: Callable, work):
        self._step, self._has_work, self._on_error = step, has_work, on_error
        self._work = work
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None  # the last step's exception

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        with self._work:
            if self.alive():
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="serving-engine", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._work:
                while not self._stopping and not self._has_work():
                    self._work.wait()
                if self._stopping and not self._has_work():
                    return
            try:
                self._step()
            except BaseException as e:  # noqa: BLE001 - fail requests, keep serving
                self.error = e
                self._on_error(repr(e))

    def stop(self, timeout: float | None = None) -> bool:
        """Let the thread finish the remaining work and end; False when none was started."""
        with self._work:
            self._stopping = True
            self._work.notify_all()
        if self._thread is None:
            return False
        self._thread.join(timeout)
        return True
