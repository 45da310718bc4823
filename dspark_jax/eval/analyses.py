"""The paper's analyses from the evaluation's own per-round records (cheap: no extra decoding).

Every function takes the fixed-γ rounds the evaluate stage already decoded (`RequestOutput`s or
the engine's `RequestOutput`s: `num_accepted`, `proposed`, `eos`, `conf_logits` per round) and
returns plain dicts (JSON); `markdown_*` render them as tables, `plot_*` as PNGs.

* `bootstrap_tau`: per-dataset / per-domain / macro 95% intervals of τ, requests resampled
  within each dataset (1000 draws), and paired intervals of the relative gains between drafters
  (the same resampled prompts for both, since every drafter decoded the same prompts).
* `threshold_sweep` (paper Fig. 5): the static threshold θ on the raw confidence c_k = σ(ρ_k)
  (docs/METHOD.md §6.4). Replayed on the fixed-γ rounds: a round truncated to n ≤ γ drafts accepts
  min(A, n) of them (chain verification accepts draft k from the same draws whatever follows),
  so τ and the verify rate τ / (n + 1) per θ are exact per round; only later rounds' contexts
  differ from a live run.
* `reliability_bins` (Fig. 6): cumulative survival Π σ(ρ_i/τ_i) vs the observed prefix acceptance
  1[A ≥ k], 20 bins, raw and after STS.
* `policy_replay`: τ and verified tokens per round under each scheduling policy at batch sizes R:
  requests grouped R at a time walk their rounds in lockstep; each policy chooses lengths from
  the STS-calibrated confidences (the async one from the round two earlier); accepted = min(A, n).
  With a cost profile the projected throughput Θ = Σ(accepted + 1) · SPS(tokens) is reported
  relative to fixed γ.
"""

from __future__ import annotations

import math

import numpy as np

from dspark_jax.sched.policies import make_policy
from dspark_jax.spec.metrics import acceptance_stats, cumulative_survival, ece, prefix_labels

THETAS = tuple(round(0.1 * i, 1) for i in range(10))


