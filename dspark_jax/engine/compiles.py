"""Counting XLA compilations with JAX's public monitoring events: the one counter behind an
engine's compile count (`CompileTally`) and the tests' retrace guard (`CompileCounter`).

JAX reports every backend compilation as the duration event
`/jax/core/compile/backend_compile_duration` (also when the persistent compilation cache served
the program, which it reports as the event `/jax/compilation_cache/cache_hits`) and every jaxpr
trace as `/jax/core/compile/jaxpr_trace_duration` (`jax.monitoring`), synchronously, on the
thread that triggered it. Process-wide listeners forward each event to

* the `CompileTally` active on that thread (the innermost one), so an engine that runs its device
  calls inside `with tally:` counts exactly the compilations its own calls caused: a new shape or
  static argument (a retrace) and also a recompilation without a retrace (e.g. committed vs
  uncommitted inputs). Programs another engine already compiled are cache hits, not counted;
* every active `CompileCounter`, whatever thread compiled: a test's guard sees the compilations
  of an engine's worker thread and of an engine's own tally alike.
"""

from __future__ import annotations

import threading

from jax import monitoring

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

_local = threading.local()
_lock = threading.Lock()
_registered = False
_process_wide: list[CompileTally] = []  # active CompileCounters


def _listener(event, duration_secs=None, **kwargs):
    if event not in (COMPILE_EVENT, TRACE_EVENT, CACHE_HIT_EVENT):
        return
    tally = getattr(_local, "tally", None)
    targets = ([tally] if tally is not None else []) + list(_process_wide)
    for t in targets:
        t._add(event, str(kwargs.get("fun_name", "?")))


def _register() -> None:
    global _registered
    with _lock:
        if not _registered:
            monitoring.register_event_duration_secs_listener(_listener)
            monitoring.register_event_listener(_listener)
            _registered = True


class CompileTally:
    """Compilations caused on this thread inside `with tally:` (re-entrant, nestable: the
    innermost active tally gets the event).

        tally = CompileTally()
        with tally:
            jitted(x)
        tally.count, tally.names, tally.traces

    `count`: backend compilations; `names`: their functions; `traces`: jaxpr traces, which also
    catch a retrace whose compilation a persistent compilation cache served; `cache_hits`: the
    compilations the persistent compilation cache served (read from disk, not compiled).
    """

    def __init__(self):
        _register()
        self.count = 0
        self.traces = 0
        self.cache_hits = 0
        self.names: list[str] = []
        self._count_lock = threading.Lock()

    def _add(self, event: str, name: str) -> None:
        with self._count_lock:
            if event == TRACE_EVENT:
                self.traces += 1
            elif event == CACHE_HIT_EVENT:
                self.cache_hits += 1
            else:
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


class CompileCounter(CompileTally):
    """Every compilation (and jaxpr trace) in the process while active, on any thread: the
    retrace guard for tests and benchmarks.

        with CompileCounter() as cc: ...
        assert cc.count == 0, cc.names

    Eager jnp ops on new shapes compile too, so keep host-side array building in numpy inside
    the guarded block."""

    def __enter__(self):
        with _lock:
            _process_wide.append(self)
        return self

    def __exit__(self, *exc):
        with _lock:
            _process_wide.remove(self)
        return False
