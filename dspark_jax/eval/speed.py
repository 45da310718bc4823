"""The report's speed section, timed by parts: a round's cost breakdown next to a plain decode
step, the ideal speedup at batch 1, and the verify forward's growth with tokens (issue 13). The
measured end-to-end speedup and the section's markdown are `eval.speed_report`'s.

Only compiled code is timed: every program (and, for the end-to-end numbers, every prompt's
bucket) runs twice before timing, and the compilations during the timed part are counted
(`compilations_during_timing`, must be 0). Components are timed in one process, interleaved in a
shuffled order, medians reported; absolute times on a shared CPU are noise, the ratios are not.

Round breakdown, on the serving engine's own programs (`engine.device`, one slot, fixed γ,
blocked calls, the params passed as the engine passes them, `engine.flat.FlatParams`; the cost
of one dispatch with the same arguments, a jitted no-op, is subtracted from the calls):
  verify   the target's packed forward over the γ+1 tokens (`models.packed.packed_forward`,
           the round's own token and cache buckets), per forward of `FORWARD_LOOP` run in one
           device loop that writes the cache in place as a round does (a call per forward
           copied the whole undonated cache: 1-token forwards read ~3 plain steps);
  draft    the drafter's work in a round, timed where a round runs it: the same loop with the
           drafter's context update and proposal after each forward (`_forward`), less the loop
           without them. Earlier reports timed the proposal as a program of its own, called
           between the other timers (`propose_call_ms` keeps that number): on the demo's models
           0.85-1.05 ms beyond its dispatch against 0.39-0.47 ms inside the loop, and 0.54 ms
           when called back to back (s22). The round program pays the in-loop cost: a stub in
           place of the proposal took 0.26-0.64 ms off a device-resident round (three
           alternated pairs of processes);
  commit   `device.packed_round` minus those two and its dispatch: acceptance, residual draw,
           the target cache's update, and what the call costs beyond its dispatch when it starts
           after other work (the gap between `propose_call_ms` and `draft_ms` above);
  host     `ServingEngine.step()` minus the device round's compute (scheduler, dispatch,
           read-back, the host's commit of the tokens).
`round` is one `ServingEngine.step()`. `step` is one plain decode token inside `generate()`'s
device loop (marginal cost of 64 tokens). Ideal speedup = τ · step / round.

Device-resident rounds (`resident`, the first drafter, DSpark when present): the same slot on an
engine that runs K rounds per host call (`engine.rounds`). Per round: `round_ms` (one `step()`
of K rounds / K), `device_ms` (its K-round call, blocked, less one dispatch, / K) and `host_ms`
(the rest: the host's scheduling, dispatch, read-back and replay of the K rounds, / K).
"""

from __future__ import annotations

import functools
import random
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import drafters as drafters_lib
from dspark_jax.buckets import pow2_bucket
from dspark_jax.engine import RequestParams, ServingEngine
from dspark_jax.engine.config import SAMPLING, sampling_rows
from dspark_jax.engine.device import RoundInputs
from dspark_jax.engine.flat import flat_jit
from dspark_jax.errors import ConfigError
from dspark_jax.models.generate import generate
from dspark_jax.models.packed import packed_forward
from dspark_jax.runtime.xla_cpu import engine_compiler_options
from dspark_jax.testing import CompileCounter

VERIFY_TOKENS = (1, 2, 4, 8, 16)
FORWARD_LOOP = 16  # verify forwards per timed call (the time reported is per forward)


@jax.jit
def _noop(tparams, dparams, state):
    """The cost of dispatching a call with a round's arguments and waiting for it."""
    return state.anchor + 1


def _ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _propose(dcfg, scfg, dparams, state, key, seeds, sp):
    return drafters_lib.propose(dcfg, dparams, state.ctx, state.anchor, key, seeds, sp, scfg,
                                rounds_B=state.rounds)  # fmt: skip


@functools.cache
def _propose_jit():  # compiled as the engine's programs are (xla_cpu.engine_compiler_options)
    return flat_jit(_propose, static_argnums=(0, 1), compiler_options=engine_compiler_options())


