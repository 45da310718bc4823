"""The serving engine's objects for its default layout, pages (docs/PAGED_KV.md).

`ServingEngine` builds these unless the config asks for slots (`kv_layout="slots"`):

  plan_pool       the pool's size (`PoolPlan`): num_pages, or a memory budget per device
                  (kv_memory_gib, else the devices' memory), else num_slots x max_len;
  PagedPrograms   `EnginePrograms` on a `paged_device.PagedState` (target and drafter K/V in
                  page pools); each call's block tables come from `tables_fn(width)`; K > 1
                  rounds per call run `paged_rounds` (tables fixed for the call);
  PagedSlotTable  `SlotTable` plus the host `PagePool`: FIFO admission while the pool holds the
                  queue head's prompt + γ + 1 positions, pages freed at release (finish /
                  cancel), `preempt()` before each round (growth to pos + γ + 1, preemption by
                  recompute of the most recently admitted requests);
  PagedRunner     `RoundRunner` whose prefill passes the slot's block table and resumes a
                  preempted request.

Preemption by recompute: the victim loses its slot and pages and goes back to the queue front
with prompt + its tokens but the last as the prompt to prefill, the last token as its anchor and
its round counter (`Request.resume`, a `slots.Resume`), so its next proposal is keyed as before
and its tokens do not change (up to float reassociation between the prefill and the verify
forwards that first wrote those positions). Only rows (slots) and the pools' pages are fixed at
start-up.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from dspark_jax.engine import paged_device as pdev
from dspark_jax.engine.config import EngineConfig, sampling_rows
from dspark_jax.engine.device import PrefillInputs
from dspark_jax.engine.memory import device_limit, plan_engine_memory
from dspark_jax.engine.paged_rounds import paged_rounds
from dspark_jax.engine.pages import PagePool
from dspark_jax.engine.programs import EnginePrograms, _jitted
from dspark_jax.engine.requests import RequestParams
from dspark_jax.engine.runner import RoundRunner
from dspark_jax.engine.sharding import paged_state_shardings
from dspark_jax.engine.slots import Request, Resume, SlotTable
from dspark_jax.errors import ConfigError
from dspark_jax.train.memory import GIB, HEADROOM, _gib, sharded_bytes


def _width(cache_len: int, page: int) -> int:
    return -(-int(cache_len) // page)


class PagedPrograms(EnginePrograms):
    """The engine's programs on page pools; `tables_fn(width)` -> [N, width] int32 tables."""

    def __init__(self, tcfg, dcfg, tparams, dparams, config, mesh=None):
        self.tables_fn = lambda width: np.zeros((config.num_slots, width), np.int32)
        super().__init__(tcfg, dcfg, tparams, dparams, config, mesh)
        self.one_set = True  # the paged forward writes then reads (one key set) always

    def _state_init(self):
        tcfg, dcfg, c = self.tcfg, self.dcfg, self.config
        return lambda: pdev.init_paged_state(tcfg, dcfg, c.num_slots, c.num_pages, c.page_size)

    def _state_shardings(self, abstract_state, mesh):
        return paged_state_shardings(abstract_state, mesh)

    def _jit_programs(self, state_sh, repl):
        return _jitted(state_sh, repl, (pdev.paged_prefill_chunk, pdev.paged_round, paged_rounds))

    def round(self, state, inputs, *, mode: str, num_tokens: int, cache_len: int):
        """(state, RoundOut) after one round; `inputs` a `device.RoundInputs`, the tables added
        here (width: the cache bucket's pages)."""
        tables = self.tables_fn(_width(cache_len, self.config.page_size))
        spec = self.round_spec(mode, num_tokens, cache_len)
        inp = pdev.PagedRoundInputs(inputs, tables)
        return self._call("round", self._round, spec, state, inp)

    def rounds(self, state, inputs, *, mode: str):
        """(state, RoundsOut) after up to K device-resident rounds, the tables at full width
        (the host reserved the K rounds' pages: `PagedSlotTable.preempt(rounds=K)`)."""
        tables = self.tables_fn(_width(self.config.max_len, self.config.page_size))
        return self._call("rounds", self._rounds, self.rounds_spec(mode), state, (inputs, tables))

    def warmup(self) -> None:
        """Every (mode, chunk, width) prefill and (mode, T, width) round, nothing active (a
        warm-up prefill writes page 0's first position, which its owner writes before reading)."""
        c = self.config
        for mode in c.modes:
            sp1 = sampling_rows([RequestParams(1)], mode)
            for chunk, s in c.prefill_shapes():
                z = np.zeros(chunk, np.int32)
                base = PrefillInputs(np.int32(0), z, z, np.int32(0), np.int32(1), np.bool_(True),
                                     np.uint32(0), sp1, self.key)  # fmt: skip
                table = np.zeros((1, _width(s, c.page_size)), np.int32)
                inp = pdev.PagedPrefillInputs(base, table, np.int32(-1), np.int32(0))
                self.step_prefill(inp, mode=mode, cache_len=s)
            for t in c.token_buckets:
                for s in c.cache_buckets:
                    self.step_round(self.idle_round_inputs(mode), mode=mode, num_tokens=t,
                                    cache_len=s)  # fmt: skip
            if c.rounds_per_call > 1:  # nothing active: compiles, runs no round
                self.step_rounds(self.idle_rounds_inputs(mode), mode=mode)
        jax.block_until_ready(self.state)


