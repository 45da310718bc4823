"""The report's speed section, end to end: speculative decoding's measured speedup over plain
decoding at batch 1 (`measured_speedup`) and the section's markdown (`markdown_speed`), which
also renders the round's breakdown that `eval.speed.round_breakdown` times.

Only compiled code is timed: every prompt's bucket runs on both paths before timing, and the
compilations during the timed passes are counted (`compilations_during_timing`, must be 0).
"""

from __future__ import annotations

import time

import numpy as np

from dspark_jax.eval.speed import FORWARD_LOOP
from dspark_jax.models.generate import generate
from dspark_jax.testing import CompileCounter


def measured_speedup(
    decoder, tcfg, tparams, prompts, *, max_new_tokens: int, temperature: float, stop_ids=(),
    passes: int = 3,
) -> dict:  # fmt: skip
    """Tokens/s of speculative (`decoder.generate`, a 1-slot engine for batch 1) vs plain
    `generate()` at batch 1, each prompt warmed on both paths first (every bucket compiled); the
    `passes` timed passes alternate the two per prompt; compilations during them are counted.
    Each pass draws new samples (seed = pass · prompts + prompt index, the same seeds on both
    paths): with `stop_ids` (the evaluate stage passes the chat's) the two paths stop at
    different lengths (the sampled texts differ), and a short sample weighs its prompt's
    prefill more, so repeating one sample per prompt would make tokens/s hinge on which side
    happened to draw the shorter answers. Without `stop_ids` both emit exactly
    `max_new_tokens` per prompt, past the end of the answer (text the drafters were not trained
    on: on the demo's models 4.1 instead of 5.2 tokens per round, the speedup about the same).
    `speedup` pools every pass; `speedup_per_pass` is each pass's own ratio (how much the
    machine's pace moved it)."""
    sampling = None if temperature == 0 else {"temperature": temperature}
    prompts = [[int(x) for x in p] for p in prompts]

    def ar(p, seed):
        return generate(tcfg, tparams, [p], max_new_tokens=max_new_tokens, sampling=sampling,
                        stop_ids=stop_ids, seeds=[seed])[0]  # fmt: skip

    rounds = [0]

    def sd(p, seed):
        out = decoder.generate([p], max_new_tokens=max_new_tokens, temperature=temperature,
                               seeds=[seed], stop_ids=stop_ids)[0]  # fmt: skip
        rounds[0] += out.stats.rounds
        return out.tokens

    for i, p in enumerate(prompts):
        ar(p, i)
        sd(p, i)
    names = ("autoregressive", "speculative")
    per = np.zeros((passes, 2, 2))  # [pass, path, (tokens, seconds)]
    rounds[0] = 0
    with CompileCounter() as cc:
        for k in range(passes):
            for i, p in enumerate(prompts):
                seed = k * len(prompts) + i
                for j, fn in enumerate((ar, sd)):
                    t0 = time.perf_counter()
                    per[k, j, 0] += len(fn(p, seed))
                    per[k, j, 1] += time.perf_counter() - t0
    tok = dict(zip(names, per[:, :, 0].sum(0)))
    secs = dict(zip(names, per[:, :, 1].sum(0)))
    res = {f"{k}_tokens_per_s": float(tok[k] / max(secs[k], 1e-9)) for k in tok}
    res["speedup"] = res["speculative_tokens_per_s"] / res["autoregressive_tokens_per_s"]
    rate = per[:, :, 0] / np.maximum(per[:, :, 1], 1e-9)
    res["speedup_per_pass"] = [float(x) for x in rate[:, 1] / np.maximum(rate[:, 0], 1e-9)]
    # per round end to end (prefill included): the tokens a round emits and what it costs
    res["tokens_per_round"] = float(tok["speculative"] / max(rounds[0], 1))
    res["ms_per_round"] = float(secs["speculative"] * 1e3 / max(rounds[0], 1))
    res["ms_per_plain_token"] = float(secs["autoregressive"] * 1e3 / max(tok["autoregressive"], 1))
    res["slots"] = decoder.num_slots
    res["rounds_per_call"] = decoder.rounds_per_call
    res["mesh"] = None if decoder.mesh is None else dict(decoder.mesh.shape)
    res["prompts"] = len(prompts)
    res["passes"] = passes
    res["stop_ids_honoured"] = bool(stop_ids)
    res["compilations_during_timing"] = cc.count
    return res


def _lengths(measured: dict) -> str:
    if measured.get("stop_ids_honoured", True):
        return "each stopping at its stop ids"
    return "each path emitting exactly the token budget per prompt"


def _pass_range(measured: dict) -> str:
    per = measured.get("speedup_per_pass") or []
    if len(per) < 2:
        return ""
    return f" (the passes' own ratios {min(per):.2f}–{max(per):.2f}×)"


