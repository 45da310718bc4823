"""The host side of a round's commit, a mixin of `ServingEngine`: the round's outputs (read from
the device in one `device_get`) become each request's tokens: stop ids (an accepted stop draft
ends the round without a bonus token), max_new_tokens, per-round records (accepted, verified,
end-of-sequence, raw confidences), the deltas pushed to handles, the finished request's output
and slot release, and the engine's metrics. It runs under the engine's lock and reads its slot
table; which rounds run and when is `engine.serving`'s.
"""

from __future__ import annotations

from dspark_jax.engine.requests import Delta, EngineMetrics, RequestOutput
from dspark_jax.engine.slots import Request


class EngineCommit:
    def _commit_rounds(self, running, lens, emitted, acc, conf) -> list[Delta]:
        """Host bookkeeping of k rounds' outputs ([k, N, ...], read in one device_get)."""
        g = self.gamma
        deltas = []
        with self._lock:
            for k in range(lens.shape[0]):
                total = int(sum(int(lens[k, r.slot]) for r in running))
                self._m["rounds"] += 1
                self._m["draft_tokens"] += g * len(running)
                self._m["verified_tokens"] += total
                self._verified_hist[total] += 1
                for r in running:
                    if r.done:  # finished in an earlier round of this call (cannot happen:
                        continue  # the device loop ends after the round a request finishes)
                    a = int(acc[k, r.slot])
                    raw_conf = self.slots.conf[r.slot].copy()
                    self.slots.conf[r.slot] = conf[k, r.slot]
                    new = [int(x) for x in emitted[k, r.slot, : a + 1]]
                    r.pos += a + 1
                    nl = int(lens[k, r.slot])
                    deltas.append(self._commit_round(r, new, a, nl, raw_conf))
        return deltas

    def _commit_round(self, r: Request, new, a: int, nl: int, raw_conf) -> Delta:
        stop = r.stop_set
        eos = False
        reason = None
        for j, tok in enumerate(new):
            if tok in stop:
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
        self._m["accepted_tokens"] += a
        self._acc_pos[:a] += 1
        r.num_accepted.append(a)
        r.proposed.append(nl)
        r.eos.append(eos)
        if self.dcfg.kind == "dspark":
            r.conf_logits.append(raw_conf)
        return self._emit(r, new, reason)

    def _emit(self, r: Request, new: list[int], reason: str | None) -> Delta:
        room = r.params.max_new_tokens - len(r.tokens)
        if reason is None and new and new[-1] in r.stop_set:
            reason = "stop"
        if len(new) > room:
            new, reason = new[:room], "length"
        elif len(new) == room and reason is None:
            reason = "length"
        if reason is None:
            r.tokens.extend(new)
            self._m["generation_tokens"] += len(new)
            d = Delta(r.id, new, False, None, r.stats.copy())
            r.handle._push(d)
            return d
        return self._finish(r, new, reason)

    def _finish(self, r: Request, new: list[int], reason: str) -> Delta:
        r.tokens.extend(new)
        self._m["generation_tokens"] += len(new)
        r.done = True
        self.slots.release(r)
        self._finished_by_reason[reason] = self._finished_by_reason.get(reason, 0) + 1
        out = RequestOutput(
            r.id, len(r.prompt), list(r.tokens), reason, r.stats.copy(),
            list(r.num_accepted), list(r.proposed), list(r.eos), list(r.conf_logits),
        )  # fmt: skip
        d = Delta(r.id, new, True, reason, r.stats.copy())
        r.handle._push(d, out)
        return d

    # ---- metrics -----------------------------------------------------------------------------

    def metrics(self) -> EngineMetrics:
        with self._lock:
            m = self._m
            return EngineMetrics(
                queue_len=len(self.slots.queue),
                running=len(self.slots.running()),
                num_slots=self.num_slots,
                requests_finished_by_reason=dict(self._finished_by_reason),
                prompt_tokens=m["prompt_tokens"],
                generation_tokens=m["generation_tokens"],
                draft_tokens=m["draft_tokens"],
                verified_tokens=m["verified_tokens"],
                accepted_tokens=m["accepted_tokens"],
                accepted_per_position=self._acc_pos.tolist(),
                verified_per_round=self._verified_hist.tolist(),
                rounds=m["rounds"],
                compilations=self.compilations,
                requests_submitted=m["submitted"],
                requests_rejected=m["rejected"],
            )
