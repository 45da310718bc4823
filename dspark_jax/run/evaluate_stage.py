"""The evaluate stage of `train.py`'s pipeline (`Pipeline._stage_evaluate` delegates here): τ per
drafter and dataset at `evaluate.temperature`, the τ table at the other `evaluate.temperatures`,
the calibration report, the speed measurements and the analyses, written as report.json,
report.md and PNGs. Each function takes the `Pipeline` (`p`) for its config, loaders and log.
"""

from __future__ import annotations

import numpy as np
from tqdm.auto import tqdm

from dspark_jax.errors import ConfigError
from dspark_jax.eval import analyses, offline, speed_report
from dspark_jax.eval import speed as evspeed
from dspark_jax.eval.offline import calibration_pairs
from dspark_jax.io import atomic_path, write_json_atomic, write_text_atomic
from dspark_jax.sched.cost import CostProfile
from dspark_jax.sched.sts import STS
from dspark_jax.spec.metrics import reliability_from_logits
from dspark_jax.train.data import select_prompts


def run_evaluate(p) -> dict:
    """The evaluate stage's body: τ per drafter and dataset, calibration, other temperatures,
    speed and analyses; writes report.json / report.md / PNGs into the stage's folder."""
    e = p.cfg.evaluate
    tcfg, tparams = p.target()
    stop = p.stop_ids()
    datasets, coverage = eval_datasets(p)
    longest = max(len(q) for ds in datasets.values() for q in ds.prompts)
    domains = {k: v.domain for k, v in datasets.items()}
    per_drafter: dict[str, dict] = {}
    calib = None
    total = sum(len(v.prompts) for v in datasets.values()) * len(p.cfg.drafters.kinds)
    bar = tqdm(total=total, desc="evaluate", unit="prompt")
    all_results = {}
    decoders = {k: eval_decoder(p, k, longest) for k in p.cfg.drafters.kinds}
    for kind in p.cfg.drafters.kinds:
        dec = decoders[kind]
        per_drafter[kind] = {}
        for name, ds in datasets.items():
            res = offline.run_dataset(
                dec, ds, max_new_tokens=e.max_new_tokens, temperature=e.temperature,
                seed=e.seed, stop_ids=stop, batch_size=e.batch_size, progress=bar,
            )  # fmt: skip
            per_drafter[kind][name] = offline.summarize(res, dec.dcfg.block_size)
            all_results[(kind, name)] = res
    bar.close()
    table = offline.tau_table(per_drafter, domains)
    if "dspark" in per_drafter and (p.stage_dir("calibrate") / "sts.json").exists():
        calib = _calibration_report(p, all_results, datasets)
    by_temp = _other_temperatures(p, decoders, datasets, domains, stop)
    speed, breakdown = None, None
    if e.speed_prompts and p.cfg.drafters.kinds:
        kind = "dspark" if "dspark" in p.cfg.drafters.kinds else p.cfg.drafters.kinds[0]
        first = next(iter(datasets.values()))
        if e.speed_reps:
            breakdown = _speed_breakdown(p, first.prompts[0], table)
        p.log("  speed: plain vs speculative decoding at batch 1 (every bucket warmed)")
        # `speed_prompts` from every evaluated set (each domain's answers draft differently)
        sprompts = [q for ds in datasets.values() for q in ds.prompts[: e.speed_prompts]]
        # batch 1, fixed γ: every round but the last verifies γ + 1 tokens, so one token
        # bucket (the device loop then has fewer verify programs to choose among); the prompt
        # buckets are plain `generate`'s (a prompt is prefilled at its own bucket on both sides)
        batch1 = p.rundir.decoder_for(
            kind, [len(q) for q in sprompts], e.max_new_tokens, e.max_len, num_slots=1,
            rounds_per_call=e.speed_rounds_per_call,
            token_buckets=(p.cfg.drafters.block_size + 1,),
        )  # fmt: skip
        speed = speed_report.measured_speedup(
            batch1, tcfg, tparams, sprompts,
            max_new_tokens=e.max_new_tokens, temperature=e.temperature, stop_ids=stop, passes=5,
        )  # fmt: skip
        speed = {"drafter": kind, **speed}
    extra = _analyses(p, all_results, datasets, domains, breakdown, table)
    report = {
        "config": p.cfg.name,
        # the mesh the decoders ran on (None: one device)
        "mesh": None if p.rundir.mesh is None else dict(p.rundir.mesh.shape),
        # prompts evaluated / available / too long for the context, per dataset
        "datasets": {k: coverage[k] for k in datasets},
        "datasets_not_evaluated": {k: v for k, v in coverage.items() if k not in datasets},
        **table,
        "per_dataset": per_drafter,
        "calibration": calib,
        "tau_by_temperature": by_temp,
        "speed_batch1": speed,
        "speed_breakdown": breakdown,
        **{k: v for k, v in extra.items() if not k.startswith("_")},
        "stage_seconds": p.timings,
    }
    out = p.stage_dir("evaluate")
    write_json_atomic(out / "report.json", report)
    md = offline.markdown_report(table, per_drafter, None, calib, coverage=coverage)
    md += "\n".join(extra["_markdown"] + _temperature_lines(by_temp)
                    + speed_report.markdown_speed(breakdown, speed)) + "\n"  # fmt: skip
    write_text_atomic(out / "report.md", md)
    for name, plot in [("tau", lambda f: offline.plot_report(table, per_drafter, f)),
                       *extra["_plots"]]:  # fmt: skip
        with atomic_path(out / f"{name}.png") as tmp:
            plot(tmp)  # writes nothing (and returns False) without matplotlib
    p.log("\n" + md)
    return {"macro": {k: v["macro"] for k, v in table["tau"].items()}}


