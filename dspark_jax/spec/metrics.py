"""Acceptance and confidence-reliability metrics of speculative decoding (host side, numpy).

Inputs are per-round records, one entry per verification round:

* ``num_accepted`` ``[N]``: ``A``, drafts accepted in the round (``0..n``);
* ``proposal_len`` ``[N]``: ``n``, drafts verified in the round (after truncation/scheduling);
* ``eos`` ``[N]`` (optional): the round ended the request on an accepted stop token, so it
  emitted ``A`` tokens and no bonus (docs/METHOD.md §6.2 step 5); otherwise it emitted ``A + 1``.

Two different per-position curves, named apart on purpose (docs/METHOD.md §6.3):

* ``conditional_acceptance[k-1]`` (paper Fig. 2), 1-indexed position ``k``:
  ``#(A >= k) / #(A >= k-1 and n >= k)``;
* ``prefix_survival[k-1]`` (the reference code's ``accept_rate@(k-1)``):
  ``#(A >= k) / #(n >= k)``.

Reliability of confidences (docs/METHOD.md §6.5): for rounds with ``n >= 1`` and positions
``k <= n``, ``pred_k = prod_{i<=k} sigmoid(rho_i)`` (float64, clipped to ``[1e-8, 1-1e-8]``)
against ``y_k = 1[A >= k]``; ECE over 20 equal-width bins, AUROC from 1000-bin histograms with
same-bin pairs counted 1/2, Brier score; the summary over positions is count-weighted.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

__all__ = [
    "AcceptanceStats",
    "Reliability",
    "acceptance_stats",
    "conditional_acceptance",
    "prefix_survival",
    "prefix_labels",
    "cumulative_survival",
    "ece",
    "auroc",
    "brier",
    "reliability",
    "reliability_from_logits",
    "block_tau",
    "simulated_tau",
    "is_additive",
    "heldout_summary",
]

PRED_CLIP = 1e-8


def _records(num_accepted, proposal_len):
    a = np.asarray(num_accepted, np.int64).reshape(-1)
    n = np.asarray(proposal_len, np.int64).reshape(-1)
    if a.shape != n.shape:
        raise ValueError(f"num_accepted {a.shape} and proposal_len {n.shape} differ in length")
    if np.any(a < 0) or np.any(a > n):
        raise ValueError("need 0 <= num_accepted <= proposal_len in every round")
    return a, n


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.maximum(den, 1), np.nan)


def conditional_acceptance(num_accepted, proposal_len, gamma: int | None = None) -> np.ndarray:
    """``[gamma]``: ``#(A >= k) / #(A >= k-1 and n >= k)`` for ``k = 1..gamma`` (NaN if 0/0)."""
    a, n = _records(num_accepted, proposal_len)
    gamma = int(n.max(initial=0)) if gamma is None else gamma
    k = np.arange(1, gamma + 1)[:, None]  # [γ, 1]
    num = np.sum(a[None, :] >= k, axis=1)
    den = np.sum((a[None, :] >= k - 1) & (n[None, :] >= k), axis=1)
    return _ratio(num, den)


def prefix_survival(num_accepted, proposal_len, gamma: int | None = None) -> np.ndarray:
    """``[gamma]``: ``#(A >= k) / #(n >= k)`` for ``k = 1..gamma`` (NaN if 0/0)."""
    a, n = _records(num_accepted, proposal_len)
    gamma = int(n.max(initial=0)) if gamma is None else gamma
    k = np.arange(1, gamma + 1)[:, None]
    return _ratio(np.sum(a[None, :] >= k, axis=1), np.sum(n[None, :] >= k, axis=1))