def _forward(tcfg, cache_len, one_set, dcfg, scfg, tparams, dparams, state, drafts, key, seeds,
             sp):  # fmt: skip
    """`FORWARD_LOOP` of the round's packed verify forwards over one slot's anchor + drafts ([T]
    tokens), in the engine's form (`EnginePrograms.one_set`), in one device loop that carries
    the cache as a round does (written in place; a call per forward would copy the whole
    undonated cache, more than a 1-token forward costs).

    With a drafter (`dcfg`), each forward is followed by the drafter's work of a round, as the
    round program runs it: its context update over the forward's γ+1 positions
    (`drafters.extend_context`, written in place and rewound, so every iteration writes the same
    positions) and the proposal of γ drafts from it, whose drafts are the next forward's tokens
    (each step waits for the one before, and the target's weights pass through the caches in
    between, as in a round). The round counter moves with the iteration, so the draft noise is
    new each time."""
    t = drafts.shape[0] + 1
    toks = jnp.concatenate([state.anchor[:1], drafts])
    pos = state.cache.lengths[0] + jnp.arange(t, dtype=jnp.int32)
    zeros, off = jnp.zeros((t,), jnp.int32), jnp.arange(t, dtype=jnp.int32)
    full = jnp.full((1,), t, jnp.int32)

    def body(i, carry):
        cache, ctx, toks, acc = carry
        out, cache = packed_forward(tcfg, tparams, toks, zeros, off, pos, off >= 0, cache,
                                    cache_len, one_set=one_set)  # fmt: skip
        acc = acc + out.logits[0, -1, 0] + out.features[0, -1, 0]
        if dcfg is not None:
            ctx = drafters_lib.extend_context(dcfg, dparams, ctx, out.features, toks[None], full)
            prop = drafters_lib.propose(dcfg, dparams, ctx, toks[:1], key, seeds, sp, scfg,
                                        rounds_B=state.rounds + i)  # fmt: skip
            toks = jnp.concatenate([toks[:1], prop.tokens[0]])
            acc = acc + prop.probs[0, -1, 0]
            ctx = ctx._replace(lengths=state.ctx.lengths)
        return cache, ctx, toks, acc

    init = (state.cache, state.ctx, toks, jnp.float32(0))
    return jax.lax.fori_loop(0, FORWARD_LOOP, body, init)[3]


@functools.cache
def _forward_jit():  # compiled as the engine's programs are
    return flat_jit(_forward, static_argnums=(0, 1, 2, 3, 4),
                    compiler_options=engine_compiler_options())  # fmt: skip


class _Slot:
    """One ServingEngine slot kept busy: a request that never runs out of room, re-admitted
    (untimed) when it nears its end; a private copy of the slot state for the device-only
    timers, whose donated round chain restarts from that copy every few rounds."""

    def __init__(self, eng: ServingEngine, prompt, temperature: float, rounds: int):
        self.eng, self.prompt, self.rounds = eng, prompt, rounds
        self.params = RequestParams(rounds * (eng.gamma + 1) + 2, temperature=temperature, seed=0)
        self.handle = None
        self.readmit()
        self.snapshot = eng.programs.snapshot()
        self.chain, self.n = self.fresh(), 0

    def readmit(self):
        if self.handle is not None:
            self.eng.cancel(self.handle.id)
            self.eng.step()
        self.handle = self.eng.submit(self.prompt, self.params)
        self.eng.step()  # admission: prefill + first round
        self.left = self.rounds - 1

    def fresh(self):
        return self.eng.programs.snapshot(self.snapshot)

    def step_ms(self) -> float:
        if self.left <= 1:
            self.readmit()
        self.left -= 1
        return _ms(self.eng.step)

    def round_ms(self, run) -> float:
        if self.n >= self.rounds:  # stay inside the cache
            self.chain, self.n = self.fresh(), 0
        jax.block_until_ready(self.chain)
        t0 = time.perf_counter()
        self.chain = run(self.chain)
        dt = (time.perf_counter() - t0) * 1e3
        self.n += 1
        return dt