def eval_datasets(p) -> tuple[dict, dict]:
    """(the evaluated datasets {name: offline.EvalDataset}, their coverage {name: prompts
    evaluated / available / too long / the length limit}): every dataset's prompts that fit the
    target's context with `evaluate.max_new_tokens`, `evaluate.max_prompts_per_dataset` of them
    in the fixed selection order."""
    e = p.cfg.evaluate
    datasets, coverage = {}, {}
    for name, (dom, turns) in p.eval_sets().items():
        kept, too_long, limit = p.fitting_prompts(turns, e.max_new_tokens)
        sel = tuple(select_prompts(kept, e.max_prompts_per_dataset))
        coverage[name] = {
            "domain": dom, "prompts": len(sel), "available": len(turns),
            "too_long": too_long, "max_prompt_tokens": limit,
        }  # fmt: skip
        if too_long:
            p.log(
                f"  {name}: {too_long} of {len(turns)} prompts longer than {limit} tokens "
                "(the target's context minus the generation budget) are not evaluated"
            )
        if not sel:
            p.log(f"  {name}: no prompt fits in {limit} tokens; dataset not evaluated")
            continue
        datasets[name] = offline.EvalDataset(name, dom, sel)
    if not datasets:
        raise ConfigError(
            f"no evaluation prompt fits in the target's context minus "
            f"evaluate.max_new_tokens={e.max_new_tokens} — lower evaluate.max_new_tokens or "
            "use shorter prompts"
        )
    return datasets, coverage


def eval_decoder(p, kind: str, longest: int):
    """The evaluation's decoder for drafter `kind` (prompts up to `longest` tokens)."""
    e = p.cfg.evaluate
    return p.rundir.decoder_for(
        kind, [longest], e.max_new_tokens, e.max_len, lean=True, modes=eval_modes(e)
    )


def eval_modes(e) -> tuple[str, ...]:
    """The one sampling mode the evaluation decoders compile: with any temperature above 0 the
    temperature-only mode, in which a T = 0 request runs as a greedy row (the same tokens as in
    the argmax mode), so the τ tables at every temperature share one set of programs."""
    return ("sampled",) if max((e.temperature, *e.temperatures)) > 0 else ("greedy",)


def _other_temperatures(p, decoders, datasets, domains, stop) -> dict:
    """The τ table at each of `evaluate.temperatures` other than `evaluate.temperature`."""
    e = p.cfg.evaluate
    out = {}
    for t in e.temperatures:
        if float(t) == float(e.temperature):
            continue
        per = {}
        for kind, dec in decoders.items():
            per[kind] = {}
            for name, ds in datasets.items():
                res = offline.run_dataset(
                    dec, ds, max_new_tokens=e.max_new_tokens, temperature=float(t),
                    seed=e.seed, stop_ids=stop, batch_size=e.batch_size,
                )  # fmt: skip
                per[kind][name] = offline.summarize(res, dec.dcfg.block_size)
        out[f"{float(t):g}"] = offline.tau_table(per, domains)
        p.log(f"  T={float(t):g}: macro τ " + ", ".join(
            f"{k} {v['macro']:.3f}" for k, v in out[f"{float(t):g}"]["tau"].items()))  # fmt: skip
    return out


