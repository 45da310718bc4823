"""How a `ServingEngine` is driven: offline (`generate`: submit everything, step until done),
in a background thread (`start` / `shutdown`, what the HTTP server uses), or by a caller's own
`step()` calls. The round itself (admit, schedule, run, commit) is `engine.serving`'s; this mixin
only decides when to call it, and reads the engine's slot table under its lock.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from dspark_jax.engine.requests import QueueFull, RequestError, RequestOutput, RequestParams


def _params_from_knobs(
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


class EngineDriving:
    """Mixin of `ServingEngine` (uses its `_lock`, `_work`, `_thread`, `slots`, `submit`, `step`,
    `_finish`)."""

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.slots.queue) or bool(self.slots.running())

    def generate(self, prompts, params=None, **knobs) -> list[RequestOutput]:
        """Offline convenience: submit all (one RequestParams or one per prompt), run, collect.

        Also accepts keyword knobs instead of `params` (max_new_tokens, temperature, top_k,
        top_p, min_p, seeds, stop_ids; scalar or one per prompt), as the evaluator passes them."""
        if params is None:
            params = _params_from_knobs(len(prompts), **knobs)
        elif knobs:
            raise TypeError("pass either params or keyword knobs, not both")
        if isinstance(params, RequestParams):
            params = [params] * len(prompts)
        handles = []
        for p, q in zip(prompts, params, strict=True):
            while True:
                try:
                    handles.append(self.submit(p, q))
                    break
                except QueueFull:
                    if not self._running_in_background():
                        self.step()
                    else:
                        time.sleep(0.01)
        return [h.result() for h in handles]

    def _running_in_background(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _drive_until(self, done, deadline) -> None:
        while not done():
            if deadline is not None and time.monotonic() > deadline:
                return
            if not self.has_work():
                return
            self.step()

    def start(self) -> None:
        with self._lock:
            if self._running_in_background():
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="serving-engine", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self.has_work():
                    self._work.wait()
                if self._stopping and not self.has_work():
                    return
            try:
                self.step()
            except BaseException as e:  # noqa: BLE001 - fail requests, keep serving
                self._error = e
                self._fail_all(repr(e))

    def _fail_all(self, why: str) -> None:
        with self._lock:
            for r in list(self.slots.queue) + self.slots.running():
                if r.slot is None:
                    self.slots.queue.remove(r)
                self._finish(r, [], "error")

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests; finish (drain) or cancel the others; stop the thread."""
        with self._lock:
            self._closed = True
            if not drain:
                for r in list(self.slots.queue):
                    self.slots.queue.remove(r)
                    self._finish(r, [], "cancelled")
                for r in self.slots.running():
                    r.cancel_requested = True
            self._stopping = True
            self._work.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        elif not drain:
            self.step()
        else:
            self._drive_until(
                lambda: False, None if timeout is None else time.monotonic() + timeout
            )