def _rounds(results) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(A [N], n [N], eos [N], request id [N], conf logits [N, γ] or [N, 0])."""
    a, n, e, ids, conf = [], [], [], [], []
    for i, r in enumerate(results):
        a += list(r.num_accepted)
        n += list(r.proposed)
        e += list(r.eos)
        ids += [i] * len(r.num_accepted)
        conf += list(r.conf_logits)
    c = np.asarray(conf, np.float64) if conf and len(conf) == len(a) else np.zeros((len(a), 0))
    return (np.asarray(a, np.int64), np.asarray(n, np.int64), np.asarray(e, bool),
            np.asarray(ids, np.int64), c)  # fmt: skip


# ---- bootstrap intervals -------------------------------------------------------------------


def _per_request(results) -> tuple[np.ndarray, np.ndarray]:
    tok = np.asarray([sum(x + 1 - int(y) for x, y in zip(r.num_accepted, r.eos)) for r in results])
    rounds = np.asarray([len(r.num_accepted) for r in results])
    return tok.astype(np.float64), rounds.astype(np.float64)


def bootstrap_tau(
    results: dict[str, dict[str, list]],
    domains: dict[str, str],
    *,
    draws: int = 1000,
    seed: int = 0,
) -> dict:
    """`results[drafter][dataset]` lists of per-request records → 95% percentile intervals of
    pooled τ per dataset, domain (mean of its datasets) and macro (mean of datasets), plus paired
    intervals of the relative macro gains."""
    rng = np.random.default_rng(seed)
    drafters = list(results)
    datasets = list(next(iter(results.values())))
    boots: dict[str, dict[str, np.ndarray]] = {d: {} for d in drafters}
    for ds in datasets:
        per = {d: _per_request(results[d][ds]) for d in drafters}
        # requests that ended at the prefill (no round) carry no τ: resample the others
        live = np.nonzero(np.all([per[d][1] > 0 for d in drafters], axis=0))[0]
        idx = live[rng.integers(0, max(live.size, 1), size=(draws, live.size))]  # paired
        for d in drafters:
            tok, rounds = per[d]
            boots[d][ds] = tok[idx].sum(1) / np.maximum(rounds[idx].sum(1), 1.0)

    def ci(x):
        lo, hi = np.percentile(x, [2.5, 97.5])
        return [float(lo), float(hi)]

    out: dict = {"draws": draws, "tau": {}, "relative_macro_gain": {}}
    macro = {}
    for d in drafters:
        by_dom: dict[str, list] = {}
        for ds in datasets:
            by_dom.setdefault(domains[ds], []).append(boots[d][ds])
        macro[d] = np.mean([boots[d][ds] for ds in datasets], axis=0)
        out["tau"][d] = {
            "datasets": {ds: ci(boots[d][ds]) for ds in datasets},
            "domains": {k: ci(np.mean(v, axis=0)) for k, v in by_dom.items()},
            "macro": ci(macro[d]),
        }
    for x in drafters:
        for y in drafters:
            if x != y:
                out["relative_macro_gain"][f"{x}_vs_{y}"] = ci(macro[x] / macro[y] - 1.0)
    return out


def markdown_bootstrap(boot: dict, table: dict) -> list[str]:
    lines = ["", f"## τ with bootstrap 95% intervals ({boot['draws']} resamples of requests)", ""]
    drafters = list(boot["tau"])
    doms = list(next(iter(boot["tau"].values()))["domains"])
    lines.append("| drafter | " + " | ".join(doms) + " | macro |")
    lines.append("|---" * (len(doms) + 2) + "|")
    for d in drafters:
        b, t = boot["tau"][d], table["tau"][d]
        cells = [f"{t['domains'][k]:.2f} [{b['domains'][k][0]:.2f}, {b['domains'][k][1]:.2f}]"
                 for k in doms]  # fmt: skip
        m = b["macro"]
        lines.append(
            f"| {d} | " + " | ".join(cells) + f" | {t['macro']:.2f} [{m[0]:.2f}, {m[1]:.2f}] |"
        )
    lines.append("")
    gains = ", ".join(
        f"{k} [{v[0] * 100:+.1f}%, {v[1] * 100:+.1f}%]"
        for k, v in boot["relative_macro_gain"].items()
        if k.startswith("dspark_vs_")
    )
    if gains:
        lines.append(f"Paired 95% intervals of the macro gains: {gains}")
    return lines


# ---- static threshold sweep (Fig. 5) --------------------------------------------------------


def threshold_sweep(results_by_dataset: dict[str, list], thetas=THETAS) -> dict:
    """Per dataset and pooled: τ and verify rate when each round verifies the leading drafts whose
    raw confidence σ(ρ_k) ≥ θ (docs/METHOD.md §6.4), replayed on the fixed-γ rounds."""
    out: dict = {"thetas": list(thetas), "datasets": {}}
    pooled = {"a": [], "n": [], "e": [], "c": []}
    for ds, res in results_by_dataset.items():
        a, n, e, _, conf = _rounds(res)
        if conf.shape[1] == 0 or a.size == 0:
            continue
        pooled["a"].append(a)
        pooled["n"].append(n)
        pooled["e"].append(e)
        pooled["c"].append(conf)
        out["datasets"][ds] = _sweep(a, n, e, conf, thetas)
    if pooled["a"]:
        cat = [np.concatenate(pooled[k]) for k in ("a", "n", "e", "c")]
        out["pooled"] = _sweep(*cat, thetas)
    return out


def _sweep(a, n, e, conf, thetas) -> dict:
    c = 1.0 / (1.0 + np.exp(-conf))
    rows = {"tau": [], "verify_rate": [], "drafts_verified": []}
    g = conf.shape[1]
    for th in thetas:
        keep = (c >= th) & (np.arange(g)[None, :] < n[:, None])
        nn = np.cumprod(keep, axis=1).sum(1)
        aa = np.minimum(a, nn)
        ee = e & (a <= nn)  # an accepted stop draft still ends the round if it is verified
        st = acceptance_stats(aa, nn, eos=ee, gamma=g)
        rows["tau"].append(st.tau)
        rows["verify_rate"].append(st.verify_rate)
        rows["drafts_verified"].append(float(nn.mean()))
    return rows


def markdown_threshold(sweep: dict) -> list[str]:
    if "pooled" not in sweep:
        return []
    lines = ["", "## Static threshold sweep on raw confidence (Fig. 5; replayed, DSpark)", ""]
    names = ["pooled", *sweep["datasets"]]
    lines.append("| θ | " + " | ".join(f"{k} τ / verify rate" for k in names) + " |")
    lines.append("|---" * (len(names) + 1) + "|")
    for i, th in enumerate(sweep["thetas"]):
        cells = []
        for k in names:
            r = sweep["pooled"] if k == "pooled" else sweep["datasets"][k]
            cells.append(f"{r['tau'][i]:.2f} / {r['verify_rate'][i] * 100:.1f}%")
        lines.append(f"| {th:.1f} | " + " | ".join(cells) + " |")
    return lines


# ---- reliability (Fig. 6) -------------------------------------------------------------------


def reliability_bins(results: list, temperatures=None, n_bins: int = 20) -> dict:
    """Per position k: (mean predicted survival, observed prefix acceptance, count) per bin, raw
    and with the STS temperatures; ECE of each."""
    a, n, _, _, conf = _rounds(results)
    keep = n >= 1
    a, n, conf = a[keep], n[keep], conf[keep]
    g = conf.shape[1]
    if g == 0 or a.size == 0:
        return {}
    labels, valid = prefix_labels(a, n, g)
    out: dict = {"bins": n_bins, "positions": []}
    for name, temps in (("raw", None), ("sts", temperatures)):
        if name == "sts" and temps is None:
            continue
        pred = cumulative_survival(conf, temps)
        for k in range(g):
            m = valid[:, k]
            p, y = pred[m, k], labels[m, k]
            b = np.minimum((p * n_bins).astype(np.int64), n_bins - 1)
            cnt = np.bincount(b, minlength=n_bins)
            mp = np.bincount(b, weights=p, minlength=n_bins) / np.maximum(cnt, 1)
            my = np.bincount(b, weights=y, minlength=n_bins) / np.maximum(cnt, 1)
            if len(out["positions"]) <= k:
                out["positions"].append({"k": k + 1, "count": int(m.sum())})
            out["positions"][k][name] = {
                "ece": ece(p, y, n_bins) if p.size else float("nan"),
                "pred": mp.tolist(), "observed": my.tolist(), "count": cnt.tolist(),
            }  # fmt: skip
    return out


def plot_reliability(rel: dict, path) -> bool:
    plt = pyplot()
    if plt is None or not rel:
        return False
    pos = [p for p in rel["positions"] if p["k"] in (1, 3, 5, 7)] or rel["positions"][:4]
    fig, axes = plt.subplots(1, len(pos), figsize=(3.2 * len(pos), 3.3), squeeze=False)
    for ax, p in zip(axes[0], pos):
        ax.plot([0, 1], [0, 1], "k:", lw=1)
        for name, style in (("raw", "o-"), ("sts", "s-")):
            if name not in p:
                continue
            cnt = np.asarray(p[name]["count"])
            m = cnt > 0
            x = np.asarray(p[name]["pred"])[m]
            y = np.asarray(p[name]["observed"])[m]
            ax.plot(x, y, style, ms=3, label=f"{name} ECE {p[name]['ece'] * 100:.1f}%")
        ax.set_title(f"position {p['k']} (n={p['count']})")
        ax.set_xlabel("predicted survival")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("observed prefix acceptance")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def markdown_reliability(rel: dict) -> list[str]:
    if not rel:
        return []
    lines = ["", "## Reliability of the cumulative survival (Fig. 6; DSpark)", ""]
    lines.append("| position | rounds | ECE raw | ECE STS |")
    lines.append("|---|---|---|---|")
    for p in rel["positions"]:
        sts = p.get("sts", {}).get("ece", float("nan"))
        lines.append(
            f"| {p['k']} | {p['count']} | {p['raw']['ece'] * 100:.2f}% | {sts * 100:.2f}% |"
        )
    return lines


# ---- scheduling policies at a few batch sizes ------------------------------------------------


def policy_replay(
    results: list,
    *,
    temperatures=None,
    cost=None,
    batch_sizes=(1, 4, 8),
    thetas=(0.5,),
    seed: int = 0,
) -> dict:
    """τ per request-round, verified drafts per request-round, target tokens per round and (with
    a `CostProfile`) projected throughput relative to fixed γ, per policy and batch size."""
    per_req = []
    for r in results:
        if r.conf_logits and len(r.conf_logits) == len(r.num_accepted):
            per_req.append((np.asarray(r.num_accepted), np.asarray(r.proposed),
                            np.asarray(r.eos, bool), np.asarray(r.conf_logits, np.float64)))  # fmt: skip
    if not per_req:
        return {}
    g = per_req[0][3].shape[1]
    temps = np.ones(g) if temperatures is None else np.asarray(temperatures, np.float64)[:g]
    policies = {"fixed": make_policy("fixed", gamma=g)}
    for th in thetas:
        policies[f"threshold_{th:g}"] = make_policy("threshold", theta=th)
    if cost is not None:
        policies["dspark_alg1"] = make_policy("dspark", cost=cost)
        policies["async_topk"] = make_policy("async", cost=cost)
    rng = np.random.default_rng(seed)
    # the same groups of requests for every policy
    orders = {bs: rng.permutation(len(per_req)) for bs in batch_sizes}
    out: dict = {"batch_sizes": list(batch_sizes), "policies": {}}
    for name, pol in policies.items():
        out["policies"][name] = {}
        for bs in batch_sizes:
            order = orders[bs]
            tot = {"tokens": 0.0, "req_rounds": 0, "drafts": 0.0, "rounds": 0, "theta": 0.0}
            for lo in range(0, len(order), bs):
                group = [per_req[i] for i in order[lo : lo + bs]]
                _replay_group(group, pol, temps, cost, bs, tot)
            rr = max(tot["req_rounds"], 1)
            row = {
                "tau": tot["tokens"] / rr,
                "drafts_verified_per_request": tot["drafts"] / rr,
                "target_tokens_per_round": (tot["drafts"] + tot["req_rounds"]) / max(tot["rounds"], 1),
            }  # fmt: skip
            if cost is not None:
                row["throughput_model"] = tot["theta"] / max(tot["rounds"], 1)
            out["policies"][name][bs] = row
    if cost is not None:
        for name in out["policies"]:
            for bs in batch_sizes:
                base = out["policies"]["fixed"][bs]["throughput_model"]
                row = out["policies"][name][bs]
                row["throughput_vs_fixed"] = row["throughput_model"] / base if base else math.nan
    return out


def _replay_group(group, pol, temps, cost, bs, tot) -> None:
    longest = max(len(a) for a, *_ in group)
    hist: list[np.ndarray] = []
    for t in range(longest):
        live = [i for i, (a, *_) in enumerate(group) if t < len(a)]
        conf = np.zeros((bs, temps.size))
        cap = np.zeros(bs, np.int64)
        for i in live:
            conf[i] = 1.0 / (1.0 + np.exp(-group[i][3][t] / temps))
            cap[i] = group[i][1][t]
        stale = hist[-2] if len(hist) >= 2 else None
        lengths = np.asarray(pol(conf, max_len=cap, stale_conf=stale)).reshape(bs)
        hist.append(conf)
        tokens = 0.0
        for i in live:
            a, _, e, _ = group[i]
            nn = int(lengths[i])
            tokens += min(int(a[t]), nn) + 1 - int(e[t] and a[t] <= nn)
            tot["drafts"] += nn
        tot["tokens"] += tokens
        tot["req_rounds"] += len(live)
        tot["rounds"] += 1
        if cost is not None:
            charged = len(live) + int(sum(lengths[i] for i in live))
            tot["theta"] += tokens * float(cost.sps(np.asarray([charged]))[0])


def markdown_policies(rep: dict) -> list[str]:
    if not rep:
        return []
    lines = ["", "## Scheduling policies (replayed on the DSpark rounds, STS confidences)", ""]
    has_cost = "throughput_vs_fixed" in next(iter(rep["policies"]["fixed"].values()))
    head = "| policy | batch | τ | drafts verified / request | target tokens / round |"
    lines.append(head + (" projected throughput vs fixed |" if has_cost else ""))
    lines.append("|---|---|---|---|---|" + ("---|" if has_cost else ""))
    for name, rows in rep["policies"].items():
        for bs, r in rows.items():
            cells = [name, str(bs), f"{r['tau']:.2f}", f"{r['drafts_verified_per_request']:.2f}",
                     f"{r['target_tokens_per_round']:.1f}"]  # fmt: skip
            if has_cost:
                cells.append(f"{r['throughput_vs_fixed']:.2f}×")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot_analyses(sweep: dict, policies: dict, path) -> bool:
    """θ sweep (τ and verify rate) and τ / target tokens per round per policy."""
    plt = pyplot()
    if plt is None or "pooled" not in sweep:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    th = sweep["thetas"]
    for k, r in [("pooled", sweep["pooled"]), *sweep["datasets"].items()]:
        ax1.plot(th, r["tau"], "o-", label=f"{k} τ", lw=2 if k == "pooled" else 1)
    ax1.set_xlabel("θ (raw confidence threshold)")
    ax1.set_ylabel("τ (tokens per round)")
    axr = ax1.twinx()
    axr.plot(th, np.asarray(sweep["pooled"]["verify_rate"]) * 100, "k--", label="verify rate")
    axr.set_ylabel("verify rate (%)")
    ax1.legend(fontsize=7, loc="lower left")
    ax1.set_title("Static threshold sweep (Fig. 5)")
    if policies:
        for name, rows in policies["policies"].items():
            bs = list(rows)
            ax2.plot([rows[b]["target_tokens_per_round"] / b for b in bs],
                     [rows[b]["tau"] for b in bs], "o-", label=name)  # fmt: skip
        ax2.set_xlabel("target tokens per request-round")
        ax2.set_ylabel("τ")
        ax2.set_title("Policies (points: batch sizes)")
        ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def pyplot():
    """`matplotlib.pyplot` drawing to files (the Agg backend), or None without matplotlib."""
    try:
        # heavy: 0.5 s to import with jax loaded (python -X importtime); only the figures need it
        import matplotlib

        matplotlib.use("Agg")  # chosen when a figure is drawn, not when this module is imported
        import matplotlib.pyplot as plt  # after the backend is chosen (the line above)
    except ImportError:
        return None
    return plt
