"""One serving engine over several processes (a mesh that spans hosts).

Process 0, the leader, takes the requests (the HTTP server runs there) and drives the rounds;
every other process, a follower, keeps a copy of the engine's host state and runs the same
programs in the same order, as SPMD programs over a global mesh require.

At the start of each step the leader's engine sends, by a broadcast from process 0, what changed
on its host since the previous step: the requests submitted (in order, each with the seed it
drew), the cancellations and the requests ended with an error on the host (a token the
tokenizer cannot decode). A follower applies them to its own engine, then steps it. From
there every host-side choice (admission, the scheduler's prefix, the commit) depends only on
that state and on the round's outputs, which every process reads alike, so the engines stay in
lockstep: same request ids, same slots, same programs. A request that times out on the leader
is a cancellation like any other.

    mirror = Mirror(engine)            # on every process, before the first step
    engine.start() + HTTP server       # process 0
    mirror.follow()                    # processes 1..N-1: until the leader stops

The leader steps at least every `tick_s` while idle, so a follower never waits in a collective
for long (XLA aborts collectives that wait too long); `Mirror.stop()` (the leader's shutdown)
sends the message that ends `follow()`.
"""

from __future__ import annotations

import dataclasses
import json
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

from dspark_jax.engine.requests import RequestParams

_MIN_BYTES = 256  # payload sizes are powers of two from here: few broadcast programs


def _broadcast(message: dict | None) -> dict:
    """process 0's `message` on every process (a header with the length, then the bytes)."""
    raw = b"" if message is None else json.dumps(message).encode()
    size = max(_MIN_BYTES, 1 << max(len(raw) - 1, 0).bit_length())
    header = multihost_utils.broadcast_one_to_all(np.array([len(raw), size], np.int64))
    n, size = int(header[0]), int(header[1])
    buf = np.zeros(size, np.uint8)
    if jax.process_index() == 0:
        buf[: len(raw)] = np.frombuffer(raw, np.uint8)
    got = multihost_utils.broadcast_one_to_all(buf)
    return json.loads(bytes(np.asarray(got[:n], np.uint8)).decode())


class Mirror:
    """Keeps the engines of all processes in lockstep (see the module docstring)."""

    def __init__(self, engine, tick_s: float = 1.0, *, leader=None, channel=None):
        """`leader` (default: process 0) and `channel` (default: a broadcast from process 0;
        any `message -> message` function, e.g. two engines in one process for a test)."""
        self.engine, self.tick_s = engine, tick_s
        self.leader = jax.process_index() == 0 if leader is None else leader
        self._channel = channel or _broadcast
        self._events: list = []
        self._stopping = False
        self._ticker: threading.Thread | None = None
        engine.mirror = self

    # ---- the leader's journal (called by the engine under its lock) -----------------------------

    def submitted(self, req) -> None:
        if self.leader:
            p = dataclasses.asdict(req.params)
            self._events.append(["submit", req.id, list(req.prompt), p, int(req.seed)])

    def cancelled(self, request_id: str) -> None:
        if self.leader:
            self._events.append(["cancel", request_id])

    def failed(self, request_id: str, cause: str, detail: str) -> None:
        if self.leader:
            self._events.append(["fail", request_id, cause, detail])

    # ---- every step ------------------------------------------------------------------------------

    def sync(self) -> bool:
        """At the top of each step (under the engine's lock): the leader sends its journal, a
        follower applies it. Returns False on the stop message (followers end)."""
        msg = {"events": self._events, "stop": self._stopping} if self.leader else None
        self._events = []
        got = self._channel(msg)
        if not self.leader:
            for ev in got["events"]:
                self._apply(ev)
        return not got["stop"]

    def _apply(self, ev) -> None:
        eng = self.engine
        if ev[0] == "submit":
            _, rid, prompt, p, seed = ev
            p = dict(p, stop_ids=tuple(p["stop_ids"]), seed=seed)
            handle = eng.submit(prompt, RequestParams(**p))
            if handle.id != rid:
                raise RuntimeError(f"engines out of step: {handle.id} != {rid} (leader)")
        elif ev[0] == "cancel":
            eng.cancel(ev[1])
        else:
            eng.fail(*ev[1:])

    # ---- driving ---------------------------------------------------------------------------------

    def follow(self) -> None:
        """A follower's loop: step whenever the leader does, until it stops."""
        while not self.engine.mirror_stopped:
            self.engine.step()

    def start_ticks(self) -> None:
        """The leader: step every `tick_s` while idle so followers leave their collective."""

        def run():
            while not self._stopping:
                with self.engine.work_condition:
                    self.engine.work_condition.wait(self.tick_s)
                if not self._stopping and not self.engine.has_work():
                    self.engine.step()

        self._ticker = threading.Thread(target=run, name="mirror-ticks", daemon=True)
        self._ticker.start()

    def stop(self) -> None:
        """The leader: end the followers (one last step carries the stop message)."""
        if not self.leader or self._stopping:
            return
        self._stopping = True
        with self.engine.work_condition:
            self.engine.work_condition.notify_all()
        if self._ticker is not None:
            self._ticker.join()
        self.engine.step()