def _speed_breakdown(p, prompt, table) -> dict:
    """The round's breakdown per drafter next to a plain decode step (eval/speed.py)."""
    e = p.cfg.evaluate
    tcfg, tparams = p.target()
    drafters = {k: p.drafter(k) for k in p.cfg.drafters.kinds}
    p.log("  speed: timing the round's components (compiled, interleaved, medians)")
    bd = evspeed.round_breakdown(
        tcfg, tparams, drafters, prompt, temperature=e.temperature, reps=e.speed_reps,
        resident_rounds=e.speed_rounds_per_call, mesh=p.rundir.mesh,
    )  # fmt: skip
    return evspeed.add_ideal(bd, {k: v["macro"] for k, v in table["tau"].items()})


def _analyses(p, all_results, datasets, domains, breakdown, table) -> dict:
    """Bootstrap intervals, θ sweep, reliability, policies (eval/analyses.py); with the
    markdown lines (`_markdown`) and the PNG writers (`_plots`)."""
    kinds = p.cfg.drafters.kinds
    res = {k: {n: all_results[(k, n)] for n in datasets} for k in kinds}
    boot = analyses.bootstrap_tau(res, domains)
    out: dict = {"bootstrap": boot, "_markdown": [], "_plots": []}
    out["_markdown"] += analyses.markdown_bootstrap(boot, table)
    if "dspark" not in kinds:
        return out
    sts = p.rundir.sts("dspark")
    temps = None if sts is None else sts.temperatures
    pooled = [r for n in datasets for r in res["dspark"][n]]
    sweep = analyses.threshold_sweep(res["dspark"])
    rel = analyses.reliability_bins(pooled, temperatures=temps)
    cost = p.rundir.cost_profile()
    if cost is None and breakdown:
        # affine fit of the measured verify forward vs tokens (batch 1) as the cost model
        t = np.asarray([float(k) for k in breakdown["verify_forward_ms"]])
        y = np.asarray(list(breakdown["verify_forward_ms"].values())) / 1e3
        beta, alpha = np.polyfit(t, y, 1)
        cost = CostProfile.from_step_time(max(alpha, 1e-6), max(beta, 1e-9))
    pol = analyses.policy_replay(pooled, temperatures=temps, cost=cost)
    out.update(threshold_sweep=sweep, reliability=rel, policies=pol)
    out["_markdown"] += (analyses.markdown_threshold(sweep) + analyses.markdown_reliability(rel)
                         + analyses.markdown_policies(pol))  # fmt: skip
    out["_plots"] += [
        ("analyses", lambda f: analyses.plot_analyses(sweep, pol, f)),
        ("reliability", lambda f: analyses.plot_reliability(rel, f)),
    ]
    return out


def _calibration_report(p, all_results, datasets):
    sts = STS.load(p.stage_dir("calibrate") / "sts.json")
    g = p.drafter("dspark")[0].block_size
    parts = [calibration_pairs(all_results[("dspark", name)], g) for name in datasets]
    rho = np.concatenate([part[0] for part in parts])
    a = np.concatenate([part[1] for part in parts])
    n = np.concatenate([part[2] for part in parts])
    if rho.shape[0] == 0:
        return None
    raw = reliability_from_logits(rho, a, n)
    cal = reliability_from_logits(rho, a, n, temperatures=sts.temperatures)
    rows = []
    for k in range(g):
        rows.append({
            "count": raw.count[k], "ece_raw": raw.ece[k], "ece_sts": cal.ece[k],
            "auroc": raw.auroc[k], "brier_raw": raw.brier[k], "brier_sts": cal.brier[k],
        })  # fmt: skip
    return {
        "temperatures": list(map(float, sts.temperatures)),
        "ece_raw": raw.ece_summary, "ece_sts": cal.ece_summary,
        "auroc": raw.auroc_summary, "per_position": rows,
    }  # fmt: skip


def _temperature_lines(by_temp: dict) -> list[str]:
    lines = []
    for t, tab in by_temp.items():
        lines += ["", f"## τ at temperature {t} (same prompts, fixed block)", ""]
        lines.append("| drafter | " + " | ".join(next(iter(tab["tau"].values()))["domains"])
                     + " | macro |")  # fmt: skip
        lines.append("|---" * (len(next(iter(tab["tau"].values()))["domains"]) + 2) + "|")
        for d, row in tab["tau"].items():
            cells = [f"{v:.3f}" for v in row["domains"].values()]
            lines.append(f"| {d} | " + " | ".join(cells) + f" | **{row['macro']:.3f}** |")
    return lines
