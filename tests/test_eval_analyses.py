"""The report's analyses on synthetic per-round records: the replays reduce to the measured
numbers where they must (θ = 0, fixed γ), bootstrap intervals cover the estimate, STS-style
temperatures lower the reliability ECE, and the tables/PNGs render."""

from __future__ import annotations

import numpy as np

from dspark_jax.engine import RequestOutput, SpecStats
from dspark_jax.eval import analyses
from dspark_jax.eval.offline import summarize
from dspark_jax.sched.cost import CostProfile

G = 7


def _records(n_req=24, rounds=12, seed=0, sharp=1.0):
    """Rounds whose acceptance follows the confidences σ(ρ_k / sharp) (so sharp = the true STS
    temperature)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_req):
        r = RequestOutput("r", 0, [], "length", SpecStats(), [], [], [], [])
        for _ in range(rounds):
            rho = rng.normal(1.5, 1.5, G)
            c = 1 / (1 + np.exp(-rho / sharp))
            acc = rng.uniform(size=G) < c
            a = int(np.cumprod(acc).sum())
            r.num_accepted.append(a)
            r.proposed.append(G)
            r.eos.append(False)
            r.conf_logits.append(rho)
            r.tokens.extend([1] * (a + 1))
        out.append(r)
    return out


def test_threshold_zero_and_fixed_policy_reproduce_the_measured_tau(tmp_path):
    res = {"a": _records(seed=1), "b": _records(seed=2)}
    want = summarize(res["a"] + res["b"], G)["tau"]
    sw = analyses.threshold_sweep(res)
    assert np.isclose(sw["pooled"]["tau"][0], want)
    assert np.isclose(sw["pooled"]["verify_rate"][0], want / (G + 1))
    taus = sw["pooled"]["tau"]
    assert taus[-1] < taus[0] and sw["pooled"]["verify_rate"][-1] > sw["pooled"]["verify_rate"][0]
    cost = CostProfile.from_step_time(1.0, 0.2)
    pol = analyses.policy_replay(res["a"] + res["b"], cost=cost, batch_sizes=(1, 4))
    for bs in (1, 4):
        assert np.isclose(pol["policies"]["fixed"][bs]["tau"], want)
        assert np.isclose(pol["policies"]["fixed"][bs]["target_tokens_per_round"], bs * (G + 1))
        assert pol["policies"]["dspark_alg1"][bs]["throughput_vs_fixed"] >= 0.99
    md = analyses.markdown_threshold(sw) + analyses.markdown_policies(pol)
    assert any("0.9" in line for line in md) and any("dspark_alg1" in line for line in md)
    assert analyses.plot_analyses(sw, pol, tmp_path / "a.png")


def test_bootstrap_intervals_cover_the_estimate_and_are_paired():
    res = {"dspark": {"x": _records(seed=3)}, "eagle3": {"x": _records(seed=3)}}
    boot = analyses.bootstrap_tau(res, {"x": "code"}, draws=200)
    tau = summarize(res["dspark"]["x"], G)["tau"]
    lo, hi = boot["tau"]["dspark"]["macro"]
    assert lo <= tau <= hi and hi - lo > 0.01
    # identical records: the paired gain interval is exactly zero
    assert boot["relative_macro_gain"]["dspark_vs_eagle3"] == [0.0, 0.0]
    table = {"tau": {k: {"domains": {"code": tau}, "macro": tau} for k in res}}
    assert "dspark_vs_eagle3" in "\n".join(analyses.markdown_bootstrap(boot, table))


def test_reliability_after_the_true_temperature_is_better(tmp_path):
    recs = _records(n_req=40, seed=4, sharp=2.0)
    rel = analyses.reliability_bins(recs, temperatures=[2.0] * G)
    raw = np.mean([p["raw"]["ece"] for p in rel["positions"]])
    sts = np.mean([p["sts"]["ece"] for p in rel["positions"]])
    assert sts < raw
    assert analyses.plot_reliability(rel, tmp_path / "r.png")
    assert len(analyses.markdown_reliability(rel)) == 5 + G
