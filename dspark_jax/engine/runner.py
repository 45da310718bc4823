"""The host side of one step's device calls: `RoundRunner` turns requests into the programs'
inputs and reads their outputs back once.

    runner = RoundRunner(config, programs, scheduler)
    done = runner.prefill(pending)      # [(req, (first token, conf [γ]))] whose prefill ended
    lens, emitted, acc, conf = runner.run(running, pending_conf)    # [k, N, ...] host arrays

`prefill` writes the admitted prompts in prompt-length-bucket chunks, at most
`prefill_tokens_per_step` tokens per step (a long prompt takes several steps while the running
requests keep their rounds). `run` runs one
host-scheduled round (lengths from the `Scheduler` on the pending drafts' confidences, the
smallest token and cache buckets that hold them) or, when the engine runs K rounds per call and
the policy is one the device computes (fixed γ / MTP-1 / static threshold), up to K
device-resident rounds (`engine.rounds`). Either way the result has one row per round run, for
`engine.commit.Committer`.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from dspark_jax.buckets import bucket_up
from dspark_jax.engine import faults
from dspark_jax.engine import rounds as rounds_lib
from dspark_jax.engine.config import EngineConfig, sampling_rows
from dspark_jax.engine.device import PrefillInputs, RoundInputs
from dspark_jax.engine.programs import EnginePrograms
from dspark_jax.engine.requests import RequestParams
from dspark_jax.engine.rounds import RoundsInputs
from dspark_jax.engine.scheduler import Scheduler
from dspark_jax.engine.slots import Request
from dspark_jax.sched.policies import FixedGamma, StaticThreshold


def _first(chunk_firsts, conf) -> tuple[int, object]:
    """(first token, conf) from a prompt's chunks' firsts (host values; the last chunk's is
    the token): -1 if any chunk's values were not finite (`device.chunk_finite`)."""
    bad = min(int(f) for f in chunk_firsts) < 0
    return (-1 if bad else int(chunk_firsts[-1])), conf


@dataclasses.dataclass
class Fill:
    """A request's prefill progress (host): prompt tokens written, each chunk's first (device
    values) and the last chunk's confidences."""

    start: int = 0
    firsts: list = dataclasses.field(default_factory=list)
    conf: object = None