class PagedSlotTable(SlotTable):
    """Slots plus the page pool; a request is admitted when a slot is free and the pool holds its
    (possibly resumed) prompt + γ + 1 positions."""

    def __init__(self, num_slots: int, gamma: int, pool: PagePool):
        super().__init__(num_slots, gamma)
        self.pool, self.gamma = pool, gamma

    def admit(self) -> list[Request]:
        out = []
        for s, r in enumerate(self.owner):
            if r is not None or not self.queue:
                continue
            req = self.queue[0]
            n = len(prompt_of(req))
            if not self.pool.can_admit(n + self.gamma + 1):
                break  # FIFO: the head waits for pages
            self.queue.popleft()
            self.pool.admit(req, n + self.gamma + 1)
            req.slot, req.pos = s, n
            self.owner[s] = req
            out.append(req)
        return out

    def release(self, req: Request) -> None:
        super().release(req)
        if req in self.pool:
            self.pool.free(req)

    def preempt(self, rounds: int = 1) -> list[Request]:
        """Grow every running request to pos + rounds·(γ + 1) positions (capped at its whole
        length) before a call of `rounds` rounds; the preempted ones (newest first) go back to
        the queue front to be resumed by recompute (a half-prefilled one prefills again)."""
        g1 = self.gamma + 1
        needs = {
            r: min(r.pos + rounds * g1, len(r.prompt) + r.params.max_new_tokens + g1)
            for r in self.running()
        }
        victims = self.pool.reserve(needs)
        for v in victims:  # newest first: the oldest victim ends at the front
            self.owner[v.slot] = None
            v.slot = None
            if v.fill is None:
                v.resume = Resume(v.prompt + v.tokens[:-1], v.tokens[-1], len(v.num_accepted))
            v.fill = None  # a half-prefilled victim starts its prefill (or resume) again
            self.queue.appendleft(v)
        return victims

    def tables(self, width: int) -> np.ndarray:
        """[N, width] int32: each slot's block table, cut or padded (page 0) to `width`
        (positions past a cache bucket are never read or written in that call)."""
        out = np.zeros((len(self.owner), width), np.int32)
        for s, r in enumerate(self.owner):
            if r is not None:
                t = self.pool.table(r)[:width]
                out[s, : len(t)] = t
        return out


def prompt_of(req: Request) -> list[int]:
    """The tokens to prefill: the prompt, or for a resumed request prompt + tokens[:-1]."""
    return req.prompt if req.resume is None else req.resume.prompt


