"""The report's speed section: a round's cost breakdown next to a plain decode step, the ideal
and the measured speedup at batch 1, and the verify forward's growth with tokens (issue 13).

Only compiled code is timed: every program (and, for the end-to-end numbers, every prompt's
bucket) runs twice before timing, and the compilations during the timed part are counted
(`compilations_during_timing`, must be 0). Components are timed in one process, interleaved in a
shuffled order, medians reported; absolute times on a shared CPU are noise, the ratios are not.

Round breakdown (blocked calls of the `SpeculativeDecoder` programs, batch 1; the cost of one
dispatch with the same arguments, a jitted no-op, is subtracted from each component):
  propose  the drafter's γ drafts (`propose_step`);
  verify   the target forward over the γ+1 tokens against the KV cache;
  commit   `verify_step` minus that forward (acceptance, residual draw, cache and drafter-context
           update);
  host     the fused round through the host loop minus the three above (dispatch, read-back).
`step` is one plain decode token inside `generate()`'s device loop (marginal cost of 64 tokens).
Ideal speedup = τ · step / round.
"""

from __future__ import annotations

import random
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.buckets import pow2_bucket
from dspark_jax.engine.speculative import SpeculativeDecoder, verify_step
from dspark_jax.models.generate import generate
from dspark_jax.models.transformer import forward, init_cache
from dspark_jax.spec.sampling import SamplingConfig, validate_sampling_params
from dspark_jax.testing import CompileCounter

VERIFY_TOKENS = (1, 2, 4, 8, 16)


@jax.jit
def _noop(tparams, dparams, state):
    """The cost of dispatching a call with a round's arguments and waiting for it."""
    return state.anchor + 1


