"""The host's commit step: a round's outputs (read from the device in one `device_get`) become
each request's tokens. `Committer` applies stop ids (an accepted stop draft ends the round
without a bonus token) and max_new_tokens, keeps the per-round records (accepted, verified,
end-of-sequence, raw confidences), pushes deltas to the handles, finishes requests (output, slot
release) and counts the engine's metrics (`EngineCounters`).

    committer = Committer(gamma, slots, counters, keep_conf=True)
    deltas = committer.rounds(running, lens, emitted, acc, conf)   # [k, N, ...] host arrays

It works on the slot table it is given (`engine.slots.SlotTable`); the caller holds the engine's
lock around every call.
"""

from __future__ import annotations

import numpy as np

from dspark_jax.engine import faults
from dspark_jax.engine.requests import Delta, EngineMetrics, RequestOutput
from dspark_jax.engine.slots import Request, SlotTable


class EngineCounters:
    """The engine's counters: tokens, rounds, requests, per-position acceptance, histograms."""

    def __init__(self, num_slots: int, gamma: int):
        self.num_slots = num_slots
        self.counts = dict.fromkeys(
            ("prompt_tokens", "generation_tokens", "draft_tokens", "verified_tokens",
             "accepted_tokens", "rounds", "submitted", "rejected"), 0,
        )  # fmt: skip
        self.accepted_per_position = np.zeros(gamma, np.int64)
        self.verified_per_round = np.zeros(num_slots * gamma + 1, np.int64)
        self.finished_by_reason: dict[str, int] = {}
        self.errors_by_cause = dict.fromkeys(faults.CAUSES, 0)  # requests ended with "error"

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def metrics(self, queue_len: int, running: int, compilations: int) -> EngineMetrics:
        m = self.counts
        return EngineMetrics(
            queue_len=queue_len,
            running=running,
            num_slots=self.num_slots,
            requests_finished_by_reason=dict(self.finished_by_reason),
            prompt_tokens=m["prompt_tokens"],
            generation_tokens=m["generation_tokens"],
            draft_tokens=m["draft_tokens"],
            verified_tokens=m["verified_tokens"],
            accepted_tokens=m["accepted_tokens"],
            accepted_per_position=self.accepted_per_position.tolist(),
            verified_per_round=self.verified_per_round.tolist(),
            rounds=m["rounds"],
            compilations=compilations,
            requests_submitted=m["submitted"],
            requests_rejected=m["rejected"],
            requests_errored_by_cause=dict(self.errors_by_cause),
        )


class Committer:
    """Turns device outputs into request tokens, deltas and finished outputs."""

    def __init__(self, gamma: int, slots: SlotTable, counters: EngineCounters, *, keep_conf: bool):
        self.gamma, self.slots, self.counters = gamma, slots, counters
        self.keep_conf = keep_conf  # record each round's raw confidences (DSpark drafters)

    def admitted(self, admitted: list[Request], firsts) -> list[Delta]:
        """Admitted requests' first tokens and first blocks' confidences ((first, conf) each)."""
        self.counters.add("prompt_tokens", sum(len(r.prompt) for r in admitted))
        deltas = []
        for req, (first, conf) in zip(admitted, firsts):
            self.slots.conf[req.slot] = conf
            deltas.append(self.emit(req, [int(first)], None))
        return deltas

    def rounds(self, running, lens, emitted, acc, conf) -> list[Delta]:
        """k rounds' outputs ([k, N, ...], read in one device_get) of the running requests."""
        deltas = []
        c = self.counters
        for k in range(lens.shape[0]):
            total = int(sum(int(lens[k, r.slot]) for r in running))
            c.add("rounds")
            c.add("draft_tokens", self.gamma * len(running))
            c.add("verified_tokens", total)
            c.verified_per_round[total] += 1
            for r in running:
                if r.done:  # finished in an earlier round of this call (cannot happen:
                    continue  # the device loop ends after the round a request finishes)
                a = int(acc[k, r.slot])
                if a < 0:  # its logits were not finite (`device.finite_rows`)
                    deltas.append(self.fail(r, "nonfinite", f"at position {r.pos}"))
                    continue
                raw_conf = self.slots.conf[r.slot].copy()
                self.slots.conf[r.slot] = conf[k, r.slot]
                new = [int(x) for x in emitted[k, r.slot, : a + 1]]
                r.pos += a + 1
                deltas.append(self._round(r, new, a, int(lens[k, r.slot]), raw_conf))
        return deltas

    def _round(self, r: Request, new, a: int, nl: int, raw_conf) -> Delta:
        eos = False
        reason = None
        for j, tok in enumerate(new):
            if tok in r.stop_set:
                reason = "stop"
                if j < a:  # an accepted stop draft ends the round without a bonus token
                    a, nl, eos = j + 1, j + 1, True
                new = new[: j + 1]
                break
        st = r.stats
        st.rounds += 1
        st.drafted += self.gamma
        st.verified += nl
        st.accepted += a
        st.emitted += a if eos else a + 1
        self.counters.add("accepted_tokens", a)
        self.counters.accepted_per_position[:a] += 1
        r.num_accepted.append(a)
        r.proposed.append(nl)
        r.eos.append(eos)
        if self.keep_conf:
            r.conf_logits.append(raw_conf)
        return self.emit(r, new, reason)

    def emit(self, r: Request, new: list[int], reason: str | None) -> Delta:
        """Push `new` tokens to the request; finish it on a stop id or its token budget."""
        room = r.params.max_new_tokens - len(r.tokens)
        if reason is None and new and new[-1] in r.stop_set:
            reason = "stop"
        if len(new) > room:
            new, reason = new[:room], "length"
        elif len(new) == room and reason is None:
            reason = "length"
        if reason is None:
            r.tokens.extend(new)
            self.counters.add("generation_tokens", len(new))
            d = Delta(r.id, new, False, None, r.stats.copy())
            r.handle._push(d)
            return d
        return self.finish(r, new, reason)

    def fail(self, r: Request, cause: str, detail: str = "") -> Delta:
        """End the request with finish_reason "error" for `cause` (`engine.faults`)."""
        self.counters.errors_by_cause[cause] += 1
        return self.finish(r, [], "error", faults.message(cause, detail))

    def finish(self, r: Request, new: list[int], reason: str, error: str | None = None) -> Delta:
        """End the request (its output, the final delta) and free its slot."""
        r.tokens.extend(new)
        self.counters.add("generation_tokens", len(new))
        r.done = True
        self.slots.release(r)
        by = self.counters.finished_by_reason
        by[reason] = by.get(reason, 0) + 1
        out = RequestOutput(
            r.id, len(r.prompt), list(r.tokens), reason, r.stats.copy(),
            list(r.num_accepted), list(r.proposed), list(r.eos), list(r.conf_logits), error,
        )  # fmt: skip
        d = Delta(r.id, new, True, reason, r.stats.copy(), error)
        r.handle._push(d, out)
        return d
