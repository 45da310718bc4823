"""Request-side types of the serving engine: parameters, statistics, deltas, outputs, handles.

`RequestHandle` is thread-safe: the engine thread pushes `Delta`s, any thread may `stream()` them
(blocking) and any asyncio task may `astream()` them (the engine wakes the task's loop with
`call_soon_threadsafe`, so no executor thread is parked per stream).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Iterator

import numpy as np

from dspark_jax.errors import RequestError

__all__ = [
    "RequestParams",
    "SpecStats",
    "Delta",
    "RequestOutput",
    "RequestHandle",
    "QueueFull",
    "RequestError",
    "EngineMetrics",
]


class QueueFull(Exception):
    """submit() while the waiting queue holds max_queue requests (retry later / HTTP 429)."""


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """Per-request knobs (validated at submit())."""

    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()


@dataclasses.dataclass
class SpecStats:
    """Cumulative speculative statistics of one request."""

    rounds: int = 0
    drafted: int = 0  # draft tokens proposed (γ per round)
    verified: int = 0  # draft tokens the scheduler sent to the target
    accepted: int = 0  # accepted draft tokens
    emitted: int = 0  # tokens committed by rounds (accepted + bonus/correction)

    @property
    def mean_accepted_length(self) -> float:
        """τ (spec.metrics convention): tokens committed per round, bonus included."""
        return self.emitted / self.rounds if self.rounds else 0.0

    def copy(self) -> SpecStats:
        return dataclasses.replace(self)


@dataclasses.dataclass
class Delta:
    request_id: str
    tokens: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "cancelled" | "error"
    stats: SpecStats
    error: str | None = None  # with "error": what failed (`engine.faults`)


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_len: int
    tokens: list[int]
    finish_reason: str
    stats: SpecStats
    num_accepted: list[int]  # per round: accepted drafts (truncated at an accepted stop draft)
    proposed: list[int]  # per round: verified length n (= A when it ended on a stop draft)
    eos: list[bool]  # per round: ended on an accepted stop draft (no bonus)
    conf_logits: list[np.ndarray]  # per round: raw confidence logits [γ] (empty w/o a head)
    error: str | None = None  # with finish_reason "error": what failed (`engine.faults`)


@dataclasses.dataclass
class EngineMetrics:
    queue_len: int
    running: int
    num_slots: int
    requests_finished_by_reason: dict[str, int]
    prompt_tokens: int
    generation_tokens: int
    draft_tokens: int
    verified_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]  # [γ]: rounds whose draft j was accepted
    verified_per_round: list[int]  # histogram: [k] = rounds that verified k draft tokens in all
    rounds: int
    compilations: int
    requests_submitted: int
    requests_rejected: int
    requests_errored_by_cause: dict[str, int] = dataclasses.field(default_factory=dict)


class RequestHandle:
    """The caller's view of one submitted request."""

    def __init__(self, request_id: str, engine):
        self.id = request_id
        self._engine = engine
        self._cond = threading.Condition()
        self._deltas: list[Delta] = []
        self._output: RequestOutput | None = None
        self._async: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []

    # -- engine side ---------------------------------------------------------------------------

    def _push(self, delta: Delta, output: RequestOutput | None = None) -> None:
        with self._cond:
            self._deltas.append(delta)
            if output is not None:
                self._output = output
            self._cond.notify_all()
            waiters = list(self._async)
        for loop, q in waiters:
            try:
                loop.call_soon_threadsafe(q.put_nowait, delta)
            except RuntimeError:  # the loop is closed: its client is gone
                pass

    # -- caller side ---------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self._output is not None

    def stream(self, timeout: float | None = None) -> Iterator[Delta]:
        """Deltas in order until the finishing one (blocking; TimeoutError after `timeout` s
        without a new delta)."""
        i = 0
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda i=i: len(self._deltas) > i, timeout):
                    raise TimeoutError(f"request {self.id}: no output within {timeout} s")
                d = self._deltas[i]
            i += 1
            yield d
            if d.finished:
                return

    async def astream(self) -> AsyncIterator[Delta]:
        """asyncio version of stream()."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        entry = (loop, q)
        with self._cond:
            for d in self._deltas:
                q.put_nowait(d)
            self._async.append(entry)
        try:
            while True:
                d = await q.get()
                yield d
                if d.finished:
                    return
        finally:
            with self._cond:
                if entry in self._async:
                    self._async.remove(entry)

    def result(self, timeout: float | None = None) -> RequestOutput:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._output is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"request {self.id}: not finished within {timeout} s")
                if not self._engine.runs_in_background():
                    break
                self._cond.wait(left if left is None else min(left, 0.5))
        if self._output is None:  # synchronous use: drive the engine ourselves
            self._engine.drive_until(lambda: self._output is not None, deadline)
        if self._output is None:
            raise TimeoutError(f"request {self.id}: not finished within {timeout} s")
        return self._output

    def cancel(self) -> None:
        self._engine.cancel(self.id)