class _Resident(_Slot):
    """A slot on an engine running K device-resident rounds per `step()`: each timed step also
    records its K-round device call (blocked) and the rounds it ran."""

    def __init__(self, eng: ServingEngine, prompt, temperature: float, rounds: int):
        self.calls: list[tuple[float, int]] = []

        def timer(program, ms, out):  # the engine's K-round calls, blocked (`set_timer`)
            if program == "rounds":
                self.calls.append((ms, int(out.count)))

        eng.programs.set_timer(timer)
        super().__init__(eng, prompt, temperature, rounds)
        self.samples: list[tuple[float, float, int]] = []  # (step ms, call ms, rounds)

    def readmit(self):
        super().readmit()  # its admission step already ran K rounds
        self.left = self.rounds - self.eng.rounds_per_call

    def step_ms(self) -> float:
        if self.left < self.eng.rounds_per_call:
            self.readmit()
        self.left -= self.eng.rounds_per_call
        dt = _ms(self.eng.step)
        call, count = self.calls[-1]
        self.samples.append((dt, call, count))
        return dt


# The breakdown's timers run the round's parts on a dense slot cache (`_forward` loops
# `packed_forward` over the slot's snapshot), so its engines keep the dense layout; the
# end-to-end speedups (`eval.speed_report`) decode on the default, paged engine.
BREAKDOWN_LAYOUT = "slots"


def _slot_engine(tcfg, tparams, dcfg, dparams, plen: int, ts, reps: int, mode: str, mesh=None):
    """A 1-slot engine (fixed γ) with room for `reps` + 4 rounds past the prompt and the forward
    sweep; returns (engine, rounds per admission, margin)."""
    g = dcfg.block_size
    # the slot's room: re-admitted (untimed) every `rounds` rounds, within the context
    margin = plen + 2 * (g + 1) + max(ts) + 8
    max_len = min(margin + (reps + 4) * (g + 1), tcfg.max_position_embeddings)
    rounds = (max_len - margin) // (g + 1)
    if rounds < 2:
        raise ConfigError(
            f"the speed breakdown's prompt ({plen} tokens) leaves no room for rounds in the "
            f"target's context ({tcfg.max_position_embeddings}); use a shorter prompt"
        )
    eng = ServingEngine(
        tcfg, dcfg, tparams, dparams, num_slots=1, policy="fixed", max_len=max_len,
        prompt_buckets=(plen,), token_buckets=(g + 1,), modes=(mode,), mesh=mesh,
        kv_layout=BREAKDOWN_LAYOUT,
    )  # fmt: skip
    eng.warmup()
    return eng, rounds, margin


def _forward_timer(slot: _Slot, drafts, dcfg_or_none, scfg, sp, seeds):
    """ms per forward of `_forward`'s loop over the slot's snapshot (with the drafter's work
    when `dcfg_or_none` is a config)."""
    progs, d = slot.eng.programs, dcfg_or_none is not None
    tp, dp = progs.params
    args = (progs.tcfg, progs.config.max_len, progs.one_set, dcfg_or_none, scfg if d else None,
            tp, dp if d else None, slot.snapshot, drafts, progs.key if d else None,
            seeds if d else None, sp if d else None)  # fmt: skip
    return lambda: _ms(lambda: jax.block_until_ready(_forward_jit()(*args))) / FORWARD_LOOP


def _drafter_timers(kind: str, slot: _Slot, mode: str) -> dict:
    """verify / verify_draft / dispatch / propose / round / step timers of one drafter's slot."""
    progs = slot.eng.programs
    g = progs.config.gamma
    scfg, sp = SAMPLING[mode], sampling_rows([slot.params], mode)
    seeds = np.zeros(1, np.uint32)
    inputs = RoundInputs(np.full(1, g, np.int32), np.ones(1, bool), seeds, sp, progs.key)

    def run_round(st):
        st, out = progs.round(st, inputs, mode=mode, num_tokens=g + 1,
                              cache_len=progs.config.max_len)  # fmt: skip
        jax.block_until_ready(out)
        return st

    def propose():
        return _ms(lambda: jax.block_until_ready(_propose_jit()(
            progs.dcfg, scfg, progs.params[1], slot.snapshot, progs.key, seeds, sp)))  # fmt: skip

    drafts = jnp.zeros((g,), jnp.int32) + slot.snapshot.anchor[0]
    return {
        f"verify_{kind}": _forward_timer(slot, drafts, None, scfg, sp, seeds),  # no drafter
        f"verify_draft_{kind}": _forward_timer(slot, drafts, progs.dcfg, scfg, sp, seeds),
        f"dispatch_{kind}": lambda: _ms(
            lambda: jax.block_until_ready(_noop(*progs.params, slot.snapshot))
        ),
        f"propose_{kind}": propose,
        f"round_{kind}": lambda: slot.round_ms(run_round),
        f"step_{kind}": slot.step_ms,
    }