def _ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


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
) -> dict:
    """Medians (ms) of a plain decode step, the verify forward at each T in `verify_tokens`, and
    per drafter (`{kind: (dcfg, dparams)}`) propose / commit / host / round."""
    prompt = [int(x) for x in prompt]
    plen = len(prompt)
    bucket = pow2_bucket(plen)
    sampled = temperature > 0
    sp = validate_sampling_params(max(temperature, 1e-6) if sampled else 0.0, 0, 1.0, 0.0,
                                  batch_size=1)  # fmt: skip
    scfg = SamplingConfig.for_params(sp)
    seeds = jnp.zeros((1,), jnp.uint32)
    timers: dict[str, object] = {}
    sampling = {"temperature": temperature} if sampled else None
    n_short, n_long = 8, 72

    def gen(n):
        return lambda: generate(
            tcfg, tparams, [prompt], max_new_tokens=n, sampling=sampling, seeds=[0],
            batch_buckets=(1,), length_buckets=(pow2_bucket(plen + n_long),),
        )  # fmt: skip

    timers["gen_short"], timers["gen_long"] = gen(n_short), gen(n_long)
    fwd = jax.jit(forward, static_argnums=0)
    cache = init_cache(tcfg, 1, plen + 32)
    pos0 = jnp.arange(plen, dtype=jnp.int32)[None]
    _, cache = fwd(tcfg, tparams, jnp.asarray([prompt]), pos0, cache)
    gammas = {d[0].block_size for d in drafters.values()}
    ts = sorted(set(verify_tokens) | {g + 1 for g in gammas} | {1})
    for t in ts:
        toks = jnp.asarray([(prompt * t)[:t]])
        pos = plen + jnp.arange(t, dtype=jnp.int32)[None]
        timers[f"fwd_{t}"] = lambda toks=toks, pos=pos: jax.block_until_ready(
            fwd(tcfg, tparams, toks, pos, cache)
        )
    vstep = jax.jit(verify_step, static_argnums=(0, 1, 2))
    room = (reps + 4) * 3 * 8 + 64
    states = {}
    for kind, (dcfg, dparams) in drafters.items():
        g = dcfg.block_size
        dec = SpeculativeDecoder(tcfg, dcfg, tparams, dparams, max_len=bucket + room,
                                 length_buckets=(bucket,))  # fmt: skip
        toks = np.zeros((1, bucket), np.int32)
        toks[0, :plen] = prompt
        toks, lens = jnp.asarray(toks), jnp.asarray([plen], jnp.int32)

        def fresh(dec=dec, dcfg=dcfg, dparams=dparams, toks=toks, lens=lens):
            return dec._prefill(tcfg, dcfg, scfg, dec.max_len, tparams, dparams, toks, lens,
                                dec.key, seeds, sp)  # fmt: skip

        state0 = fresh()
        prop0 = dec._propose(dcfg, scfg, dparams, state0, dec.key, seeds, sp)
        full = jnp.full((1,), g, jnp.int32)
        states[kind] = {"state": fresh(), "n": 0}

        def propose(dec=dec, dcfg=dcfg, dparams=dparams, state0=state0):
            jax.block_until_ready(dec._propose(dcfg, scfg, dparams, state0, dec.key, seeds, sp))

        def verify(dcfg=dcfg, dparams=dparams, state0=state0, prop0=prop0, full=full, dec=dec):
            jax.block_until_ready(vstep(tcfg, dcfg, scfg, tparams, dparams, state0, prop0, full,
                                        dec.key, seeds, sp))  # fmt: skip

        def round_(dec=dec, dcfg=dcfg, dparams=dparams, kind=kind, fresh=fresh, full=full):
            rec = states[kind]
            if rec["n"] >= reps + 4:  # stay inside the cache
                rec["state"], rec["n"] = fresh(), 0
            st, out = dec._fused(tcfg, dcfg, scfg, tparams, dparams, rec["state"], full,
                                 dec.key, seeds, sp)  # fmt: skip
            np.asarray(out.emitted), np.asarray(out.num_accepted)  # the host loop's read-back
            rec["state"], rec["n"] = st, rec["n"] + 1

        def noop(dparams=dparams, state0=state0):
            jax.block_until_ready(_noop(tparams, dparams, state0))

        timers[f"dispatch_{kind}"] = noop
        timers[f"propose_{kind}"] = propose
        timers[f"verifystep_{kind}"] = verify
        timers[f"round_{kind}"] = round_
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
                samples[k].append(_ms(timers[k]))
    med = {k: statistics.median(v) for k, v in samples.items()}
    step = max((med["gen_long"] - med["gen_short"]) / (n_long - n_short), 1e-6)
    out = {
        "temperature": temperature,
        "prompt_tokens": plen,
        "reps": reps,
        "compilations_during_timing": cc.count,
        "step_ms": step,
        "verify_forward_ms": {t: med[f"fwd_{t}"] for t in ts},
        "verify_forward_in_steps": {t: med[f"fwd_{t}"] / step for t in ts},
        "drafters": {},
    }
    for kind, (dcfg, _) in drafters.items():
        g = dcfg.block_size
        # each separately called component paid one dispatch; the fused round pays one in all
        d = med[f"dispatch_{kind}"]
        p, v, r = med[f"propose_{kind}"] - d, med[f"verifystep_{kind}"] - d, med[f"round_{kind}"]
        f = med[f"fwd_{g + 1}"] - d
        host = r - p - v
        out["drafters"][kind] = {
            "gamma": g,
            "dispatch_ms": d,
            "propose_ms": p,
            "verify_forward_ms": f,
            "commit_ms": v - f,
            "host_ms": host,
            "round_ms": r,
            "round_in_steps": r / step,
            "draft_share_of_round": p / r,
            "draft_share_of_verify": p / f,
            "host_share_of_round": host / r,
        }
    if "dspark" in drafters and "dflash" in drafters:
        ds, df = out["drafters"]["dspark"], out["drafters"]["dflash"]
        if drafters["dspark"][0].num_layers == drafters["dflash"][0].num_layers:
            # same backbone: the difference is the sequential (Markov + confidence) head
            out["sequential_head_share_of_round"] = (ds["propose_ms"] - df["propose_ms"]) / ds[
                "round_ms"
            ]
            out["sequential_head_share_of_propose"] = (ds["propose_ms"] - df["propose_ms"]) / ds[
                "propose_ms"
            ]
    return out


def add_ideal(breakdown: dict, tau: dict[str, float]) -> dict:
    """`ideal_speedup` = τ · step / round per drafter with a measured τ."""
    for kind, row in breakdown["drafters"].items():
        if kind in tau and tau[kind] == tau[kind]:
            row["tau"] = tau[kind]
            row["ideal_speedup"] = tau[kind] * breakdown["step_ms"] / row["round_ms"]
    return breakdown


