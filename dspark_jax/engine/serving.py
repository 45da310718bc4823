"""ServingEngine: fixed slots, continuous batching, scheduled packed verification.

This file builds the engine (forms of the target, buckets, device programs, slot state) and
takes requests in (`submit`, `cancel`, `step`). Its mixins share the slot table, device state
and lock: the device calls from the host (`warmup`, prefill, one round or K rounds per call,
sampling modes) are `engine.calls`; the host bookkeeping of a round's outputs (stop ids,
max_new_tokens, records, metrics) is `engine.commit`; how the loop is driven (offline
`generate`, the background thread, `shutdown`) is `engine.driving`. The device programs are
`engine.device` / `engine.rounds`, request checks `engine.slots`, policies `engine.scheduling`.

    eng = ServingEngine(tcfg, dcfg, tparams, dparams, num_slots=8, max_len=1024, policy="alg1",
                        cost_profile=profile, sts=sts)
    eng.warmup()                                   # compiles every bucket; no retrace after
    h = eng.submit([1, 2, 3], RequestParams(max_new_tokens=64, temperature=0.0))
    for delta in h.stream(): ...                   # or eng.start() + astream() in a server

One `step()` = retire finished / cancelled requests, prefill waiting ones into free slots
(prompt-length buckets, long prompts in chunks), schedule every running request's verification
length from its pending draft's calibrated confidences (`engine.scheduling`), run one packed round
on the device (`engine.device.packed_round`, the target's cost follows R + sum l_r padded to a
token bucket) and commit on the host (stop ids, max_new_tokens, per-round records). The host reads
the device once per round (tokens, accepted counts and the next block's confidences together).

With `rounds_per_call=K > 1` and a policy the device can compute (fixed γ, MTP-1, static
threshold), one step runs up to K rounds inside one jitted call (`engine.rounds`): lengths, buckets,
stop ids and max_new_tokens are handled on the device, the host reads the K rounds' outputs once;
the call ends early after a round in which a request finishes. Output is bit-identical to K = 1;
streaming, admission and cancellation then happen every K rounds.

Exactness: every draw is keyed by (stream, request seed, position) (`spec.rng`), draft noise also
by the request's round counter, so a request's output does not depend on its slot, its admission
time or the other requests. Greedy output equals `models.generate.generate` token for token.
"""

from __future__ import annotations

import functools
import itertools
import threading

import jax
import numpy as np

from dspark_jax.buckets import ENGINE_PROMPT_BUCKETS
from dspark_jax.drafters.api import share_target_tables
from dspark_jax.drafters.compat import check_fits
from dspark_jax.engine import device as dev
from dspark_jax.engine import rounds as rounds_lib
from dspark_jax.engine.calls import MODES, EngineCalls
from dspark_jax.engine.commit import EngineCommit
from dspark_jax.engine.compiles import CompileTally
from dspark_jax.engine.driving import EngineDriving
from dspark_jax.engine.flat import FlatParams, flat_jit
from dspark_jax.engine.requests import (
    Delta,
    QueueFull,
    RequestHandle,
    RequestParams,
)
from dspark_jax.engine.scheduling import Scheduler
from dspark_jax.engine.slots import Request, SlotTable, validate_request
from dspark_jax.errors import ConfigError, RequestError
from dspark_jax.models.transformer import untie_lm_head
from dspark_jax.xla_cpu import engine_compiler_options


@functools.cache  # one object per form for all engines: another engine finds the compiled programs
def _round_programs(one_set: bool, fused: bool):
    """(one-round, K-round) device functions running the verify forward in this form."""
    if not (one_set or fused):  # the functions themselves
        return dev.packed_round, rounds_lib.packed_rounds
    kw = dict(one_set=one_set, fused=fused)
    one, many = dev.packed_round, rounds_lib.packed_rounds
    return functools.partial(one, **kw), functools.partial(many, **kw)


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
    table = tparams["embed_tokens"][...]
    return table.size * table.dtype.itemsize <= UNTIE_MAX_BYTES


def _buckets(values, top: int) -> tuple[int, ...]:
    out = sorted({int(v) for v in values if 0 < int(v) < top} | {int(top)})
    return tuple(out)


