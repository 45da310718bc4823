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
from dspark_jax.engine.flat import flat_jit
from dspark_jax.errors import ConfigError
from dspark_jax.models.generate import generate
from dspark_jax.models.packed import packed_forward
from dspark_jax.testing import CompileCounter
from dspark_jax.xla_cpu import engine_compiler_options

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


def _forward(tcfg, cache_len, one_set, fused, dcfg, scfg, tparams, dparams, state, drafts, key,
             seeds, sp):  # fmt: skip
    """`FORWARD_LOOP` of the round's packed verify forwards over one slot's anchor + drafts ([T]
    tokens), in the engine's form (`ServingEngine.verify_form`), in one device loop that carries
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
                                    cache_len, one_set=one_set, fused=fused)  # fmt: skip
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
    return flat_jit(_forward, static_argnums=(0, 1, 2, 3, 4, 5),
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
        self.snapshot = jax.tree.map(jnp.copy, eng.state)
        self.chain, self.n = self.fresh(), 0

    def readmit(self):
        if self.handle is not None:
            self.eng.cancel(self.handle.id)
            self.eng.step()
        self.handle = self.eng.submit(self.prompt, self.params)
        self.eng.step()  # admission: prefill + first round
        self.left = self.rounds - 1

    def fresh(self):
        return jax.tree.map(jnp.copy, self.snapshot)

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
        inner = eng._rounds

        def timed(*args):
            t0 = time.perf_counter()
            state, out = jax.block_until_ready(inner(*args))
            self.calls.append(((time.perf_counter() - t0) * 1e3, int(out.count)))
            return state, out

        eng._rounds = timed
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
    sampled = temperature > 0
    mode = "sampled" if sampled else "greedy"
    timers: dict[str, object] = {}  # name -> fn returning its own time in ms
    resident = None
    sampling = {"temperature": temperature} if sampled else None
    n_short, n_long = 8, 72

    def gen(n):
        return lambda: _ms(lambda: generate(
            tcfg, tparams, [prompt], max_new_tokens=n, sampling=sampling, seeds=[0],
            batch_buckets=(1,), length_buckets=(pow2_bucket(plen + n_long),),
        ))  # fmt: skip

    timers["gen_short"], timers["gen_long"] = gen(n_short), gen(n_long)
    gammas = {d[0].block_size for d in drafters.values()}
    ts = sorted(set(verify_tokens) | {g + 1 for g in gammas} | {1})
    first = None
    for kind, (dcfg, dparams) in drafters.items():
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
        )  # fmt: skip
        eng.warmup()
        slot = _Slot(eng, prompt, temperature, rounds)
        scfg = eng._scfg(mode)
        sp = eng._sp_rows([slot.params], mode)
        seeds = np.zeros(1, np.uint32)
        s_len = eng.max_len
        full, active = np.full(1, g, np.int32), np.ones(1, bool)

        def run_round(st, eng=eng, g=g, scfg=scfg, sp=sp, seeds=seeds, full=full, active=active):
            st, out = eng._round(eng.tcfg, eng.dcfg, scfg, g + 1, eng.max_len, *eng.program_params,
                                 st, full, active, seeds, sp, eng.key)  # fmt: skip
            jax.block_until_ready(out)
            return st

        def propose(slot=slot, eng=eng, scfg=scfg, sp=sp, seeds=seeds):
            return _ms(lambda: jax.block_until_ready(_propose_jit()(
                eng.dcfg, scfg, eng.program_params[1], slot.snapshot, eng.key, seeds, sp)))  # fmt: skip

        def loop(dcfg_or_none, slot=slot, eng=eng, scfg=scfg, sp=sp, seeds=seeds, g=g):
            drafts = jnp.zeros((g,), jnp.int32) + slot.snapshot.anchor[0]
            d = dcfg_or_none is not None
            args = (eng.tcfg, eng.max_len, *eng.verify_form, dcfg_or_none, scfg if d else None,
                    eng.program_params[0], eng.program_params[1] if d else None, slot.snapshot,
                    drafts, eng.key if d else None, seeds if d else None, sp if d else None)  # fmt: skip
            return lambda: _ms(lambda: jax.block_until_ready(_forward_jit()(*args))) / FORWARD_LOOP

        timers[f"verify_{kind}"] = loop(None)  # the same loop without the drafter
        timers[f"verify_draft_{kind}"] = loop(eng.dcfg)
        timers[f"dispatch_{kind}"] = lambda slot=slot, eng=eng: _ms(
            lambda: jax.block_until_ready(_noop(*eng.program_params, slot.snapshot))
        )
        timers[f"propose_{kind}"] = propose
        timers[f"round_{kind}"] = lambda slot=slot, run=run_round: slot.round_ms(run)
        timers[f"step_{kind}"] = slot.step_ms
        if first is None:  # the forward sweep on the first engine's slot state
            first = (slot, s_len, f"verify_{kind}", g + 1)
            k = resident_rounds
            # room for the admission's K rounds and one timed call of K more: the cache
            # stays near the other engines' length whatever K is
            r_len = min(margin + 2 * k * (g + 1), tcfg.max_position_embeddings)
            if k > 1 and (r_len - margin) // (g + 1) >= 2 * k:  # room for admission + K rounds
                reng = ServingEngine(
                    tcfg, dcfg, tparams, dparams, num_slots=1, policy="fixed", max_len=r_len,
                    prompt_buckets=(plen,), token_buckets=(g + 1,), cache_buckets=(r_len,),
                    modes=(mode,), rounds_per_call=k, mesh=mesh,
                )  # fmt: skip
                reng.warmup()
                resident = (kind, _Resident(reng, prompt, temperature, (r_len - margin) // (g + 1)))
                timers["resident"] = resident[1].step_ms
    if first is not None:
        slot, s_len, same, t_same = first
        for t in ts:
            if t == t_same:  # the first engine's verify timer times this forward
                continue
            drafts = jnp.zeros((t - 1,), jnp.int32) + slot.snapshot.anchor[0]
            timers[f"fwd_{t}"] = lambda drafts=drafts: _ms(lambda: jax.block_until_ready(
                _forward_jit()(slot.eng.tcfg, s_len, *slot.eng.verify_form, None, None,
                             slot.eng.program_params[0], None, slot.snapshot, drafts, None, None,
                             None))) / FORWARD_LOOP  # fmt: skip
    for fn in timers.values():  # compile and warm every program
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
    med = {k: statistics.median(v) for k, v in samples.items()}
    if first is not None:
        med[f"fwd_{first[3]}"] = med[first[2]]
    step = max((med["gen_long"] - med["gen_short"]) / (n_long - n_short), 1e-6)
    out = {
        "temperature": temperature,
        "prompt_tokens": plen,
        "reps": reps,
        "mesh": None if mesh is None else dict(mesh.shape),
        "compilations_during_timing": cc.count,
        "step_ms": step,
        "verify_forward_ms": {t: med[f"fwd_{t}"] for t in ts} if first else {},
        "verify_forward_in_steps": {t: med[f"fwd_{t}"] / step for t in ts} if first else {},
        "drafters": {},
    }
    for kind, (dcfg, _) in drafters.items():
        g = dcfg.block_size
        # the separate proposal call and the round program pay one dispatch each
        d = med[f"dispatch_{kind}"]
        f = med[f"verify_{kind}"]  # per forward of a device loop
        p = max(med[f"verify_draft_{kind}"] - f, 0.0)  # the drafter's work inside the program
        dev_round, r = med[f"round_{kind}"], med[f"step_{kind}"]
        rest = dev_round - d - p - f
        host = r - p - f - rest
        out["drafters"][kind] = {
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
    if resident is not None:
        kind, rs = resident
        d = med[f"dispatch_{kind}"]
        per = [(st / n, (call - d) / n) for st, call, n in rs.samples[-reps:]]
        rnd = statistics.median(r for r, _ in per)
        devm = statistics.median(c for _, c in per)
        p = out["drafters"][kind]["draft_ms"]
        out["resident"] = {
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
    if "dspark" in drafters and "dflash" in drafters:
        ds, df = out["drafters"]["dspark"], out["drafters"]["dflash"]
        if drafters["dspark"][0].num_layers == drafters["dflash"][0].num_layers:
            # same backbone: the difference is the sequential (Markov + confidence) head
            head = ds["draft_ms"] - df["draft_ms"]
            out["sequential_head_share_of_round"] = head / ds["round_ms"]
            # None where drafting is below the timer's resolution (tiny test models)
            out["sequential_head_share_of_propose"] = (
                head / ds["draft_ms"] if ds["draft_ms"] > 0 else None
            )
    return out


def add_ideal(breakdown: dict, tau: dict[str, float]) -> dict:
    """`ideal_speedup` = τ · step / round per drafter with a measured τ."""
    for kind, row in breakdown["drafters"].items():
        if kind in tau and tau[kind] == tau[kind]:
            row["tau"] = tau[kind]
            row["ideal_speedup"] = tau[kind] * breakdown["step_ms"] / row["round_ms"]
    return breakdown