@dataclasses.dataclass(frozen=True)
class AcceptanceStats:
    """Acceptance summary of a set of rounds (see the module docstring for definitions).

    ``tau`` is pooled: sum of emitted tokens (bonus included) / number of rounds.
    ``tau_per_request[i]`` is the same ratio over the rounds of request ``request_ids[i]``.
    """

    rounds: int
    tokens: int
    tau: float
    draft_tokens_per_proposal: float
    verify_rate: float
    conditional_acceptance: tuple[float, ...]
    prefix_survival: tuple[float, ...]
    request_ids: tuple[int, ...]
    tau_per_request: tuple[float, ...]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def acceptance_stats(
    num_accepted,
    proposal_len,
    *,
    eos=None,
    request_ids=None,
    gamma: int | None = None,
) -> AcceptanceStats:
    """τ (pooled and per request), verify rate and both per-position curves.

    Args:
      num_accepted, proposal_len: ``[N]`` per-round ``A`` and ``n``.
      eos: ``[N]`` bool, rounds that ended on an accepted stop token (no bonus). Default none.
      request_ids: ``[N]`` request id of each round; default: all rounds belong to request 0.
      gamma: number of positions of the curves (default: the largest ``n``).
    """
    a, n = _records(num_accepted, proposal_len)
    e = np.zeros_like(a, bool) if eos is None else np.asarray(eos, bool).reshape(-1)
    emitted = a + 1 - e.astype(np.int64)  # [N]
    ids = np.zeros_like(a) if request_ids is None else np.asarray(request_ids).reshape(-1)
    uniq, inverse = np.unique(ids, return_inverse=True)
    per_tokens = np.bincount(inverse, weights=emitted, minlength=uniq.size)
    per_rounds = np.bincount(inverse, minlength=uniq.size)
    rounds = int(a.size)
    tokens = int(emitted.sum())
    return AcceptanceStats(
        rounds=rounds,
        tokens=tokens,
        tau=tokens / rounds if rounds else float("nan"),
        draft_tokens_per_proposal=float(n.mean()) if rounds else float("nan"),
        verify_rate=tokens / float(np.sum(n + 1)) if rounds else float("nan"),
        conditional_acceptance=tuple(conditional_acceptance(a, n, gamma).tolist()),
        prefix_survival=tuple(prefix_survival(a, n, gamma).tolist()),
        request_ids=tuple(uniq.tolist()),
        tau_per_request=tuple((per_tokens / np.maximum(per_rounds, 1)).tolist()),
    )