class ServingEngine(EngineCalls, EngineDriving, EngineCommit):
    def __init__(
        self,
        tcfg,
        dcfg,
        tparams,
        dparams,
        *,
        num_slots: int = 8,
        max_len: int = 1024,
        policy="fixed",
        gamma: int | None = None,
        threshold: float = 0.5,
        cost_profile=None,
        sts=None,
        prompt_buckets=ENGINE_PROMPT_BUCKETS,
        token_buckets=None,
        cache_buckets=None,
        max_queue: int = 256,
        root_seed: int = 0,
        modes=MODES,
        mesh=None,
        rounds_per_call: int = 1,
    ):
        check_fits(tcfg, dcfg)
        if num_slots < 1 or max_len < 2:
            raise ConfigError(f"num_slots ({num_slots}) must be >= 1 and max_len >= 2")
        if max_len > tcfg.max_position_embeddings:
            raise ConfigError(
                f"max_len {max_len} exceeds the target's max_position_embeddings "
                f"{tcfg.max_position_embeddings}"
            )
        if not (isinstance(rounds_per_call, int) and rounds_per_call >= 1):
            raise ConfigError(f"rounds_per_call must be an integer >= 1, got {rounds_per_call!r}")
        if not set(modes) <= set(MODES) or not modes:
            raise ConfigError(f"modes must be a non-empty subset of {MODES}: {modes}")
        if untie_applies(tcfg, tparams):  # the same logits, a faster head product on CPU
            tcfg, tparams = untie_lm_head(tcfg, tparams)
        # the drafter's frozen tables as the target's own arrays where equal: one buffer per table
        dparams = share_target_tables(dparams, tparams)
        # the target as the engine's programs run it (tcfg / tparams: possibly the untied form)
        self.tcfg, self.dcfg, self.tparams, self.dparams = tcfg, dcfg, tparams, dparams
        self.gamma = g = dcfg.block_size
        self.num_slots, self.max_len, self.max_queue = num_slots, max_len, max_queue
        self.modes = tuple(modes)
        top = num_slots * (g + 1)
        if token_buckets is None:
            token_buckets = [1 << i for i in range(top.bit_length())]
        self.token_buckets = _buckets(token_buckets, top)
        self.cache_buckets = _buckets(cache_buckets or (), max_len)
        self.prompt_buckets = _buckets(prompt_buckets, min(max(prompt_buckets), max_len))
        # The verify forward's form (`device.verify_forward`), the same in the one-round and the
        # K-round programs, whatever rounds_per_call (a request's tokens do not depend on it).
        # With one (T, S) program on unsplit weights (no tensor parallelism): the tokens' K/V
        # read back from the cache in one key set. The q|k|v and gate|up products stay separate:
        # fused (`models.packed`'s `fused`) they made a batch-1 round of the demo's target 10%
        # slower under the engine's XLA:CPU option, pre-concatenated kernels included
        # (4.46-4.50 vs 4.04 ms, docs/MEASUREMENTS.md: engine_head).
        tensor = 1 if mesh is None else dict(mesh.shape).get("tensor", 1)
        single = len(self.token_buckets) * len(self.cache_buckets) == 1 and tensor == 1
        self.verify_form = (single, False)  # (one_set, fused)
        self.round_fn, self.rounds_fn = _round_programs(*self.verify_form)
        self.scheduler = Scheduler(
            policy,
            g,
            policy_gamma=gamma,
            threshold=threshold,
            cost=cost_profile,
            sts=sts,
            token_buckets=self.token_buckets,
            has_confidence=dcfg.kind == "dspark" and bool(getattr(dcfg, "confidence_head", True)),
        )
        self.key = jax.random.key(root_seed)
        self._jit_programs()
        # device-resident rounds (engine.rounds): up to rounds_per_call rounds per jitted call
        self.rounds_per_call = rounds_per_call
        self._cuts: tuple | None = None  # (key, threshold cuts) for the device threshold policy
        self._tally = CompileTally()  # compilations caused by this engine's device calls
        # committed to the device like every later state (a jit output), so the first call
        # does not compile a variant for uncommitted inputs that no later call uses
        self.state = jax.device_put(
            dev.init_state(tcfg, dcfg, num_slots, max_len), jax.devices()[0]
        )
        self.slots = SlotTable(num_slots, g)
        self.mesh = mesh
        if mesh is not None:  # params and slot state by the logical-axis table
            from dspark_jax.engine.sharding import shard_engine

            shard_engine(self, mesh)
        # (target, drafter) params as the device programs take them: flattened once, not per call
        self.program_params = (FlatParams.of(self.tparams), FlatParams.of(self.dparams))
        self._lock = threading.RLock()  # queue, requests, counters
        self._step_lock = threading.Lock()  # one step at a time
        self._work = threading.Condition(self._lock)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False
        self._error: BaseException | None = None
        self._m = dict(
            prompt_tokens=0,
            generation_tokens=0,
            draft_tokens=0,
            verified_tokens=0,
            accepted_tokens=0,
            rounds=0,
            submitted=0,
            rejected=0,
        )
        self._acc_pos = np.zeros(g, np.int64)
        self._verified_hist = np.zeros(num_slots * g + 1, np.int64)
        self._finished_by_reason: dict[str, int] = {}

    def _jit_programs(self, state_sharding=None, replicated=None):
        """The device programs: prefill, one round, up to K rounds (engine.rounds). They take
        the params as FlatParams (`program_params`, engine.flat) and are compiled with the
        engine's XLA:CPU option (no YNNPACK fusion: xla_cpu.py); on a mesh (engine.sharding)
        their outputs are pinned to the state's shardings."""
        opts = engine_compiler_options()

        def kw(n_replicated):
            if state_sharding is None:
                return {"compiler_options": opts}
            outs = (state_sharding,) + (replicated,) * n_replicated
            return {"compiler_options": opts, "out_shardings": outs}

        self._prefill = flat_jit(dev.prefill_chunk, static_argnums=(0, 1, 2, 3),
                                 donate_argnums=(6,), **kw(2))  # fmt: skip
        self._round = flat_jit(self.round_fn, static_argnums=(0, 1, 2, 3, 4),
                               donate_argnums=(7,), **kw(1))  # fmt: skip
        self._rounds = flat_jit(self.rounds_fn, static_argnums=tuple(range(6)),
                                donate_argnums=(8,), **kw(1))  # fmt: skip

    def set_policy(self, policy, *, gamma=None, threshold=0.5, cost_profile=None, sts=None):
        """Swap the verification policy (host only: nothing recompiles). Engine must be idle."""
        with self._step_lock:
            if self.slots.running():
                raise RuntimeError("set_policy() needs an idle engine (no running requests)")
            self.scheduler = Scheduler(
                policy,
                self.gamma,
                policy_gamma=gamma,
                threshold=threshold,
                cost=cost_profile,
                sts=sts,
                token_buckets=self.token_buckets,
                has_confidence=self.scheduler.has_confidence,
            )

    # ---- compile accounting ------------------------------------------------------------------

    @property
    def compilations(self) -> int:
        """XLA compilations caused by this engine's warmup() and step() calls since construction
        (`engine.compiles`, JAX's public compile events; programs another engine already
        compiled are cache hits, not counted)."""
        return self._tally.count

    # ---- submission --------------------------------------------------------------------------

    def submit(self, prompt_ids, params: RequestParams) -> RequestHandle:
        """Validate and queue a request (RequestError if invalid, QueueFull if the queue is full)."""
        try:
            prompt = validate_request(self, prompt_ids, params)
        except RequestError:
            with self._lock:
                self._m["rejected"] += 1
            raise
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is shut down; submit() is closed")
            if len(self.slots.queue) >= self.max_queue:
                self._m["rejected"] += 1
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
            self._m["submitted"] += 1
            self._work.notify_all()
        return handle

    def cancel(self, request_id: str) -> None:
        """Cancel a queued or running request; its slot is freed at the next round."""
        with self._lock:
            req = self.slots.find(request_id)
            if req is None or req.done:
                return
            req.cancel_requested = True
            if req.slot is None:
                self.slots.queue.remove(req)
                self._finish(req, [], "cancelled")
            self._work.notify_all()

    # ---- one round ---------------------------------------------------------------------------

    def step(self) -> list[Delta]:
        with self._step_lock, self._tally:
            return self._step()

    def _step(self) -> list[Delta]:
        deltas: list[Delta] = []
        with self._lock:
            for req in self.slots.running():
                if req.cancel_requested:
                    deltas.append(self._finish(req, [], "cancelled"))
            admitted = self.slots.admit()
        if admitted:
            deltas += self._prefill_requests(admitted)
        running = self.slots.running()
        if not running:
            return deltas
        deltas += self._run_round(running)
        return deltas
