"""Per-request sampling knobs, checked on the host without jax.

`check_sampling_knobs` holds every request and every configuration to the same ranges; it is
numpy only, so a configuration is checked before jax loads (`run/validate.py`).
`spec.sampling.validate_sampling_params` is the same check, then puts the rows on the device.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

MIN_TEMPERATURE = 1e-4


class SamplingParams(NamedTuple):
    """Per-request sampling knobs; every field is a ``[B]`` array (a pytree, never static).

    Build it with `spec.sampling.validate_sampling_params`, which checks the values.
    """

    temperature: Any  # [B] float32 >= 0; 0 = greedy row (point mass on the argmax)
    top_k: Any  # [B] int32 >= 0; 0 = off
    top_p: Any  # [B] float32 in (0, 1]; 1 = off
    min_p: Any  # [B] float32 in [0, 1]; 0 = off


def check_sampling_knobs(
    temperature, top_k=0, top_p=1.0, min_p=0.0, *, batch_size: int | None = None
) -> SamplingParams:
    """The knobs as ``[B]`` numpy rows, or ``ValueError`` naming the offending rows and the
    valid range (see `spec.sampling.validate_sampling_params` for the ranges)."""
    if batch_size is None:
        sizes = {np.asarray(v).shape[0] for v in (temperature, top_k, top_p, min_p) if np.ndim(v)}
        if len(sizes) > 1:
            raise ValueError(f"sampling parameter arrays disagree on the batch size: {sizes}")
        batch_size = sizes.pop() if sizes else 1
    t = _as_rows("temperature", temperature, batch_size, np.float64)
    k_raw = _as_rows("top_k", top_k, batch_size, np.float64)
    p = _as_rows("top_p", top_p, batch_size, np.float64)
    m = _as_rows("min_p", min_p, batch_size, np.float64)
    bad_t = ~np.isfinite(t) | (t < 0) | ((t > 0) & (t < MIN_TEMPERATURE))
    if np.any(bad_t):
        raise ValueError(
            f"temperature must be 0 (greedy) or a finite value >= {MIN_TEMPERATURE} (smaller ones "
            f"overflow the scaled logits); {_bad_rows(bad_t, t, np.ndim(temperature) == 0)}"
        )
    bad_k = ~np.isfinite(k_raw) | (k_raw < 0) | (k_raw != np.round(k_raw))
    if np.any(bad_k):
        raise ValueError(
            f"top_k must be an integer >= 0 (0 = off); "
            f"{_bad_rows(bad_k, k_raw, np.ndim(top_k) == 0)}"
        )
    bad_p = ~np.isfinite(p) | (p <= 0) | (p > 1)
    if np.any(bad_p):
        raise ValueError(
            f"top_p must be in (0, 1] (1 = off; use temperature=0 for greedy, not top_p=0); "
            f"{_bad_rows(bad_p, p, np.ndim(top_p) == 0)}"
        )
    bad_m = ~np.isfinite(m) | (m < 0) | (m > 1)
    if np.any(bad_m):
        raise ValueError(
            f"min_p must be in [0, 1] (0 = off); {_bad_rows(bad_m, m, np.ndim(min_p) == 0)}"
        )
    k = np.minimum(k_raw, np.iinfo(np.int32).max).astype(np.int32)
    k = np.minimum(k_raw, np.iinfo(np.int32).max).astype(np.int32)
    return SamplingParams(np.asarray(t, np.float32), k, np.asarray(p, np.float32),
                          np.asarray(m, np.float32))  # fmt: skip


def _as_rows(name: str, value, batch_size: int | None, dtype) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim > 1:
        raise ValueError(f"{name} must be a scalar or a [B] array, got shape {arr.shape}")
    if batch_size is not None:
        if arr.ndim == 1 and arr.shape[0] != batch_size:
            raise ValueError(f"{name} has {arr.shape[0]} rows but the batch has {batch_size}")
        arr = np.broadcast_to(arr, (batch_size,))
    try:
        return arr.astype(dtype)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be numeric, got {value!r}") from e


def _bad_rows(mask: np.ndarray, values: np.ndarray, scalar: bool) -> str:
    """`got V` for a scalar knob, else the offending rows and their values."""
    if scalar:
        return f"got {values.flat[0].item()}"
    rows = np.flatnonzero(np.atleast_1d(mask))
    more = "" if rows.size <= 8 else f" (+{rows.size - 8} more)"
    return f"bad rows {rows[:8].tolist()}{more}: {values[mask][:8].tolist()}"
