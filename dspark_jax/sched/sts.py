"""Sequential Temperature Scaling (STS): per-position temperatures for confidence logits.

docs/METHOD.md §7.1. Calibrated confidence ``c~_k = sigmoid(rho_k / tau_k)``, one ``tau_k > 0`` per
position ``k = 1..gamma``. Fitting goes left to right on held-out rounds decoded without
truncation: with ``tau_1..tau_{k-1}`` frozen, ``tau_k`` is the grid value minimising the ECE
(20 bins, docs/METHOD.md §6.5) of the cumulative product ``prod_{i<=k} c~_i`` against the label
``y_k = 1[A >= k]`` over rounds whose proposal covers position ``k``. Ties go to the grid value
closest to 1; a position with no data keeps ``tau = 1``.

Dividing by a positive temperature is monotone, so the ranking of confidences at every position is
unchanged (AUROC of a single position is unchanged). Apply it to the raw logits before any
threshold or scheduler: ``conf = sts.probs(conf_logits)``.

Storage: ``{"confidence_temperatures": [tau_1, ..., tau_gamma]}`` - :meth:`STS.to_dict` is meant to
be merged into a drafter checkpoint's JSON config; :meth:`STS.save` / :meth:`STS.load` write and
read it as a standalone file (e.g. ``<checkpoint>/sts.json``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from dspark_jax.io import write_json_atomic

__all__ = ["STS", "fit_sts", "default_grid"]

_CLIP = 1e-8


def default_grid() -> np.ndarray:
    """400 log-spaced temperatures in [0.1, 10], plus exactly 1."""
    return np.unique(np.concatenate([np.geomspace(0.1, 10.0, 400), [1.0]]))


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


@dataclasses.dataclass(frozen=True)
class STS:
    """Fitted per-position temperatures (frozen, hashable). ``temperatures[k-1]`` is ``tau_k``."""

    temperatures: tuple[float, ...]

    def __post_init__(self):
        t = tuple(float(x) for x in self.temperatures)
        if not all(np.isfinite(x) and x > 0 for x in t):
            raise ValueError(f"temperatures must be finite and > 0, got {t}")
        object.__setattr__(self, "temperatures", t)

    @classmethod
    def identity(cls, gamma: int) -> STS:
        return cls((1.0,) * gamma)

    def _scale(self, gamma: int) -> np.ndarray:
        if gamma > len(self.temperatures):
            raise ValueError(
                f"confidences have {gamma} positions but STS was fitted for "
                f"{len(self.temperatures)}; refit with the drafter's block size"
            )
        return np.asarray(self.temperatures[:gamma], np.float32)

    def apply(self, conf_logits):
        """``rho / tau`` over the last axis ``[..., gamma]``; numpy or jax arrays (type kept)."""
        return conf_logits / self._scale(conf_logits.shape[-1]).astype(conf_logits.dtype)

    def probs(self, conf_logits) -> np.ndarray:
        """Calibrated per-position confidences ``sigmoid(rho / tau)`` as float64 numpy."""
        rho = np.asarray(conf_logits, np.float64)
        return np.exp(_log_sigmoid(rho / self._scale(rho.shape[-1]).astype(np.float64)))

    def to_dict(self) -> dict:
        return {"confidence_temperatures": list(self.temperatures)}

    @classmethod
    def from_dict(cls, d: dict) -> STS:
        if "confidence_temperatures" not in d:
            raise ValueError('expected a "confidence_temperatures" list (from STS.to_dict)')
        return cls(tuple(d["confidence_temperatures"]))

    def save(self, path: str | os.PathLike) -> None:
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> STS:
        # a pathlib-like object (`storage.as_path` of a bucket URL) is read through its own API
        p = path if hasattr(path, "read_text") else Path(path)
        return cls.from_dict(json.loads(p.read_text()))


def _ece_rows(pred_GxN: np.ndarray, y_N: np.ndarray, n_bins: int) -> np.ndarray:
    """ECE of every row of ``pred [G, N]`` against the same labels ``y [N]`` -> ``[G]``."""
    g, n = pred_GxN.shape
    p = np.clip(pred_GxN, _CLIP, 1.0 - _CLIP)
    bins = np.minimum((p * n_bins).astype(np.int64), n_bins - 1)
    flat = (bins + n_bins * np.arange(g)[:, None]).reshape(-1)
    gap = np.bincount(flat, weights=(p - y_N[None, :]).reshape(-1), minlength=g * n_bins)
    return np.abs(gap.reshape(g, n_bins)).sum(axis=1) / n


def fit_sts(
    conf_logits,
    num_accepted,
    proposal_len,
    *,
    grid=None,
    n_bins: int = 20,
    chunk: int = 64,
) -> STS:
    """Fit STS on held-out rounds.

    Args:
      conf_logits: ``[N, gamma]`` raw confidence logits ``rho`` of each round's slots.
      num_accepted, proposal_len: ``[N]`` ``A`` and ``n`` of each round (decoded with no
        truncation, so ``n`` is normally ``gamma``).
      grid: candidate temperatures (default :func:`default_grid`).
      n_bins: ECE bins (20 as in docs/METHOD.md §6.5).
      chunk: grid values evaluated at once (memory ``chunk x N`` floats).
    """
    rho = np.asarray(conf_logits, np.float64)
    a = np.asarray(num_accepted, np.int64).reshape(-1)
    n = np.asarray(proposal_len, np.int64).reshape(-1)
    if rho.ndim != 2 or rho.shape[0] != a.size or a.shape != n.shape:
        raise ValueError(
            f"need conf_logits [N, gamma] and num_accepted, proposal_len [N]; got "
            f"{rho.shape}, {a.shape}, {n.shape}"
        )
    grid = default_grid() if grid is None else np.asarray(grid, np.float64)
    if grid.ndim != 1 or grid.size == 0 or np.any(grid <= 0):
        raise ValueError("grid must be a non-empty 1-D array of positive temperatures")
    # Prefer the value closest to 1 among equal-ECE grid points (argmin takes the first).
    grid = grid[np.argsort(np.abs(np.log(grid)), kind="stable")]
    gamma = rho.shape[1]
    temps = []
    log_prefix = np.zeros(a.size)  # log prod_{i<k} c~_i with the frozen temperatures
    for k in range(gamma):
        valid = n >= k + 1
        if not np.any(valid):
            temps.append(1.0)
            continue
        y = (a[valid] >= k + 1).astype(np.float64)
        base, rk = log_prefix[valid], rho[valid, k]
        eces = []
        for start in range(0, grid.size, chunk):
            t = grid[start : start + chunk, None]
            eces.append(_ece_rows(np.exp(base[None, :] + _log_sigmoid(rk[None, :] / t)), y, n_bins))
        best = float(grid[int(np.argmin(np.concatenate(eces)))])
        temps.append(best)
        log_prefix = log_prefix + _log_sigmoid(rho[:, k] / best)
    return STS(tuple(temps))
