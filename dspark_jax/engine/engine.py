"""ServingEngine: fixed slots, continuous batching, scheduled packed verification.

The engine wires five objects and keeps the public API (`submit`, `cancel`, `step`, `generate`,
`start`, `shutdown`, `warmup`, `metrics`, `set_policy`, `compilations`, `has_work`):

  config     `EngineConfig` (engine.config): slots, lengths, buckets, modes, K, seed; frozen;
  programs   `EnginePrograms` (engine.programs): params, slot state, root key, jitted programs;
  slots      `SlotTable` (engine.slots): which request holds which slot, the waiting queue;
  runner     `RoundRunner` (engine.runner): requests -> program inputs, with the `Scheduler`
             (engine.scheduler) choosing each round's verification lengths;
  committer  `Committer` (engine.commit): device outputs -> tokens, deltas, metrics;
and a `BackgroundLoop` (engine.loop) for `start` / `shutdown`.

    eng = ServingEngine(tcfg, dcfg, tparams, dparams, num_slots=8, max_len=1024, policy="alg1",
                        cost_profile=profile, sts=sts)
    eng.warmup()                                   # compiles every bucket; no retrace after
    h = eng.submit([1, 2, 3], RequestParams(max_new_tokens=64, temperature=0.0))
    for delta in h.stream(): ...                   # or eng.start() + astream() in a server

One `step()` = retire cancelled requests, prefill waiting ones into free slots (prompt-length
buckets, long prompts in chunks), run one packed round (or, with `rounds_per_call=K > 1` and a
policy the device computes, up to K device-resident rounds in one call, `engine.rounds`) and
commit on the host. The host reads the device once per call. Output does not depend on K.

Faults (`engine.faults`): a request whose logits turn non-finite, or whose prefill or round
raises on the device, ends with finish_reason "error" (counted by cause); the others go on.

Exactness: every draw is keyed by (stream, request seed, position) (`spec.rng`), draft noise also
by the request's round counter, so a request's output does not depend on its slot, its admission
time or the other requests. Greedy output equals `models.generate.generate` token for token.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import jax
import numpy as np

from dspark_jax.compat import check_cost_profile, check_drafter_dtype
from dspark_jax.drafters.api import narrow_context_window, share_target_tables
from dspark_jax.drafters.compat import check_fits
from dspark_jax.engine import faults, paged_engine
from dspark_jax.engine.commit import Committer, EngineCounters
from dspark_jax.engine.compiles import CompileTally
from dspark_jax.engine.config import MODES, EngineConfig
from dspark_jax.engine.loop import BackgroundLoop, params_from_knobs
from dspark_jax.engine.paged_engine import PagedRunner, split_resumed
from dspark_jax.engine.programs import EnginePrograms
from dspark_jax.engine.requests import Delta, QueueFull, RequestHandle, RequestParams
from dspark_jax.engine.runner import Fill, RoundRunner
from dspark_jax.engine.scheduler import Scheduler
from dspark_jax.engine.slots import Request, SlotTable, validate_request
from dspark_jax.errors import RequestError
from dspark_jax.models.transformer import embedding_table, untie_lm_head

log = logging.getLogger(__name__)

__all__ = ["MODES", "EngineConfig", "ServingEngine", "untie_applies"]

# A tied LM head is run from an untied [H, V] copy on CPU when the copy is at most this large
# (`transformer.untie_lm_head`): XLA:CPU's dot reads the tied [V, H] table transposed, 7x slower
# than the copy at the verify forward's 8 rows under the engine's option (220 vs 31 us, demo
# target), a tenth of a batch-1 round (docs/MEASUREMENTS.md: engine_head)
UNTIE_MAX_BYTES = 256 << 20


def untie_applies(tcfg, tparams) -> bool:
    """Whether the engine runs this target with an untied LM head copy (CPU, a tied head, the
    copy within UNTIE_MAX_BYTES)."""
    if not tcfg.tie_word_embeddings or jax.default_backend() != "cpu":
        return False
    table = embedding_table(tparams)
    return table.size * table.dtype.itemsize <= UNTIE_MAX_BYTES


def _engine_params(tcfg, tparams, dparams):
    """(tcfg, tparams, dparams) as the engine's programs run them: the head possibly untied, the
    drafter's frozen tables as the target's own arrays where equal (one buffer per table)."""
    if untie_applies(tcfg, tparams):  # the same logits, a faster head product on CPU
        tcfg, tparams = untie_lm_head(tcfg, tparams)
    return tcfg, tparams, share_target_tables(dparams, tparams)


def _scheduler(config, dcfg, policy, gamma, threshold, cost_profile, sts) -> Scheduler:
    check_cost_profile(cost_profile, dcfg.target)  # measured for this target and device
    return Scheduler(
        policy, config.gamma, policy_gamma=gamma, threshold=threshold, cost=cost_profile,
        sts=sts, token_buckets=config.token_buckets,
        has_confidence=dcfg.kind == "dspark" and bool(getattr(dcfg, "confidence_head", True)),
    )  # fmt: skip


class ServingEngine:
    def __init__(self, tcfg, dcfg, tparams, dparams, *, policy="fixed", gamma: int | None = None,
                 threshold: float = 0.5, cost_profile=None, sts=None, mesh=None,
                 config: EngineConfig | None = None, context_window: int | None = None,
                 **config_kw):  # fmt: skip
        """`config_kw` (without `config`): `EngineConfig.build`'s keywords (num_slots, max_len,
        prompt_buckets, token_buckets, cache_buckets, modes, rounds_per_call, max_queue,
        root_seed, kv_layout, page_size, num_pages, kv_memory_gib, prefill_tokens_per_step,
        device_memory_gib).
        `policy` .. `sts`: the Scheduler's (`set_policy` swaps it). `context_window`: the drafter's context window
        at serving time (None: as trained; it may narrow the trained one, never widen it,
        `drafters.api.narrow_context_window`)."""
        dcfg = narrow_context_window(dcfg, context_window)
        check_fits(tcfg, dcfg)
        check_drafter_dtype(dcfg, dparams)
        if config is None:
            config = EngineConfig.build(tcfg, dcfg, **config_kw)
        elif config_kw:
            raise TypeError(f"pass config= or its keywords, not both: {sorted(config_kw)}")
        else:  # checked against these models, like the keywords
            config = config.for_models(tcfg, dcfg)
        tcfg, tparams, dparams = _engine_params(tcfg, tparams, dparams)
        self.pool_plan = None  # the page pool's plan (engine.paged_engine.PoolPlan)
        if config.kv_layout == "paged":  # K/V in page pools (engine.paged_engine)
            config, self.pool_plan = paged_engine.plan_pool(tcfg, dcfg, tparams, dparams,
                                                            config, mesh)  # fmt: skip
            self.programs, self.slots = paged_engine.paged_objects(
                tcfg, dcfg, tparams, dparams, config, mesh, self.pool_plan
            )
        else:
            self.programs = EnginePrograms(tcfg, dcfg, tparams, dparams, config, mesh)
            self.slots = SlotTable(config.num_slots, config.gamma)
        self.config = config
        self._paged = config.kv_layout == "paged"
        self._counters = EngineCounters(config.num_slots, config.gamma)
        self._committer = Committer(config.gamma, self.slots, self._counters,
                                    keep_conf=dcfg.kind == "dspark")  # fmt: skip
        sched = _scheduler(config, dcfg, policy, gamma, threshold, cost_profile, sts)
        if self._paged:
            self._runner = PagedRunner(config, self.programs, sched)
        else:
            self._runner = RoundRunner(config, self.programs, sched)
        self._tally = CompileTally()  # compilations caused by this engine's device calls
        self._lock = threading.RLock()  # queue, requests, counters
        self._step_lock = threading.Lock()  # one step at a time
        self._work = threading.Condition(self._lock)
        self._loop = BackgroundLoop(self.step, self.has_work, self._fail_all, self._work)
        self.mirror = None  # engine.multihost.Mirror when the mesh spans processes
        self.mirror_stopped = False  # a follower's engine after the leader's stop message
        self._ids = itertools.count()
        self._closed = False

    # ---- what the engine runs (read-only views) -----------------------------------------------

    tcfg = property(lambda self: self.programs.tcfg, doc="the target as the programs run it")
    dcfg = property(lambda self: self.programs.dcfg)
    mesh = property(lambda self: self.programs.mesh)
    scheduler = property(lambda self: self._runner.scheduler, doc="the current Scheduler")
    gamma = property(lambda self: self.config.gamma)
    num_slots = property(lambda self: self.config.num_slots)
    max_len = property(lambda self: self.config.max_len)
    token_limit = property(lambda self: self.config.token_limit,
                           doc="prompt + new tokens one request may hold")  # fmt: skip
    max_queue = property(lambda self: self.config.max_queue)
    modes = property(lambda self: self.config.modes)
    rounds_per_call = property(lambda self: self.config.rounds_per_call)
    token_buckets = property(lambda self: self.config.token_buckets)
    cache_buckets = property(lambda self: self.config.cache_buckets)
    prompt_buckets = property(lambda self: self.config.prompt_buckets)

    @property
    def memory_plan(self):
        """Bytes per device (`engine.memory.EngineMemoryPlan`), planned before the state was
        created; an engine whose plan cannot fit its devices is refused (ConfigError)."""
        return self.programs.memory_plan

    @property
    def compilations(self) -> int:
        """XLA compilations caused by this engine's warmup() and step() calls since construction
        (`engine.compiles`, JAX's public compile events; programs another engine already
        compiled are cache hits, not counted)."""
        return self._tally.count

    @property
    def compilations_from_cache(self) -> int:
        """Of `compilations`, those the persistent compilation cache served (read, not
        compiled; `dspark_jax.runtime.compile_cache`)."""
        return self._tally.cache_hits

    @property
    def page_pool(self):
        """The host `PagePool` with kv_layout="paged" (None with slots)."""
        return self.slots.pool if self._paged else None

    def warmup(self) -> None:
        """Compile every (mode, prompt bucket) prefill and (mode, token bucket, cache bucket)
        round. Runs them on free slots with nothing active, so it leaves no trace."""
        with self._step_lock, self._tally:
            if self.slots.running():
                raise RuntimeError("warmup() must run before requests are admitted")
            self.programs.warmup()

    def set_policy(self, policy, *, gamma=None, threshold=0.5, cost_profile=None, sts=None):
        """Swap the verification policy (host only: nothing recompiles). Engine must be idle."""
        with self._step_lock:
            if self.slots.running():
                raise RuntimeError("set_policy() needs an idle engine (no running requests)")
            sched = _scheduler(self.config, self.dcfg, policy, gamma, threshold, cost_profile, sts)
            self._runner.set_scheduler(sched)

    def metrics(self):
        with self._lock:
            return self._counters.metrics(
                len(self.slots.queue), len(self.slots.running()), self.compilations
            )

    # ---- requests ----------------------------------------------------------------------------

    def submit(self, prompt_ids, params: RequestParams) -> RequestHandle:
        """Validate and queue a request (RequestError if invalid, QueueFull if the queue is full)."""
        try:
            prompt = validate_request(prompt_ids, params, self.config, self.tcfg.vocab_size,
                                      self.tcfg.max_position_embeddings)  # fmt: skip
        except RequestError:
            with self._lock:
                self._counters.add("rejected")
            raise
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is shut down; submit() is closed")
            if len(self.slots.queue) >= self.max_queue:
                self._counters.add("rejected")
                raise QueueFull(
                    f"{len(self.slots.queue)} requests are waiting (max_queue={self.max_queue}); "
                    "retry later"
                )
            rid = f"req-{next(self._ids)}"
            handle = RequestHandle(rid, self)
            req = Request(rid, prompt, params, handle)
            if params.seed is None:
                req.seed = int(np.random.default_rng().integers(0, 2**32))
            self.slots.enqueue(req)
            if self.mirror is not None:
                self.mirror.submitted(req)
            self._counters.add("submitted")
            self._work.notify_all()
        return handle

    def cancel(self, request_id: str) -> None:
        """Cancel a queued or running request; its slot is freed at the next round."""
        with self._lock:
            req = self.slots.find(request_id)
            if req is None or req.done:
                return
            req.cancel_requested = True
            if self.mirror is not None:
                self.mirror.cancelled(request_id)
            if req.slot is None:
                self.slots.queue.remove(req)
                self._committer.finish(req, [], "cancelled")
            self._work.notify_all()

    @property
    def work_condition(self) -> threading.Condition:
        """Notified on every submission and cancellation (the engine's lock)."""
        return self._work

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.slots.queue) or bool(self.slots.running())

    # ---- one step ----------------------------------------------------------------------------

    def step(self) -> list[Delta]:
        """One step; a fault inside it ends only the requests it touched (`_device_fault`)."""
        with self._step_lock, self._tally:
            deltas: list[Delta] = []
            with self._lock:
                if self.mirror is not None and not self.mirror.sync():
                    self.mirror_stopped = True  # the leader stopped: a follower ends here
                    return deltas
                for req in self.slots.running():
                    if req.cancel_requested:
                        deltas.append(self._retire(req))
                if self._paged:  # grow the running requests' pages; preempt if out of pages
                    k = self.config.rounds_per_call if self._runner.device_policy() else 1
                    self.slots.preempt(k)
                for r in self.slots.admit():
                    r.fill = Fill()
                pending = self.slots.prefilling()
            if pending:
                deltas += self._prefill(pending)
            if self._paged and self.config.rounds_per_call > 1:
                with self._lock:  # the K rounds' pages of the requests admitted just now
                    self.slots.preempt(k)
            running = self.slots.decoding()
            if running:
                try:
                    outs = self._runner.run(running, self.slots.conf)
                except faults.HOST_ERRORS:
                    raise
                except Exception as e:  # noqa: BLE001 - a device fault: see _device_fault
                    return deltas + self._device_fault(e, running)
                with self._lock:
                    deltas += self._committer.rounds(running, *outs)
            return deltas

    def _retire(self, req: Request) -> Delta:
        if req.fail_cause is not None:
            return self._committer.fail(req, req.fail_cause)
        return self._committer.finish(req, [], "cancelled")

    def _prefill(self, pending: list[Request]) -> list[Delta]:
        """Prefill the requests holding a slot whose prompt is not all written, within the
        step's budget; those that finish join the rounds. One whose device call raised ends with
        an error (`_device_fault`: out of memory on admission ..), as does one whose prompt's
        values are not finite (first token -1, `device.chunk_finite`)."""
        try:
            done = self._runner.prefill(pending)
        except faults.HOST_ERRORS:
            raise
        except Exception as e:  # noqa: BLE001 - reading the results failed: all of them
            return self._device_fault(e, pending)
        admitted, firsts = [r for r, _ in done], [f for _, f in done]
        deltas = []
        for r, f in zip(admitted, firsts):
            if isinstance(f, Exception):
                deltas += self._device_fault(f, [r])
        with self._lock:
            kept = [(r, f) for r, f in zip(admitted, firsts) if not r.done]
            deltas += [self._committer.fail(r, "nonfinite", "at admission")
                       for r, (first, _) in kept if first < 0]  # fmt: skip
            kept = [(r, f) for r, f in kept if not r.done]
            admitted, firsts = [r for r, _ in kept], [f for _, f in kept]
            if self._paged:  # resumed requests emitted their anchor already
                admitted, firsts = split_resumed(admitted, firsts, self.slots)
            return deltas + self._committer.admitted(admitted, firsts)

    def _device_fault(self, exc: BaseException, touched: list[Request]) -> list[Delta]:
        """A device call (prefill or round) raised: the requests it ran for (`touched`) end
        with an error ("oom" or "device", `engine.faults`) and free their slots and pages. If
        the call consumed the state (its donated buffers, or buffers holding the error), the
        state is rebuilt empty and every other request holding a slot ends with an error too
        (its K/V is gone; it is not recomputed). Queued requests and new ones are served."""
        cause = faults.device_cause(exc)
        detail = type(exc).__name__
        first_line = (str(exc).strip().splitlines() or [""])[0][:500]
        log.error("a device call failed (%s) for %d request(s): %s: %s", cause, len(touched),
                  detail, first_line)  # fmt: skip
        with self._lock:
            victims = [r for r in touched if not r.done]
            if faults.state_lost(self.programs.state):
                self.programs.reset_state()
                victims += [r for r in self.slots.running() if r not in victims]
            return [self._committer.fail(r, cause, detail) for r in victims]

    # ---- driving -----------------------------------------------------------------------------

    def generate(self, prompts, params=None, **knobs):
        """Offline convenience: submit all (one RequestParams or one per prompt), run, collect
        the RequestOutputs. Also accepts keyword knobs instead of `params` (max_new_tokens,
        temperature, top_k, top_p, min_p, seeds, stop_ids; scalar or one per prompt)."""
        if params is None:
            params = params_from_knobs(len(prompts), **knobs)
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
                    if not self.runs_in_background():
                        self.step()
                    else:
                        time.sleep(0.01)
        return [h.result() for h in handles]

    def runs_in_background(self) -> bool:
        return self._loop.alive()

    def drive_until(self, done, deadline) -> None:
        """Step (in the caller's thread) until `done()`, no work is left or `deadline`."""
        while not done():
            if deadline is not None and time.monotonic() > deadline:
                return
            if not self.has_work():
                return
            self.step()

    def start(self) -> None:
        """Run the steps in a background thread (what the HTTP server uses)."""
        self._loop.start()

    def _fail_all(self, why: str) -> None:
        """An unexpected exception in a step (host code): every request ends with an error
        ("internal"); a consumed state is rebuilt, so the engine serves new requests."""
        with self._lock:
            for r in list(self.slots.queue) + self.slots.running():
                if r.slot is None:
                    self.slots.queue.remove(r)
                self._committer.fail(r, "internal")
            if faults.state_lost(self.programs.state):
                self.programs.reset_state()

    def fail(self, request_id: str, cause: str, detail: str = "") -> None:
        """End a queued or running request with an error for `cause` (`engine.faults.CAUSES`;
        the server's "detokenize"); its slot is freed at the next round. A request the engine
        has finished already (its output ended with another reason) is still counted: its
        caller gets the error."""
        if cause not in faults.CAUSES:
            raise ValueError(f"unknown error cause {cause!r}; one of {faults.CAUSES}")
        with self._lock:
            req = self.slots.find(request_id)
            if req is None or req.done:
                self._counters.errors_by_cause[cause] += 1
                return
            if self.mirror is not None:
                self.mirror.failed(request_id, cause, detail)
            if req.slot is None:
                self.slots.queue.remove(req)
                self._committer.fail(req, cause, detail)
            else:
                req.cancel_requested, req.fail_cause = True, cause
            self._work.notify_all()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests; finish (drain) or cancel the others; stop the thread."""
        with self._lock:
            self._closed = True
            if not drain:
                if self.mirror is not None:  # the followers cancel the same requests
                    for r in list(self.slots.queue) + self.slots.running():
                        self.mirror.cancelled(r.id)
                for r in list(self.slots.queue):
                    self.slots.queue.remove(r)
                    self._committer.finish(r, [], "cancelled")
                for r in self.slots.running():
                    r.cancel_requested = True
        if self._loop.stop(timeout):
            return
        if not drain:
            self.step()
        else:
            self.drive_until(lambda: False, None if timeout is None else time.monotonic() + timeout)