def prefix_labels(num_accepted, proposal_len, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """``(labels [N, gamma], valid [N, gamma])``: ``y_k = 1[A >= k]``, valid iff ``k <= n``."""
    a, n = _records(num_accepted, proposal_len)
    k = np.arange(1, gamma + 1)[None, :]
    return (a[:, None] >= k).astype(np.float64), n[:, None] >= k


def cumulative_survival(conf_logits, temperatures=None) -> np.ndarray:
    """``[..., gamma]`` float64 ``prod_{i<=k} sigmoid(rho_i / tau_i)`` (``tau = 1`` by default)."""
    rho = np.asarray(conf_logits, np.float64)
    if temperatures is not None:
        rho = rho / np.asarray(temperatures, np.float64)[: rho.shape[-1]]
    # log sigmoid summed is the stable way to take long products of small numbers.
    return np.exp(np.cumsum(-np.logaddexp(0.0, -rho), axis=-1))


def _clip(pred):
    return np.clip(np.asarray(pred, np.float64), PRED_CLIP, 1.0 - PRED_CLIP)


def ece(pred, labels, n_bins: int = 20) -> float:
    """Expected calibration error: bins ``floor(n_bins * p)`` (last bin closed),
    ``sum_b (n_b / n) |mean pred_b - mean y_b|``. NaN for no samples."""
    p = _clip(pred).reshape(-1)
    y = np.asarray(labels, np.float64).reshape(-1)
    if p.size == 0:
        return float("nan")
    b = np.minimum((p * n_bins).astype(np.int64), n_bins - 1)
    gap = np.bincount(b, weights=p - y, minlength=n_bins)
    return float(np.abs(gap).sum() / p.size)


def auroc(pred, labels, n_bins: int = 1000) -> float:
    """AUROC ``P(pred_pos > pred_neg)`` from ``n_bins``-bin histograms, same-bin pairs 1/2.
    NaN if there are no positives or no negatives."""
    p = _clip(pred).reshape(-1)
    y = np.asarray(labels).reshape(-1) > 0.5
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    b = np.minimum((p * n_bins).astype(np.int64), n_bins - 1)
    pos = np.bincount(b[y], minlength=n_bins).astype(np.float64)
    neg = np.bincount(b[~y], minlength=n_bins).astype(np.float64)
    neg_below = np.cumsum(neg) - neg
    return float(np.sum(pos * (neg_below + 0.5 * neg)) / (n_pos * n_neg))


def brier(pred, labels) -> float:
    """Mean squared error of the (clipped) predictions. NaN for no samples."""
    p = _clip(pred).reshape(-1)
    y = np.asarray(labels, np.float64).reshape(-1)
    return float(np.mean((p - y) ** 2)) if p.size else float("nan")


@dataclasses.dataclass(frozen=True)
class Reliability:
    """Per-position reliability (index ``k-1`` for 1-indexed position ``k``) and summaries
    (count-weighted means over positions, NaN positions skipped)."""

    count: tuple[int, ...]
    ece: tuple[float, ...]
    auroc: tuple[float, ...]
    brier: tuple[float, ...]
    ece_summary: float
    auroc_summary: float
    brier_summary: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _weighted(values, counts) -> float:
    v = np.asarray(values, np.float64)
    w = np.asarray(counts, np.float64) * np.isfinite(v)
    return float(np.sum(np.where(w > 0, v, 0.0) * w) / w.sum()) if w.sum() > 0 else float("nan")


def reliability(pred, labels, valid, *, ece_bins: int = 20, auroc_bins: int = 1000) -> Reliability:
    """Per-position ECE / AUROC / Brier of ``pred [N, gamma]`` vs ``labels [N, gamma]`` over the
    entries where ``valid [N, gamma]`` is True."""
    pred = np.asarray(pred, np.float64)
    labels = np.asarray(labels, np.float64)
    valid = np.asarray(valid, bool)
    counts, eces, aucs, briers = [], [], [], []
    for k in range(pred.shape[-1]):
        m = valid[:, k]
        counts.append(int(m.sum()))
        eces.append(ece(pred[m, k], labels[m, k], ece_bins))
        aucs.append(auroc(pred[m, k], labels[m, k], auroc_bins))
        briers.append(brier(pred[m, k], labels[m, k]))
    return Reliability(
        count=tuple(counts),
        ece=tuple(eces),
        auroc=tuple(aucs),
        brier=tuple(briers),
        ece_summary=_weighted(eces, counts),
        auroc_summary=_weighted(aucs, counts),
        brier_summary=_weighted(briers, counts),
    )


def reliability_from_logits(
    conf_logits, num_accepted, proposal_len, *, temperatures=None, **kwargs
) -> Reliability:
    """docs/METHOD.md §6.5 from per-round confidence logits ``rho [N, gamma]`` and ``(A, n)``.

    ``temperatures`` (``[gamma]``, e.g. ``STS.temperatures``) divides ``rho`` first."""
    rho = np.asarray(conf_logits, np.float64)
    labels, valid = prefix_labels(num_accepted, proposal_len, rho.shape[-1])
    pred = cumulative_survival(rho, temperatures)
    return reliability(pred, labels, valid, **kwargs)


# ------------------------------------------------------------------------------------------------
# τ of training-time (simulated) acceptance: the per-block form inside the losses (traced, jnp or
# numpy arrays) and the product of per-position means of a held-out evaluation (host)


def block_tau(accept_BxG, mask_BxG=None):
    """τ = 1 + Σ_k Π_{i≤k} a_i·mask_i per block [B] (docs/METHOD.md §4.5) from per-position
    acceptance a_i = 1 − TV_i; jnp in, jnp out (numpy in, numpy out)."""
    xp = np if isinstance(accept_BxG, np.ndarray) else jnp
    a = accept_BxG if mask_BxG is None else accept_BxG * mask_BxG
    return 1.0 + xp.cumprod(a, axis=-1).sum(-1)


def simulated_tau(accept_rate) -> float:
    """τ = 1 + Σ_k Π_{i≤k} a_i from per-position mean acceptance a_i = mean(1 − TV_i) (the
    product of means: an evaluation's `sim_tau`)."""
    return float(1.0 + np.sum(np.cumprod(np.asarray(accept_rate, np.float64))))


def is_additive(key: str) -> bool:
    """Metric keys summed over batches (`x_num`, `x_den`) rather than averaged."""
    return key.endswith("_num") or key.endswith("_den")


def heldout_summary(metric_sums: dict, n_batches: int) -> dict:
    """Held-out metrics from per-batch sums: additive pairs divided (x = x_num / x_den), other
    keys averaged over batches; adds `accept_rate` [γ] and `sim_tau` when `accept_num/den`
    exist."""
    out: dict = {}
    for k, v in metric_sums.items():
        if not is_additive(k):
            out[k] = v / max(n_batches, 1)
    for k in metric_sums:
        if k.endswith("_num") and k[:-4] + "_den" in metric_sums:
            num, den = metric_sums[k], metric_sums[k[:-4] + "_den"]
            out[k[:-4]] = np.where(den > 0, num / np.where(den > 0, den, 1), 0.0)
    if "accept" in out:
        out["accept_rate"] = out.pop("accept")
    if "accept_rate" in out and np.ndim(out["accept_rate"]) == 1:
        out["sim_tau"] = simulated_tau(out["accept_rate"])
    return out