def measured_speedup(
    decoder, tcfg, tparams, prompts, *, max_new_tokens: int, temperature: float, stop_ids=()
) -> dict:
    """Tokens/s of speculative (`decoder.generate`) vs plain `generate()` at batch 1, each
    prompt warmed on both paths first (every bucket compiled); the timed passes alternate the
    two per prompt; compilations during them are counted."""
    sampling = None if temperature == 0 else {"temperature": temperature}
    prompts = [[int(x) for x in p] for p in prompts]

    def ar(p, seed):
        return generate(tcfg, tparams, [p], max_new_tokens=max_new_tokens, sampling=sampling,
                        stop_ids=stop_ids, seeds=[seed])[0]  # fmt: skip

    def sd(p, seed):
        return decoder.generate([p], max_new_tokens=max_new_tokens, temperature=temperature,
                                seeds=[seed], stop_ids=stop_ids)[0].tokens  # fmt: skip

    for i, p in enumerate(prompts):
        ar(p, i)
        sd(p, i)
    tok = {"autoregressive": 0, "speculative": 0}
    secs = {"autoregressive": 0.0, "speculative": 0.0}
    with CompileCounter() as cc:
        for i, p in enumerate(prompts):
            for name, fn in (("autoregressive", ar), ("speculative", sd)):
                t0 = time.perf_counter()
                tok[name] += len(fn(p, i))
                secs[name] += time.perf_counter() - t0
    res = {f"{k}_tokens_per_s": tok[k] / max(secs[k], 1e-9) for k in tok}
    res["speedup"] = res["speculative_tokens_per_s"] / res["autoregressive_tokens_per_s"]
    res["prompts"] = len(prompts)
    res["compilations_during_timing"] = cc.count
    return res


def markdown_speed(bd: dict | None, measured: dict | None) -> list[str]:
    lines = ["", "## Speed at batch 1 (compiled code only)", ""]
    if measured:
        lines.append(
            f"Measured end to end ({measured['prompts']} prompts): speculative "
            f"{measured['speculative_tokens_per_s']:.1f} tok/s vs plain "
            f"{measured['autoregressive_tokens_per_s']:.1f} tok/s = **{measured['speedup']:.2f}×**; "
            f"compilations during timing: {measured['compilations_during_timing']}."
        )
        lines.append("")
    if not bd:
        return lines
    lines.append(
        f"Plain decode step: {bd['step_ms']:.2f} ms (compilations during the component timing: "
        f"{bd['compilations_during_timing']})."
    )
    lines.append("")
    lines.append("| drafter | propose | verify forward | commit | host | round | round / step | "
                 "drafting share | τ | ideal speedup τ·step/round |")  # fmt: skip
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for kind, r in bd["drafters"].items():
        tau = f"{r['tau']:.2f}" if "tau" in r else "—"
        ideal = f"{r['ideal_speedup']:.2f}×" if "ideal_speedup" in r else "—"
        lines.append(
            f"| {kind} | {r['propose_ms']:.2f} ms | {r['verify_forward_ms']:.2f} ms | "
            f"{r['commit_ms']:.2f} ms | {r['host_ms']:.2f} ms | {r['round_ms']:.2f} ms | "
            f"{r['round_in_steps']:.2f} | {r['draft_share_of_round'] * 100:.0f}% | {tau} | {ideal} |"
        )
    if "sequential_head_share_of_round" in bd:
        lines.append("")
        lines.append(
            "Sequential head (DSpark propose − DFlash propose, same backbone): "
            f"{bd['sequential_head_share_of_round'] * 100:.1f}% of a DSpark round, "
            f"{bd['sequential_head_share_of_propose'] * 100:.1f}% of its proposal (paper: 0.2–1.3% "
            "of a production round)."
        )
    lines.append("")
    lines.append("Verify forward cost in plain-decode steps by tokens T: " + ", ".join(
        f"T={t}: {v:.2f}" for t, v in bd["verify_forward_in_steps"].items()))  # fmt: skip
    return lines
