"""CostProfile: steps per second SPS(B) of one verification forward of ``B`` tokens.

The scheduler maximises ``expected tokens per round x SPS(tokens the engine will pay for)``, so
the profile must charge what the engine actually runs: with static shapes the engine pads a round
to a bucket, and the padded size is what costs time.

Table and interpolation
    ``tokens`` (strictly increasing) and ``steps_per_s`` are measured points. Between points the
    *step time* ``1 / SPS`` is interpolated linearly (a latency model ``alpha + beta * B`` is then
    reproduced exactly); beyond the last point it is extrapolated with the last segment's slope
    (clamped to >= 0); below the first point it is the first point's.

Layouts (what is charged for ``R`` requests with verification lengths ``l_r``)
    ``"tokens"`` (ragged / flattened verification): ``R + sum_r l_r`` tokens (anchor + drafts per
    request), rounded up to the next of ``token_buckets`` if any are given.
    ``"padded"`` (a ``[R_b, L_b + 1]`` verification block, the layout of ``spec.verify``):
    ``R_b * (L_b + 1)`` tokens, with ``R_b`` = ``R`` rounded up to ``batch_buckets`` and ``L_b`` =
    ``max_r l_r`` rounded up to ``length_buckets`` (each unbucketed if its tuple is empty).
    A size beyond the largest bucket cannot run: its SPS is 0, so no policy ever schedules it.

JSON format (written by ``benchmarks/decode_cost.py`` and by :meth:`CostProfile.save`)::

    {"cost_profile": {
        "tokens":        [1, 2, 4, 8, 16, 32, 64],           # verification tokens per forward
        "steps_per_s":   [95.1, 94.8, 93.0, 90.2, 84.7, 70.3, 52.9],
        "layout":        "tokens",                            # or "padded"
        "token_buckets": [8, 16, 32, 64],                     # optional, default []
        "batch_buckets": [],                                  # optional ("padded" only)
        "length_buckets": [],                                 # optional ("padded" only)
        "measurements": [                                     # optional raw rows
            {"batch": 4, "tokens_per_request": 2, "steps_per_s": 94.0}, ...],
        "meta": {"target": "...", "device": "...", ...}}}     # optional; what it was measured
                                                              # for (compat.check_cost_profile)

Either ``tokens`` + ``steps_per_s`` or ``measurements`` must be present; raw ``measurements``
(``batch`` requests x ``tokens_per_request``) are folded into the 1-D table by total tokens
``batch * tokens_per_request``, averaging step times of equal totals. Any other key is an error.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path

import numpy as np

from dspark_jax.buckets import bucket_up_array
from dspark_jax.io import write_text_atomic

__all__ = ["CostProfile", "LAYOUTS"]

LAYOUTS = ("tokens", "padded")
_KEYS = {
    "tokens",
    "steps_per_s",
    "layout",
    "token_buckets",
    "batch_buckets",
    "length_buckets",
    "measurements",
    "meta",
}


def _check_buckets(name: str, buckets: tuple[int, ...], minimum: int) -> None:
    if any(b < minimum for b in buckets) or any(a >= b for a, b in zip(buckets, buckets[1:])):
        raise ValueError(f"{name} must be strictly increasing integers >= {minimum}: {buckets}")


@dataclasses.dataclass(frozen=True)
class CostProfile:
    """Measured SPS table plus the engine's bucketing (frozen, hashable; see module docstring).

    Attributes:
      tokens: verification tokens per forward at each measured point (strictly increasing, >= 1).
      steps_per_s: forward steps per second at those points (> 0).
      layout: ``"tokens"`` or ``"padded"`` - how a schedule is turned into charged tokens.
      token_buckets: ``"tokens"`` layout: totals the engine pads to.
      batch_buckets, length_buckets: ``"padded"`` layout: request counts and draft lengths the
        engine pads to.
    """

    tokens: tuple[int, ...]
    steps_per_s: tuple[float, ...]
    layout: str = "tokens"
    token_buckets: tuple[int, ...] = ()
    batch_buckets: tuple[int, ...] = ()
    length_buckets: tuple[int, ...] = ()
    target: str = ""
    device: str = ""

    def __post_init__(self):
        for name in ("tokens", "steps_per_s", "token_buckets", "batch_buckets", "length_buckets"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "steps_per_s", tuple(float(s) for s in self.steps_per_s))
        if len(self.tokens) == 0 or len(self.tokens) != len(self.steps_per_s):
            raise ValueError(
                f"tokens ({len(self.tokens)}) and steps_per_s ({len(self.steps_per_s)}) must be "
                "non-empty and of equal length"
            )
        if self.tokens[0] < 1 or any(a >= b for a, b in zip(self.tokens, self.tokens[1:])):
            raise ValueError(f"tokens must be strictly increasing and >= 1: {self.tokens}")
        if not all(np.isfinite(s) and s > 0 for s in self.steps_per_s):
            raise ValueError(f"steps_per_s must be finite and > 0: {self.steps_per_s}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        _check_buckets("token_buckets", self.token_buckets, 1)
        _check_buckets("batch_buckets", self.batch_buckets, 1)
        _check_buckets("length_buckets", self.length_buckets, 0)
        if self.layout == "tokens" and (self.batch_buckets or self.length_buckets):
            raise ValueError('batch_buckets/length_buckets only apply to layout="padded"')
        if self.layout == "padded" and self.token_buckets:
            raise ValueError('token_buckets only apply to layout="tokens"')

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_step_time(cls, alpha: float, beta: float, max_tokens: int = 4096, **kw):
        """Affine latency model: a step of ``B`` tokens takes ``alpha + beta * B`` seconds."""
        tokens = (1, max_tokens)
        return cls(tokens, tuple(1.0 / (alpha + beta * t) for t in tokens), **kw)

    @classmethod
    def from_measurements(cls, batch, tokens_per_request, steps_per_s, **kw):
        """Fold 2-D measurements into the 1-D table by total tokens (mean step time per total)."""
        total = np.asarray(batch, np.int64) * np.asarray(tokens_per_request, np.int64)
        step_time = 1.0 / np.asarray(steps_per_s, np.float64)
        uniq, inverse = np.unique(total, return_inverse=True)
        mean_time = np.bincount(inverse, weights=step_time) / np.bincount(inverse)
        return cls(tuple(uniq.tolist()), tuple((1.0 / mean_time).tolist()), **kw)

    @classmethod
    def from_dict(cls, d: dict) -> CostProfile:
        """Parse the JSON format of the module docstring (the outer ``cost_profile`` key optional)."""
        d = d.get("cost_profile", d)
        unknown = set(d) - _KEYS
        if unknown:
            raise ValueError(f"unknown cost_profile keys {sorted(unknown)}; valid: {sorted(_KEYS)}")
        kw = {
            k: d[k]
            for k in ("layout", "token_buckets", "batch_buckets", "length_buckets")
            if k in d
        }
        meta = d.get("meta") or {}
        kw.update({k: str(meta[k]) for k in ("target", "device") if meta.get(k)})
        if "tokens" in d or "steps_per_s" in d:
            return cls(tuple(d["tokens"]), tuple(d["steps_per_s"]), **kw)
        if "measurements" not in d:
            raise ValueError('cost_profile needs "tokens" + "steps_per_s" or "measurements"')
        rows = d["measurements"]
        return cls.from_measurements(
            [r["batch"] for r in rows],
            [r["tokens_per_request"] for r in rows],
            [r["steps_per_s"] for r in rows],
            **kw,
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostProfile:
        # a pathlib-like object (`storage.as_path` of a bucket URL) is read through its own API
        p = path if hasattr(path, "read_text") else Path(path)
        return cls.from_dict(json.loads(p.read_text()))

    def to_dict(self) -> dict:
        record = {"target": self.target, "device": self.device}
        return {
            "cost_profile": {
                "tokens": list(self.tokens),
                "steps_per_s": list(self.steps_per_s),
                "layout": self.layout,
                "token_buckets": list(self.token_buckets),
                "batch_buckets": list(self.batch_buckets),
                "length_buckets": list(self.length_buckets),
                **({"meta": record} if self.target or self.device else {}),
            }
        }

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def save(self, path: str | os.PathLike) -> None:
        """Write the JSON (atomically: a temp file renamed into place)."""
        write_text_atomic(path, self.to_json(indent=1))

    # ---- evaluation ---------------------------------------------------------------------------

    @functools.cached_property
    def _table(self) -> tuple[np.ndarray, np.ndarray, float]:
        t = np.asarray(self.tokens, np.float64)
        step = 1.0 / np.asarray(self.steps_per_s, np.float64)
        slope = max((step[-1] - step[-2]) / (t[-1] - t[-2]), 0.0) if t.size > 1 else 0.0
        return t, step, slope

    def step_time(self, tokens) -> np.ndarray:
        """Seconds per forward of ``tokens`` (unbucketed) tokens; array in, array out."""
        t, step, slope = self._table
        x = np.asarray(tokens, np.float64)
        inside = np.interp(x, t, step)
        return np.where(x > t[-1], step[-1] + slope * (x - t[-1]), inside)

    def sps(self, tokens) -> np.ndarray:
        """SPS at ``tokens`` charged tokens (already bucketed); 0 for ``tokens <= 0``."""
        x = np.asarray(tokens, np.float64)
        return np.where(x > 0, 1.0 / self.step_time(np.maximum(x, 1.0)), 0.0)

    def charged_tokens(self, num_requests, num_drafts, max_length) -> np.ndarray:
        """Tokens the engine pays for (0 = cannot run) given ``R``, ``sum_r l_r`` and ``max_r l_r``.

        Arrays broadcast; only the layout's relevant arguments are read.
        """
        r = np.asarray(num_requests, np.int64)
        if self.layout == "tokens":
            return np.maximum(
                bucket_up_array(r + np.asarray(num_drafts, np.int64), self.token_buckets), 0
            )
        rb = bucket_up_array(r, self.batch_buckets)
        lb = bucket_up_array(np.asarray(max_length, np.int64), self.length_buckets)
        return np.where((rb < 0) | (lb < 0), 0, rb * (lb + 1))

    def sps_for(self, num_requests, num_drafts, max_length) -> np.ndarray:
        """``SPS(charged_tokens(...))``: the rate the engine will actually run at."""
        return self.sps(self.charged_tokens(num_requests, num_drafts, max_length))