def _pct(x) -> str:
    return "—" if x is None else f"{x * 100:.1f}%"


def _of_verify(bd: dict, kind: str) -> str:
    row = bd["drafters"].get(kind, {})
    if "draft_share_of_verify" not in row:
        return ""
    return (f" and {row['draft_share_of_verify'] * 100:.0f}% of the verify forward over its "
            f"{row['gamma'] + 1} tokens")  # fmt: skip


def _where(mesh: dict | None) -> str:
    if not mesh:
        return "on one device"
    return "on the run's mesh (" + ", ".join(f"{k} {v}" for k, v in mesh.items()) + ")"


def markdown_speed(bd: dict | None, measured: dict | None) -> list[str]:
    lines = ["", "## Speed at batch 1 (compiled code only)", ""]
    mesh = (measured or bd or {}).get("mesh")
    if measured or bd:
        lines += [f"Timed {_where(mesh)}.", ""]
    if measured:
        lines.append(
            f"Measured end to end ({measured['prompts']} prompts × {measured.get('passes', 1)} "
            f"passes, {_lengths(measured)}): speculative "
            f"{measured['speculative_tokens_per_s']:.1f} tok/s vs plain "
            f"{measured['autoregressive_tokens_per_s']:.1f} tok/s = **{measured['speedup']:.2f}×**"
            f"{_pass_range(measured)}; "
            f"compilations during timing: {measured['compilations_during_timing']}. One slot, up to "
            f"{measured['rounds_per_call']} device-resident rounds per host call: "
            f"{measured['tokens_per_round']:.2f} tokens per round at "
            f"{measured['ms_per_round']:.2f} ms per round vs {measured['ms_per_plain_token']:.2f} ms "
            "per plain token (prefill included in both)."
        )
        lines.append("")
    if not bd:
        return lines
    lines.append(
        f"Plain decode step: {bd['step_ms']:.2f} ms (compilations during the component timing: "
        f"{bd['compilations_during_timing']}). The breakdown is of one host-scheduled round "
        "(`ServingEngine.step()`, one round per call); the end-to-end number above runs several "
        "rounds per call on the device. Drafting is the drafter's work in a round (its context "
        "update and the γ drafts), timed where the round program runs it: inside a device loop, "
        "after each verify forward. The rest of the round program is acceptance, the residual "
        "draw and the cache update, plus what a device call costs beyond its dispatch when it "
        "starts after other work; the proposal called as a program of its own (last column) "
        "pays that too."
    )
    lines.append("")
    lines.append("| drafter | drafting | verify forward | rest of the round program | host | round | "
                 "round / step | drafting share | τ | ideal speedup τ·step/round | "
                 "proposal as its own call |")  # fmt: skip
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for kind, r in bd["drafters"].items():
        tau = f"{r['tau']:.2f}" if "tau" in r else "—"
        ideal = f"{r['ideal_speedup']:.2f}×" if "ideal_speedup" in r else "—"
        lines.append(
            f"| {kind} | {r['draft_ms']:.2f} ms | {r['verify_forward_ms']:.2f} ms | "
            f"{r['commit_ms']:.2f} ms | {r['host_ms']:.2f} ms | {r['round_ms']:.2f} ms | "
            f"{r['round_in_steps']:.2f} | {r['draft_share_of_round'] * 100:.0f}% | {tau} | {ideal} "
            f"| {r['propose_call_ms']:.2f} ms |"
        )
    if bd.get("resident"):
        r = bd["resident"]
        lines.append("")
        lines.append(
            f"Device-resident rounds ({r['drafter']}, {r['rounds_per_call']} rounds per host call, "
            f"{r['rounds_timed']} rounds timed): {r['round_ms']:.2f} ms per round "
            f"({r['round_in_steps']:.2f} plain steps), of which the device "
            f"{r['device_ms']:.2f} ms and the host {r['host_ms']:.2f} ms "
            f"(**{r['host_share_of_round'] * 100:.1f}%**); drafting "
            f"**{r['draft_share_of_round'] * 100:.1f}%** of the round"
            f"{_of_verify(bd, r['drafter'])}."
        )
    if "sequential_head_share_of_round" in bd:
        lines.append("")
        lines.append(
            "Sequential head (DSpark drafting − DFlash drafting, same backbone): "
            f"{bd['sequential_head_share_of_round'] * 100:.1f}% of a DSpark round, "
            f"{_pct(bd['sequential_head_share_of_propose'])} of its proposal (paper: 0.2–1.3% "
            "of a production round)."
        )
    lines.append("")
    lines.append("Verify forward cost in plain-decode steps by tokens T (per forward, "
                 f"{FORWARD_LOOP} in one device loop): " + ", ".join(
        f"T={t}: {v:.2f}" for t, v in bd["verify_forward_in_steps"].items()))  # fmt: skip
    return lines