def _resident_slot(tcfg, tparams, dcfg, dparams, prompt, temperature, mode, margin, k, mesh):
    """The slot on an engine of K device-resident rounds per call, or None without room."""
    g = dcfg.block_size
    # room for the admission's K rounds and one timed call of K more: the cache stays near the
    # other engines' length whatever K is
    r_len = min(margin + 2 * k * (g + 1), tcfg.max_position_embeddings)
    if k <= 1 or (r_len - margin) // (g + 1) < 2 * k:  # no room for admission + K rounds
        return None
    reng = ServingEngine(
        tcfg, dcfg, tparams, dparams, num_slots=1, policy="fixed", max_len=r_len,
        prompt_buckets=(len(prompt),), token_buckets=(g + 1,), cache_buckets=(r_len,),
        modes=(mode,), rounds_per_call=k, mesh=mesh, kv_layout=BREAKDOWN_LAYOUT,
    )  # fmt: skip
    reng.warmup()
    return _Resident(reng, prompt, temperature, (r_len - margin) // (g + 1))


def _sweep_timers(slot: _Slot, ts, t_same: int) -> dict:
    """The verify forward at every T in `ts` but `t_same` (the slot's verify timer's) on the
    first engine's slot state."""
    out = {}
    for t in ts:
        if t != t_same:
            drafts = jnp.zeros((t - 1,), jnp.int32) + slot.snapshot.anchor[0]
            out[f"fwd_{t}"] = _forward_timer(slot, drafts, None, None, None, None)
    return out


def _medians(timers: dict, reps: int, seed: int) -> tuple[dict, int]:
    """Every timer run twice (compile, warm), then `reps` shuffled rounds: (medians, the
    compilations during the timed part)."""
    for fn in timers.values():
        fn()
        fn()
    samples: dict[str, list[float]] = {k: [] for k in timers}
    order = list(timers)
    rng = random.Random(seed)
    with CompileCounter() as cc:
        for _ in range(reps):
            rng.shuffle(order)
            for k in order:
                samples[k].append(timers[k]())
    return {k: statistics.median(v) for k, v in samples.items()}, cc.count


def round_breakdown(
    tcfg,
    tparams,
    drafters: dict[str, tuple],
    prompt,
    *,
    temperature: float = 1.0,
    reps: int = 9,
    verify_tokens=VERIFY_TOKENS,
    seed: int = 0,
    resident_rounds: int = 8,
    mesh=None,
) -> dict:
    """Medians (ms) of a plain decode step, the verify forward at each T in `verify_tokens`, and
    per drafter (`{kind: (dcfg, dparams)}`) propose / commit / host / round, on a 1-slot
    `ServingEngine` (fixed γ) per drafter; with `resident_rounds` K > 1, the first drafter's
    round also with K device-resident rounds per host call (`resident`). `mesh`: the engines'
    mesh (the run's inference mesh; None = one device), recorded in the result."""
    prompt = [int(x) for x in prompt]
    plen = len(prompt)
    mode = "sampled" if temperature > 0 else "greedy"
    sampling = {"temperature": temperature} if temperature > 0 else None
    n_short, n_long = 8, 72

    def gen(n):
        return lambda: _ms(lambda: generate(
            tcfg, tparams, [prompt], max_new_tokens=n, sampling=sampling, seeds=[0],
            batch_buckets=(1,), length_buckets=(pow2_bucket(plen + n_long),),
        ))  # fmt: skip

    timers: dict[str, object] = {"gen_short": gen(n_short), "gen_long": gen(n_long)}
    gammas = {d[0].block_size for d in drafters.values()}
    ts = sorted(set(verify_tokens) | {g + 1 for g in gammas} | {1})
    first = resident = None
    for kind, (dcfg, dparams) in drafters.items():
        eng, rounds, margin = _slot_engine(tcfg, tparams, dcfg, dparams, plen, ts, reps, mode, mesh)
        slot = _Slot(eng, prompt, temperature, rounds)
        timers.update(_drafter_timers(kind, slot, mode))
        if first is None:  # the forward sweep on the first engine's slot state
            first = (slot, f"verify_{kind}", dcfg.block_size + 1)
            rs = _resident_slot(tcfg, tparams, dcfg, dparams, prompt, temperature, mode, margin,
                                resident_rounds, mesh)  # fmt: skip
            if rs is not None:
                resident = (kind, rs)
                timers["resident"] = rs.step_ms
    if first is not None:
        timers.update(_sweep_timers(first[0], ts, first[2]))
    med, compilations = _medians(timers, reps, seed)
    if first is not None:
        med[f"fwd_{first[2]}"] = med[first[1]]
    step = max((med["gen_long"] - med["gen_short"]) / (n_long - n_short), 1e-6)
    out = {
        "temperature": temperature,
        "prompt_tokens": plen,
        "reps": reps,
        "mesh": None if mesh is None else dict(mesh.shape),
        "compilations_during_timing": compilations,
        "step_ms": step,
        "verify_forward_ms": {t: med[f"fwd_{t}"] for t in ts} if first else {},
        "verify_forward_in_steps": {t: med[f"fwd_{t}"] / step for t in ts} if first else {},
        "drafters": {k: _drafter_row(med, k, d[0].block_size, step) for k, d in drafters.items()},
    }
    if resident is not None:
        out["resident"] = _resident_row(med, *resident, out, reps, step)
    out.update(_head_shares(out["drafters"], drafters))
    return out


def _drafter_row(med: dict, kind: str, g: int, step: float) -> dict:
    # the separate proposal call and the round program pay one dispatch each
    d = med[f"dispatch_{kind}"]
    f = med[f"verify_{kind}"]  # per forward of a device loop
    p = max(med[f"verify_draft_{kind}"] - f, 0.0)  # the drafter's work inside the program
    dev_round, r = med[f"round_{kind}"], med[f"step_{kind}"]
    rest = dev_round - d - p - f
    host = r - p - f - rest
    return {
        "gamma": g,
        "dispatch_ms": d,
        "draft_ms": p,
        "propose_call_ms": med[f"propose_{kind}"] - d,
        "verify_forward_ms": f,
        "commit_ms": rest,
        "device_round_ms": dev_round,
        "host_ms": host,
        "round_ms": r,
        "round_in_steps": r / step,
        "draft_share_of_round": p / r,
        "draft_share_of_verify": p / f,
        "host_share_of_round": host / r,
    }


def _resident_row(med: dict, kind: str, rs: _Resident, out: dict, reps: int, step: float):
    d = med[f"dispatch_{kind}"]
    per = [(st / n, (call - d) / n) for st, call, n in rs.samples[-reps:]]
    rnd = statistics.median(r for r, _ in per)
    devm = statistics.median(c for _, c in per)
    p = out["drafters"][kind]["draft_ms"]
    return {
        "drafter": kind,
        "rounds_per_call": rs.eng.rounds_per_call,
        "rounds_timed": sum(n for _, _, n in rs.samples[-reps:]),
        "round_ms": rnd,
        "device_ms": devm,
        "host_ms": rnd - devm,
        "host_share_of_round": (rnd - devm) / rnd,
        "draft_share_of_round": p / rnd,
        "round_in_steps": rnd / step,
    }


def _head_shares(rows: dict, drafters: dict) -> dict:
    """The sequential (Markov + confidence) head's share: DSpark less DFlash of the same
    backbone, when both were timed."""
    if "dspark" not in drafters or "dflash" not in drafters:
        return {}
    if drafters["dspark"][0].num_layers != drafters["dflash"][0].num_layers:
        return {}
    ds, df = rows["dspark"], rows["dflash"]
    head = ds["draft_ms"] - df["draft_ms"]
    return {
        "sequential_head_share_of_round": head / ds["round_ms"],
        # None where drafting is below the timer's resolution (tiny test models)
        "sequential_head_share_of_propose": head / ds["draft_ms"] if ds["draft_ms"] > 0 else None,
    }


def add_ideal(breakdown: dict, tau: dict[str, float]) -> dict:
    """`ideal_speedup` = τ · step / round per drafter with a measured τ."""
    for kind, row in breakdown["drafters"].items():
        if kind in tau and tau[kind] == tau[kind]:
            row["tau"] = tau[kind]
            row["ideal_speedup"] = tau[kind] * breakdown["step_ms"] / row["round_ms"]
    return breakdown
