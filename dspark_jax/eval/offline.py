"""Offline evaluation (docs/METHOD.md §6): τ tables, acceptance per slot, calibration data, speed.

Chain speculative decoding with a fixed block (scheduler off, paper Table 1 setting), temperature
1.0 by default, each prompt with its own fixed seed (`seed + index`). For every drafter and
dataset: τ pooled over rounds and per request (mean ± std), conditional acceptance per position
and prefix survival (named apart), verify rate; then domain means, the macro average and the
relative gains between drafters. Results are plain dicts (JSON) plus markdown tables and a PNG.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from dspark_jax.engine import RequestOutput, ServingEngine
from dspark_jax.eval.analyses import pyplot
from dspark_jax.spec.metrics import acceptance_stats


@dataclasses.dataclass(frozen=True)
class EvalDataset:
    name: str
    domain: str
    prompts: tuple[tuple[int, ...], ...]  # token ids of the formatted prompts


def run_dataset(
    decoder: ServingEngine,
    ds: EvalDataset,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: int = 980406,
    stop_ids: Sequence[int] = (),
    batch_size: int = 8,
    progress=None,
) -> list[RequestOutput]:
    """Decode every prompt of `ds`; prompt i uses seed `seed + i` whatever slot it lands in.

    Every prompt of a chunk is queued at once (continuous batching over the engine's slots);
    chunks of `8 * batch_size` prompts only pace the progress bar."""
    out: list[RequestOutput] = []
    prompts = [list(p) for p in ds.prompts]
    for lo in range(0, len(prompts), 8 * batch_size):
        chunk = prompts[lo : lo + 8 * batch_size]
        out.extend(
            decoder.generate(
                chunk,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                seeds=[seed + lo + j for j in range(len(chunk))],
                stop_ids=stop_ids,
            )  # fmt: skip
        )
        if progress is not None:
            progress.update(len(chunk))
    return out


def summarize(results: list[RequestOutput], gamma: int) -> dict:
    """τ (pooled, per-request mean ± std), curves and verify rate of a list of requests."""
    a, n, e, ids = [], [], [], []
    for i, r in enumerate(results):
        a += r.num_accepted
        n += r.proposed
        e += r.eos
        ids += [i] * len(r.num_accepted)
    if not a:
        return {"rounds": 0, "tau": float("nan")}
    st = acceptance_stats(a, n, eos=e, request_ids=ids, gamma=gamma)
    per = np.asarray(st.tau_per_request)
    return {
        "rounds": st.rounds,
        "tokens": st.tokens,
        "tau": st.tau,
        "tau_request_mean": float(per.mean()),
        "tau_request_std": float(per.std()),
        "verify_rate": st.verify_rate,
        "draft_tokens_per_proposal": st.draft_tokens_per_proposal,
        "conditional_acceptance": [_f(x) for x in st.conditional_acceptance],
        "prefix_survival": [_f(x) for x in st.prefix_survival],
    }


def _f(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def calibration_pairs(results: list[RequestOutput], gamma: int):
    """(conf_logits [N, γ], A [N], n [N]) of the rounds with n ≥ 1 (docs/METHOD.md §6.5 inputs)."""
    rho, a, n = [], [], []
    for r in results:
        for c, ai, ni in zip(r.conf_logits, r.num_accepted, r.proposed):
            if ni >= 1:
                rho.append(c)
                a.append(ai)
                n.append(ni)
    if not rho:
        return np.zeros((0, gamma)), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.asarray(rho, np.float64), np.asarray(a, np.int64), np.asarray(n, np.int64)


def tau_table(per_drafter: dict[str, dict[str, dict]], domains: dict[str, str]) -> dict:
    """Add domain means, the macro average and relative gains. `per_drafter[d][dataset]` are
    `summarize` outputs; `domains[dataset]` names each dataset's domain."""
    table = {}
    for d, per_ds in per_drafter.items():
        taus = {k: v["tau"] for k, v in per_ds.items()}
        by_dom: dict[str, list[float]] = {}
        for ds, t in taus.items():
            by_dom.setdefault(domains[ds], []).append(t)
        table[d] = {
            "datasets": taus,
            "domains": {k: float(np.mean(v)) for k, v in by_dom.items()},
            "macro": float(np.mean(list(taus.values()))),
        }
    gains = {}
    names = list(table)
    for x in names:
        for y in names:
            if x != y:
                gains[f"{x}_vs_{y}"] = table[x]["macro"] / table[y]["macro"] - 1.0
    return {"tau": table, "relative_macro_gain": gains}


def markdown_report(
    table: dict,
    per_drafter: dict,
    speed: dict | None,
    calib: dict | None,
    coverage: dict | None = None,
) -> str:
    """The report as markdown. `coverage[dataset]` = {"prompts", "available", "too_long",
    "max_prompt_tokens"}: how many prompts were evaluated and how many did not fit the context."""
    lines = ["# dspark-jax evaluation", ""]
    drafter_names = list(table["tau"])
    datasets = list(next(iter(table["tau"].values()))["datasets"])
    lines.append("## τ (accepted tokens per round incl. bonus, fixed block, pooled)")
    lines.append("")
    lines.append("| drafter | " + " | ".join(datasets) + " | macro |")
    lines.append("|---" * (len(datasets) + 2) + "|")
    for d in drafter_names:
        row = table["tau"][d]
        cells = [f"{row['datasets'][k]:.3f}" for k in datasets]
        lines.append(f"| {d} | " + " | ".join(cells) + f" | **{row['macro']:.3f}** |")
    lines.append("")
    lines.append("Per request (mean ± std):")
    lines.append("")
    for d in drafter_names:
        parts = [
            f"{k} {v['tau_request_mean']:.2f}±{v['tau_request_std']:.2f}"
            for k, v in per_drafter[d].items()
        ]
        lines.append(f"- {d}: " + ", ".join(parts))
    lines.append("")
    lines.append(
        "Relative macro gains: "
        + ", ".join(f"{k} {v * 100:+.1f}%" for k, v in table["relative_macro_gain"].items())
    )
    lines.append("")
    lines.append("## Conditional acceptance per position (Fig. 2 style; pooled over datasets)")
    lines.append("")
    for d in drafter_names:
        curve = _pooled_curve(per_drafter[d], "conditional_acceptance")
        lines.append(f"- {d}: " + " ".join("—" if c is None else f"{c:.3f}" for c in curve))
    if coverage:
        lines += coverage_lines(coverage)
    if calib:
        lines += ["", "## Confidence calibration (DSpark, held-out)", ""]
        lines.append("| position | ECE raw | ECE STS | AUROC | Brier raw | Brier STS |")
        lines.append("|---|---|---|---|---|---|")
        for k, row in enumerate(calib.get("per_position", [])):
            lines.append(
                f"| {k + 1} | {row['ece_raw']:.4f} | {row['ece_sts']:.4f} | {row['auroc']:.3f} | "
                f"{row['brier_raw']:.4f} | {row['brier_sts']:.4f} |"
            )
    if speed:
        lines += ["", "## Wall clock at batch 1 (same engine)", ""]
        for k, v in speed.items():
            lines.append(f"- {k}: {v}")
    return "\n".join(lines) + "\n"


def coverage_lines(coverage: dict) -> list[str]:
    """Markdown rows: prompts evaluated per dataset and those too long for the context."""
    lines = ["", "## Prompts evaluated", ""]
    lines.append("| dataset | evaluated | available | too long | max prompt tokens |")
    lines.append("|---|---|---|---|---|")
    for k, v in coverage.items():
        note = " (nothing fits: not evaluated)" if v["prompts"] == 0 else ""
        lines.append(
            f"| {k}{note} | {v['prompts']} | {v['available']} | {v['too_long']} | "
            f"{v['max_prompt_tokens']} |"
        )
    return lines


def _pooled_curve(per_ds: dict, key: str) -> list:
    curves = [v[key] for v in per_ds.values() if v.get(key)]
    if not curves:
        return []
    out = []
    for k in range(len(curves[0])):
        vals = [c[k] for c in curves if c[k] is not None]
        out.append(float(np.mean(vals)) if vals else None)
    return out


def plot_report(table: dict, per_drafter: dict, path) -> bool:
    """τ bars per dataset and conditional-acceptance curves; False if matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    drafter_names = list(table["tau"])
    datasets = list(next(iter(table["tau"].values()))["datasets"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    w = 0.8 / max(len(drafter_names), 1)
    x = np.arange(len(datasets) + 1)
    for i, d in enumerate(drafter_names):
        vals = [table["tau"][d]["datasets"][k] for k in datasets] + [table["tau"][d]["macro"]]
        ax1.bar(x + i * w, vals, w, label=d)
    ax1.set_xticks(x + w * (len(drafter_names) - 1) / 2, datasets + ["macro"])
    ax1.set_ylabel("τ (tokens per round)")
    ax1.set_title("Acceptance length, fixed block")
    ax1.legend()
    for d in drafter_names:
        curve = _pooled_curve(per_drafter[d], "conditional_acceptance")
        ax2.plot(
            range(1, len(curve) + 1), [np.nan if c is None else c for c in curve], "o-", label=d
        )
    ax2.set_xlabel("draft position k")
    ax2.set_ylabel("conditional acceptance")
    ax2.set_title("P(accept k | accepted k-1)")
    ax2.set_ylim(0, 1)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