class RoundRunner:
    def __init__(self, config: EngineConfig, programs: EnginePrograms, scheduler: Scheduler):
        self.config, self.programs, self.scheduler = config, programs, scheduler
        self._cuts: tuple | None = None  # (key, threshold cuts) for the device threshold policy

    def set_scheduler(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def prefill(self, pending: list[Request]) -> list:
        """Prefill chunks of the requests still prefilling (in order, their progress in
        `req.fill`), whole chunks of prompt_buckets[-1] until `prefill_tokens_per_step` prompt
        tokens are written (0: no bound; at least one chunk per step). Returns
        [(req, (first token, conf [γ]) or the exception its device call raised)] for those whose
        prefill finished this step (fill reset to None; one read for all)."""
        budget = self.config.prefill_tokens_per_step or float("inf")
        done, spent = [], 0
        for req in pending:
            mode = self.config.mode_for([req.params])
            sp1 = sampling_rows([req.params], mode)
            try:
                while spent < budget and req.fill.start < len(self._prompt(req)):
                    spent += self._chunk(req, mode, sp1)
            except faults.HOST_ERRORS:
                raise
            except Exception as e:  # noqa: BLE001 - the engine ends this request (faults)
                req.fill = None
                done.append((req, e))
                continue
            if req.fill.start < len(self._prompt(req)):
                break  # the budget is spent: the rest waits for the next steps
            done.append((req, (req.fill.firsts, req.fill.conf)))
            req.fill = None
        got = jax.device_get([o for _, o in done if not isinstance(o, Exception)])[::-1]
        return [(r, o if isinstance(o, Exception) else _first(*got.pop())) for r, o in done]

    def _chunk(self, req: Request, mode: str, sp1) -> int:
        """Prefill the next chunk of `req`'s prompt (from `req.fill.start`); its token count."""
        c, p, f = self.config, self._prompt(req), req.fill
        start = f.start
        n = min(c.prompt_buckets[-1], len(p) - start)
        size = bucket_up(n, c.prompt_buckets)
        toks = np.zeros(size, np.int32)
        toks[:n] = p[start : start + n]
        nxt = np.zeros(size, np.int32)
        follow = p[start + 1 : start + n + 1]
        nxt[: len(follow)] = follow
        last = start + n == len(p)
        inp = PrefillInputs(np.int32(req.slot), toks, nxt, np.int32(start), np.int32(n),
                            np.bool_(last), np.uint32(req.seed), sp1,
                            self.programs.key)  # fmt: skip
        cache_len = c.prefill_cache_len(start + size)
        inp = self._chunk_inputs(req, inp, cache_len)
        first, f.conf = self.programs.step_prefill(inp, mode=mode, cache_len=cache_len)
        f.firsts.append(first)
        f.start += n
        return n

    def _prompt(self, req: Request) -> list[int]:
        """The tokens a request's prefill writes (a layout may resume with more)."""
        return req.prompt

    def _chunk_inputs(self, req: Request, inp: PrefillInputs, cache_len: int):
        """One prefill chunk's program inputs (a layout may add its own, e.g. block tables)."""
        return inp

    def run(self, running: list[Request], pending_conf: np.ndarray):
        """One step's round(s) over the running requests: (lens, emitted, acc, conf), [k, N, ...]
        host arrays of the k rounds run. `pending_conf` [N, γ]: each slot's pending raw
        confidences (the scheduler's input)."""
        n = self.config.num_slots
        active = np.zeros(n, bool)
        active[[r.slot for r in running]] = True
        mode = self.config.mode_for([r.params for r in running])
        params = [RequestParams(1)] * n
        seeds = np.zeros(n, np.uint32)
        for r in running:
            params[r.slot] = r.params
            seeds[r.slot] = r.seed
        sp = sampling_rows(params, mode)
        policy = self.device_policy()
        if policy is not None and all(len(r.stop_set) <= rounds_lib.MAX_STOP_IDS for r in running):
            inp = self._rounds_inputs(running, active, seeds, sp, policy)
            out = self.programs.step_rounds(inp, mode=mode)
            emitted, acc, lens, conf, count = jax.device_get(out)
            k = int(count)
            return lens[:k], emitted[:k], acc[:k], conf[:k]
        slots = np.asarray([r.slot for r in running])
        caps = np.asarray([r.params.max_new_tokens - len(r.tokens) - 1 for r in running])
        lens_r = self.scheduler.lengths(pending_conf[slots], caps)
        lengths = np.zeros(n, np.int32)
        lengths[slots] = lens_r
        total = int(np.sum(lens_r + 1))
        t = next(b for b in self.config.token_buckets if b >= total)
        need = max(r.pos + 1 + int(lengths[r.slot]) for r in running)
        s = next(b for b in self.config.cache_buckets if b >= need)
        inp = RoundInputs(lengths, active, seeds, sp, self.programs.key)
        out = self.programs.step_round(inp, mode=mode, num_tokens=t, cache_len=s)
        self.scheduler.prepare_next(len(running))  # overlaps the device's round
        emitted, acc, conf = jax.device_get(out)
        return lengths[None], emitted[None], acc[None], conf[None]

    def _rounds_inputs(self, running, active, seeds, sp, policy) -> RoundsInputs:
        n = self.config.num_slots
        room = np.zeros(n, np.int32)
        stop = np.full((n, rounds_lib.MAX_STOP_IDS), -1, np.int32)
        for r in running:
            room[r.slot] = r.params.max_new_tokens - len(r.tokens)
            ids = sorted(r.stop_set)
            stop[r.slot, : len(ids)] = ids
        gamma_p, use_thr, cuts = policy
        k = np.int32(self.config.rounds_per_call)
        return RoundsInputs(active, seeds, sp, self.programs.key, room, stop, gamma_p, use_thr,
                            cuts, k)  # fmt: skip

    def device_policy(self):
        """(gamma_p, use_threshold, cuts) when rounds run on the device, else None: the engine
        was built with rounds_per_call > 1 and the policy is fixed γ / MTP-1 / static threshold
        (Algorithm 1 and async top-K schedule on the host, one round per call)."""
        pol = self.scheduler.policy
        g = self.config.gamma
        if self.config.rounds_per_call <= 1:
            return None
        if isinstance(pol, FixedGamma):
            return np.int32(pol.gamma), np.bool_(False), np.zeros(g, np.float32)
        if isinstance(pol, StaticThreshold):
            key = (self.scheduler.sts, float(pol.theta))
            if self._cuts is None or self._cuts[0] != key:
                self._cuts = (key, rounds_lib.threshold_cuts(key[0], g, key[1]))
            return np.int32(0), np.bool_(True), self._cuts[1]
        return None