class PagedRunner(RoundRunner):
    """`RoundRunner` whose prefill writes into the request's pages and resumes preempted ones."""

    def _prompt(self, req: Request) -> list[int]:
        return prompt_of(req)

    def _chunk_inputs(self, req: Request, inp: PrefillInputs, cache_len: int):
        """The chunk's inputs with the slot's block table (the slot table's, `tables_fn`) and
        the anchor / round counter a resumed request continues from."""
        resume = req.resume
        anchor, rounds = (-1, 0) if resume is None else (resume.anchor, resume.rounds)
        width = _width(cache_len, self.config.page_size)
        tab = self.programs.tables_fn(width)[req.slot : req.slot + 1]
        return pdev.PagedPrefillInputs(inp, tab, np.int32(anchor), np.int32(rounds))


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """The page pool an engine holds: `num_pages` pages of `page_size` positions, each
    `page_bytes` on one device (the target's K/V and the drafter's context K/V, every layer),
    sized from `source`; `reserved` pages are kept back from admission for the running requests'
    speculative lookahead (γ + 1 positions each, every round)."""

    num_pages: int
    page_size: int
    page_bytes: int
    source: str
    reserved: int
    rows: int
    gamma: int

    @property
    def tokens(self) -> int:
        return self.num_pages * self.page_size

    def concurrency(self, tokens: int) -> int:
        """Requests of `tokens` positions (prompt + output) running at once: the pages'
        bound (after the reserve, each request's γ + 1 lookahead counted) and the rows'."""
        per = -(-(int(tokens) + self.gamma + 1) // self.page_size)
        return max(min(self.rows, (self.num_pages - self.reserved) // per), 0)

    def summary(self, lengths=(512, 2048)) -> str:
        at = ", ".join(f"{self.concurrency(n)} at {n}" for n in lengths)
        return (
            f"KV pool: {self.num_pages} pages x {self.page_size} = {self.tokens} tokens, "
            f"{_gib(self.num_pages * self.page_bytes)} per device (from {self.source}); "
            f"{self.reserved} pages kept for the lookahead; concurrent requests (of "
            f"{self.rows} rows) by request tokens: {at}"
        )


def _pools(tcfg, dcfg, config, mesh, num_pages: int):
    """(abstract state, its shardings, one device's bytes of its K/V pools) at `num_pages`."""
    c = config
    st = jax.eval_shape(
        lambda: pdev.init_paged_state(tcfg, dcfg, c.num_slots, num_pages, c.page_size)
    )
    if mesh is None:
        sh = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        sh = jax.tree.map(lambda _: sh, st)
    else:
        sh = paged_state_shardings(st, mesh)
    kv = sharded_bytes((st.cache, st.ctx.k, st.ctx.v), (sh.cache, sh.ctx.k, sh.ctx.v))
    return st, sh, kv


def plan_pool(tcfg, dcfg, tparams, dparams, config, mesh) -> tuple[EngineConfig, PoolPlan]:
    """(the config with `num_pages` resolved, its PoolPlan). The pool's pages: `num_pages`
    when set; else `kv_memory_gib` per device over one page's bytes; else, when the devices
    report their memory (or `device_memory_gib` is set), what the engine's plan leaves of its
    usable share (params, per-row state and the largest call's transients taken out first);
    else (CPUs report none) `num_slots` x `max_len` positions, every row's whole length. A pool
    sized from memory keeps `num_slots` x pages(γ + 1) pages back from admission, so the
    running requests' lookahead grows into them rather than preempting."""
    c = config
    st1, sh1, kv1 = _pools(tcfg, dcfg, c, mesh, 1)
    page_bytes = _pools(tcfg, dcfg, c, mesh, 2)[2] - kv1
    lookahead = c.num_slots * -(-(c.gamma + 1) // c.page_size)
    if c.num_pages:
        n, source, lookahead = c.num_pages, f"num_pages={c.num_pages}", 0
    elif c.kv_memory_gib:
        n, source = int(c.kv_memory_gib * GIB // page_bytes), f"kv_memory_gib={c.kv_memory_gib:g}"
    elif (limit := device_limit(mesh, c.device_memory_gib)) is not None:
        base = plan_engine_memory(tcfg, c, tparams, dparams, st1, sh1, mesh)
        rest = base.total - kv1
        n = int((HEADROOM * limit - rest) // page_bytes)
        source = f"the devices' memory ({_gib(limit)}, {HEADROOM:.0%} usable, less {_gib(rest)})"
    else:
        n = c.num_slots * -(-c.max_len // c.page_size)  # each row: a whole-length request
        source, lookahead = f"num_slots x max_len = {c.num_slots} x {c.max_len}", 0
    need = -(-(c.gamma + 2) // c.page_size)
    if n < need + lookahead:
        raise ConfigError(
            f"the page pool from {source} holds {max(n, 0)} pages of {c.page_size} positions "
            f"({_gib(max(n, 0) * page_bytes)}), fewer than one request's first round needs "
            f"({need}) plus the {lookahead} kept for the rows' lookahead: give it more memory "
            "(--kv-memory-gb, --num-pages) or fewer rows (--num-slots)"
        )
    plan = PoolPlan(n, c.page_size, page_bytes, source, lookahead, c.num_slots, c.gamma)
    return dataclasses.replace(c, num_pages=n, kv_memory_gib=0.0), plan


def paged_objects(tcfg, dcfg, tparams, dparams, config, mesh, plan: PoolPlan):
    """(programs, slot table) for a paged engine (`config` resolved by `plan_pool`), wired
    together; the pool keeps back the plan's lookahead pages from admission."""
    pool = PagePool(config.num_pages, config.page_size, watermark=plan.reserved)
    programs = PagedPrograms(tcfg, dcfg, tparams, dparams, config, mesh)
    slots = PagedSlotTable(config.num_slots, config.gamma, pool)
    programs.tables_fn = slots.tables
    return programs, slots


def split_resumed(admitted: list[Request], firsts, slots: SlotTable):
    """(new requests, their firsts): resumed ones only take their first block's confidences
    (their anchor was emitted before the preemption) and lose the resume marker."""
    new, new_firsts = [], []
    for req, (first, conf) in zip(admitted, firsts):
        if req.resume is None:
            new.append(req)
            new_firsts.append((first, conf))
        else:
            slots.conf[req.slot] = conf
            req.resume = None
    return new, new_firsts
