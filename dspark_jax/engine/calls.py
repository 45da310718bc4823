"""The host side of the serving engine's device calls, a mixin of `ServingEngine`: the compiled
sampling modes and per-row knobs, `warmup()` (every program compiled before the first request),
prefill of admitted requests in prompt-length chunks, and one step's round(s) — one
host-scheduled round (`engine.device.packed_round`, lengths from the scheduler) or up to K
device-resident rounds per call (`engine.rounds`) — read back once and handed to
`engine.commit`. It uses the engine's state, programs, buckets and slot table, built by
`engine.serving`.
"""

from __future__ import annotations

import jax
import numpy as np

from dspark_jax.buckets import bucket_up
from dspark_jax.engine import rounds as rounds_lib
from dspark_jax.engine.requests import Delta, RequestParams
from dspark_jax.engine.slots import Request
from dspark_jax.spec.sampling import SamplingConfig, SamplingParams

# Compiled sampling modes, cheapest first: argmax; temperature only; top-k / top-p / min-p
# filters (a sort over the vocabulary per row). A round runs in the cheapest mode that honours
# all its requests; a request's tokens are the same in every mode that honours it.
MODES = ("greedy", "sampled", "filtered")
_SCFG = {
    "greedy": SamplingConfig(greedy=True),
    "sampled": SamplingConfig(),
    "filtered": SamplingConfig(top_k=True, top_p=True, min_p=True),
}


