"""Counting an engine's XLA compilations with JAX's public monitoring events.

JAX reports every backend compilation as the duration event
`/jax/core/compile/backend_compile_duration` (`jax.monitoring`), synchronously, on the thread that
triggered it. One process-wide listener forwards each event to the `CompileTally` active on that
thread, so an engine that runs its device calls inside `with tally:` counts exactly the
compilations its own calls caused: a new shape or static argument (a retrace) and also a
recompilation without a retrace (e.g. committed vs uncommitted inputs). Programs another engine
already compiled are cache hits and are not counted.
"""

from __future__ import annotations

import threading

from jax import monitoring

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_local = threading.local()
_lock = threading.Lock()
_registered = False


def _listener(event, duration_secs=None, **kwargs):
    if event != COMPILE_EVENT:
        return
    tally = getattr(_local, "tally", None)
    if tally is not None:
        tally._add(str(kwargs.get("fun_name", "?")))


def _register() -> None:
    global _registered
    with _lock:
        if not _registered:
            monitoring.register_event_duration_secs_listener(_listener)
            _registered = True


class CompileTally:
    """Compilations caused on this thread inside `with tally:` (re-entrant, nestable: the
    innermost active tally gets the event).

        tally = CompileTally()
        with tally:
            jitted(x)
        tally.count, tally.names
    """

    def __init__(self):
        _register()
        self.count = 0
        self.names: list[str] = []
        self._count_lock = threading.Lock()

    def _add(self, name: str) -> None:
        with self._count_lock:
            self.count += 1
            self.names.append(name)

    def __enter__(self):
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append(getattr(_local, "tally", None))
        _local.tally = self
        return self

    def __exit__(self, *exc):
        _local.tally = _local.stack.pop()
        return False

    def wrap(self, fn):
        """`fn` whose calls count into this tally."""

        def counted(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)

        counted.__wrapped__ = fn
        return counted
