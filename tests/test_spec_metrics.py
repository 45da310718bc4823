"""Acceptance metrics (τ, conditional acceptance vs prefix survival) and reliability metrics."""

import numpy as np
import pytest

from dspark_jax.spec import metrics as M


def test_tau_pooled_per_request_and_verify_rate():
    a = np.array([3, 0, 7, 2, 1])
    n = np.array([7, 7, 7, 2, 3])
    eos = np.array([False, False, False, True, False])
    ids = np.array([10, 10, 11, 11, 12])
    s = M.acceptance_stats(a, n, eos=eos, request_ids=ids, gamma=7)
    emitted = np.array([4, 1, 8, 2, 2])  # the EOS round has no bonus token
    assert s.rounds == 5 and s.tokens == emitted.sum()
    assert s.tau == pytest.approx(emitted.sum() / 5)
    assert s.request_ids == (10, 11, 12)
    np.testing.assert_allclose(s.tau_per_request, [5 / 2, 10 / 2, 2 / 1])
    assert s.verify_rate == pytest.approx(emitted.sum() / np.sum(n + 1))
    assert s.draft_tokens_per_proposal == pytest.approx(n.mean())
    assert M.acceptance_stats([0], [0]).tau == 1.0  # a round verifying only the anchor


def test_conditional_acceptance_and_survival_are_different_things():
    # Rounds (A, n): truncated proposals make the two curves differ.
    a = np.array([0, 1, 1, 2, 3, 3])
    n = np.array([1, 1, 3, 3, 3, 3])
    cond = M.conditional_acceptance(a, n, gamma=3)
    surv = M.prefix_survival(a, n, gamma=3)
    # k=1: #(A>=1)=5 / #(A>=0 & n>=1)=6 ; k=2: #(A>=2)=3 / #(A>=1 & n>=2)=4 ;
    # k=3: #(A>=3)=2 / #(A>=2 & n>=3)=3
    np.testing.assert_allclose(cond, [5 / 6, 3 / 4, 2 / 3])
    # survival: #(A>=k) / #(n>=k): 5/6, 3/4, 2/4
    np.testing.assert_allclose(surv, [5 / 6, 3 / 4, 2 / 4])


def test_full_length_proposals_cond_is_survival_ratio():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 8, 1000)
    n = np.full(1000, 7)
    cond = M.conditional_acceptance(a, n)
    surv = M.prefix_survival(a, n)
    np.testing.assert_allclose(cond, surv / np.concatenate([[1.0], surv[:-1]]))
    assert np.isnan(M.conditional_acceptance([0], [0], gamma=2)).all()


def test_records_are_checked():
    with pytest.raises(ValueError, match="num_accepted <= proposal_len"):
        M.acceptance_stats([3], [2])
    with pytest.raises(ValueError, match="differ"):
        M.prefix_survival([1, 2], [3])


def test_ece_matches_definition():
    rng = np.random.default_rng(1)
    p = rng.uniform(0, 1, 5000)
    y = (rng.uniform(0, 1, 5000) < p**1.5).astype(float)
    bins = np.minimum((p * 20).astype(int), 19)
    want = sum(
        (bins == b).mean() * abs(p[bins == b].mean() - y[bins == b].mean())
        for b in range(20)
        if np.any(bins == b)
    )
    assert M.ece(p, y) == pytest.approx(want, abs=1e-12)
    assert M.ece(np.array([1.0, 1.0]), np.array([1.0, 1.0])) == pytest.approx(1e-8)  # clipped
    assert np.isnan(M.ece([], []))


def test_auroc_histogram_definition():
    rng = np.random.default_rng(2)
    p = rng.uniform(0, 1, 400)
    y = rng.uniform(0, 1, 400) < p
    b = np.minimum((p * 1000).astype(int), 999)
    pos, neg = b[y], b[~y]
    pairs = (pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])
    assert M.auroc(p, y) == pytest.approx(pairs.mean())
    assert M.auroc([0.9, 0.8, 0.1], [1, 1, 0]) == 1.0
    assert M.auroc([0.1, 0.8, 0.9], [1, 1, 0]) == 0.0
    assert M.auroc([0.5, 0.5], [1, 0]) == 0.5  # same bin counts 1/2
    assert np.isnan(M.auroc([0.5, 0.6], [1, 1]))


def test_brier():
    assert M.brier([0.2, 0.9], [0, 1]) == pytest.approx((0.04 + 0.01) / 2)


def test_reliability_from_logits_uses_cumulative_survival_and_prefix_labels():
    rho = np.array([[2.0, 0.0, -1.0], [1.0, 1.0, 1.0], [0.0, 3.0, 3.0]])
    a = np.array([2, 0, 3])
    n = np.array([3, 1, 3])
    r = M.reliability_from_logits(rho, a, n)
    assert r.count == (3, 2, 2)
    sig = 1 / (1 + np.exp(-rho))
    pred = np.cumprod(sig, axis=1)
    np.testing.assert_allclose(M.cumulative_survival(rho), pred)
    labels, valid = M.prefix_labels(a, n, 3)
    np.testing.assert_array_equal(labels, [[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    np.testing.assert_array_equal(valid, [[1, 1, 1], [1, 0, 0], [1, 1, 1]])
    want_brier_1 = np.mean((pred[:, 0] - labels[:, 0]) ** 2)
    assert r.brier[0] == pytest.approx(want_brier_1)
    assert r.brier_summary == pytest.approx(np.average(r.brier, weights=r.count))
    halved = M.reliability_from_logits(rho, a, n, temperatures=[2.0, 2.0, 2.0])
    np.testing.assert_allclose(
        M.cumulative_survival(rho, [2.0, 2.0, 2.0]), M.cumulative_survival(rho / 2)
    )
    assert halved.count == r.count


def test_cumulative_survival_is_stable_for_long_products():
    rho = np.full((1, 200), -30.0)
    s = M.cumulative_survival(rho)
    assert np.all(np.isfinite(s)) and s[0, -1] == 0.0 and s[0, 0] > 0