class EngineCalls:
    def _scfg(self, mode: str) -> SamplingConfig:
        return _SCFG[mode]

    def warmup(self) -> None:
        """Compile every (mode, prompt bucket) prefill and (mode, token bucket, cache bucket)
        round. Runs them on free slots with nothing active, so it leaves no trace."""
        with self._step_lock, self._tally:
            if self.slots.running():
                raise RuntimeError("warmup() must run before requests are admitted")
            n = self.num_slots
            for mode in self.modes:
                scfg = self._scfg(mode)
                sp1 = self._sp_rows([RequestParams(1)], mode)
                for c, s in self._prefill_shapes():
                    z = np.zeros(c, np.int32)
                    self.state, *_ = self._prefill(
                        self.tcfg, self.dcfg, scfg, s, *self.program_params, self.state,
                        np.int32(0), z, z, np.int32(0), np.int32(1), np.bool_(True),
                        np.uint32(0), sp1, self.key,
                    )  # fmt: skip
                sp = self._sp_rows([RequestParams(1)] * n, mode)
                for t in self.token_buckets:
                    for s in self.cache_buckets:
                        self.state, out = self._round(
                            self.tcfg, self.dcfg, scfg, t, s, *self.program_params,
                            self.state, np.zeros(n, np.int32), np.zeros(n, bool),
                            np.zeros(n, np.uint32), sp, self.key,
                        )  # fmt: skip
                if self.rounds_per_call > 1:  # nothing active: compiles, runs no round
                    self.state, _ = self._call_rounds(mode, sp, np.zeros(n, bool), [], 0)
            jax.block_until_ready(self.state)

    def _prefill_cache_len(self, end: int) -> int:
        """The cache bucket a prefill chunk ending (padded) at `end` attends over."""
        return next((b for b in self.cache_buckets if b >= end), self.max_len)

    def _prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (chunk bucket, cache bucket) a prefill can use: a chunk of bucket c starting at
        0 reads the bucket >= c; later chunks (long prompts) start further in."""
        lo = {c: self._prefill_cache_len(c) for c in self.prompt_buckets}
        return [(c, s) for c in self.prompt_buckets for s in self.cache_buckets if s >= lo[c]]

    def _sp_rows(self, params: list[RequestParams], mode: str):
        if mode == "greedy":
            return None
        return SamplingParams(
            np.asarray([p.temperature for p in params], np.float32),
            np.asarray([p.top_k for p in params], np.int32),
            np.asarray([p.top_p for p in params], np.float32),
            np.asarray([p.min_p for p in params], np.float32),
        )

    def _mode(self, params) -> str:
        """The cheapest compiled sampling mode that honours every request in `params`."""
        need = 0
        for p in params:
            if p.temperature > 0:
                filt = p.top_k > 0 or p.top_p < 1 or p.min_p > 0
                need = max(need, 2 if filt else 1)
        for mode in MODES[need:]:
            if mode in self.modes:
                return mode
        raise RuntimeError(f"a request needs sampling mode {MODES[need]!r}; modes={self.modes}")

    def _prefill_requests(self, admitted: list[Request]) -> list[Delta]:
        outs = []
        big = self.prompt_buckets[-1]
        for req in admitted:
            mode = self._mode([req.params])
            scfg = self._scfg(mode)
            sp1 = self._sp_rows([req.params], mode)
            p = req.prompt
            start = 0
            while start < len(p):
                n = min(big, len(p) - start)
                c = bucket_up(n, self.prompt_buckets)
                toks = np.zeros(c, np.int32)
                toks[:n] = p[start : start + n]
                nxt = np.zeros(c, np.int32)
                follow = p[start + 1 : start + n + 1]
                nxt[: len(follow)] = follow
                last = start + n == len(p)
                s = self._prefill_cache_len(start + c)
                self.state, first, conf = self._prefill(
                    self.tcfg, self.dcfg, scfg, s, *self.program_params, self.state,
                    np.int32(req.slot), toks, nxt, np.int32(start), np.int32(n), np.bool_(last),
                    np.uint32(req.seed), sp1, self.key,
                )  # fmt: skip
                start += n
            outs.append((first, conf))
        host = jax.device_get(outs)
        deltas = []
        with self._lock:
            self._m["prompt_tokens"] += sum(len(r.prompt) for r in admitted)
            for req, (first, conf) in zip(admitted, host):
                self.slots.conf[req.slot] = conf
                deltas.append(self._emit(req, [int(first)], None))
        return deltas

    def _run_round(self, running: list[Request]) -> list[Delta]:
        n = self.num_slots
        slots = np.asarray([r.slot for r in running])
        active = np.zeros(n, bool)
        active[slots] = True
        mode = self._mode([r.params for r in running])
        params = [RequestParams(1)] * n
        seeds = np.zeros(n, np.uint32)
        for r in running:
            params[r.slot] = r.params
            seeds[r.slot] = r.seed
        sp = self._sp_rows(params, mode)
        if self._device_policy() is not None and all(
            len(r.stop_set) <= rounds_lib.MAX_STOP_IDS for r in running
        ):
            self.state, out = self._call_rounds(
                mode, sp, active, running, self.rounds_per_call, seeds
            )
            emitted, acc, lens, conf, count = jax.device_get(out)
            k = int(count)
            return self._commit_rounds(running, lens[:k], emitted[:k], acc[:k], conf[:k])
        caps = np.asarray([r.params.max_new_tokens - len(r.tokens) - 1 for r in running])
        lens_r = self.scheduler.lengths(self.slots.conf[slots], caps)
        lengths = np.zeros(n, np.int32)
        lengths[slots] = lens_r
        total = int(np.sum(lens_r + 1))
        t = next(b for b in self.token_buckets if b >= total)
        need = max(r.pos + 1 + int(lengths[r.slot]) for r in running)
        s = next(b for b in self.cache_buckets if b >= need)
        self.state, out = self._round(
            self.tcfg, self.dcfg, self._scfg(mode), t, s, *self.program_params,
            self.state, lengths, active, seeds, sp, self.key,
        )  # fmt: skip
        self.scheduler.prepare_next(len(running))  # overlaps the device's round
        emitted, acc, conf = jax.device_get(out)
        return self._commit_rounds(running, lengths[None], emitted[None], acc[None], conf[None])

    # ---- device-resident rounds (engine.rounds) ------------------------------------------------

    def _device_policy(self):
        """(gamma_p, use_threshold, cuts) when rounds run on the device, else None: the engine
        was built with rounds_per_call > 1 and the policy is fixed γ / MTP-1 / static threshold
        (Algorithm 1 and async top-K schedule on the host, one round per call)."""
        from dspark_jax.sched.policies import FixedGamma, StaticThreshold

        pol = self.scheduler.policy
        g = self.gamma
        if self.rounds_per_call <= 1:
            return None
        if isinstance(pol, FixedGamma):
            return np.int32(pol.gamma), np.bool_(False), np.zeros(g, np.float32)
        if isinstance(pol, StaticThreshold):
            key = (self.scheduler.sts, float(pol.theta))
            if self._cuts is None or self._cuts[0] != key:
                self._cuts = (key, rounds_lib.threshold_cuts(key[0], g, key[1]))
            return np.int32(0), np.bool_(True), self._cuts[1]
        return None

    def _call_rounds(self, mode, sp, active, running, n_rounds, seeds=None):
        n = self.num_slots
        room = np.zeros(n, np.int32)
        stop = np.full((n, rounds_lib.MAX_STOP_IDS), -1, np.int32)
        for r in running:
            room[r.slot] = r.params.max_new_tokens - len(r.tokens)
            ids = sorted(r.stop_set)
            stop[r.slot, : len(ids)] = ids
        gamma_p, use_thr, cuts = self._device_policy() or (
            np.int32(self.gamma),
            np.bool_(False),
            np.zeros(self.gamma, np.float32),
        )
        seeds = np.zeros(n, np.uint32) if seeds is None else seeds
        return self._rounds(
            self.tcfg, self.dcfg, self._scfg(mode), self.token_buckets, self.cache_buckets,
            self.rounds_per_call, *self.program_params, self.state, active, seeds, sp,
            self.key, room, stop, gamma_p, use_thr, cuts, np.int32(n_rounds),
        )  # fmt: skip
