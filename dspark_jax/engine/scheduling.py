"""Verification-length policies as the engine runs them (host, numpy), with boundary checks.

The engine calls `Scheduler.lengths(raw_conf [R, γ], caps [R])` once per round. Confidences are
STS-calibrated here (`sched.sts.STS`) before any policy sees them. The asynchronous top-K policy
keeps its own history: the capacity for the next round is computed from the calibrated
confidences of the round before the current one (`prepare_next`, called while the device runs
the current round), so only the top-K selection on fresh confidences sits on the critical path.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dspark_jax.compat import check_gamma, check_sts
from dspark_jax.errors import ConfigError, PolicyError
from dspark_jax.sched.cost import CostProfile
from dspark_jax.sched.policies import (
    AsyncTopK,
    CausalGreedy,
    FixedGamma,
    StaticThreshold,
    top_k_lengths,
)
from dspark_jax.sched.sts import STS

POLICY_NAMES = ("mtp1", "fixed", "threshold", "alg1", "async")


def engine_profile(cost: CostProfile | None, token_buckets: tuple[int, ...]) -> CostProfile:
    """The profile with the engine's packed-token buckets (what a round actually pays)."""
    if cost is None:
        raise ConfigError(
            "policy 'alg1'/'async' needs cost_profile= (a CostProfile measured by "
            "benchmarks/decode_cost.py on this engine's packed path)"
        )
    if cost.layout != "tokens":
        raise ConfigError(
            f"cost_profile layout is {cost.layout!r} but the engine verifies packed tokens; "
            "re-measure with benchmarks/decode_cost.py (layout 'tokens')"
        )
    if tuple(cost.token_buckets) != tuple(token_buckets):
        cost = dataclasses.replace(cost, token_buckets=tuple(token_buckets))
    return cost


def _ranked(conf: np.ndarray, caps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`sched.policies._ranked` for one round [R, γ], in fewer numpy calls: survivals
    (slots past the cap zeroed) flattened slot-major (j * R + r), sorted descending, stable."""
    g = conf.shape[1]
    c = np.where(np.arange(g)[None, :] < caps[:, None], np.clip(conf, 0.0, 1.0), 0.0)
    flat = np.cumprod(c, axis=1).T.reshape(-1)
    order = np.argsort(-flat, kind="stable")
    return flat[order], order


def _positive(a_sorted: np.ndarray) -> int:
    return int(np.count_nonzero(a_sorted > 0))


def _admit(order: np.ndarray, count: int, num_req: int) -> np.ndarray:
    """Per-request lengths [R] admitting the first `count` ranked candidates."""
    return np.bincount(order[:count] % num_req, minlength=num_req).astype(np.int32)


class Scheduler:
    def __init__(
        self,
        policy,
        gamma: int,
        *,
        policy_gamma: int | None,
        threshold: float,
        cost: CostProfile | None,
        sts: STS | None,
        token_buckets: tuple[int, ...],
        has_confidence: bool,
    ):
        self.gamma = gamma
        self.has_confidence = has_confidence
        check_sts(sts, gamma)
        self.sts = sts if sts is not None else STS.identity(gamma)
        if isinstance(policy, str):
            if policy not in POLICY_NAMES:
                raise ConfigError(f"unknown policy {policy!r}; choose one of {POLICY_NAMES}")
            if policy in ("threshold", "alg1", "async") and not has_confidence:
                raise ConfigError(
                    f"policy {policy!r} schedules on confidences but this drafter has no "
                    "confidence head; use policy='fixed' or 'mtp1' (or a DSpark drafter)"
                )
            if policy == "mtp1":
                policy = FixedGamma(1)
            elif policy == "fixed":
                g = gamma if policy_gamma is None else int(policy_gamma)
                policy = FixedGamma(g)
            elif policy == "threshold":
                policy = StaticThreshold(float(threshold))
            elif policy == "alg1":
                # Algorithm 1's early stop cannot see past a bucket cliff (one more draft
                # crossing into the next bucket looks like a loss even when the drafts that
                # would fill that bucket pay for it), so it walks the interpolated (unbucketed)
                # curve; the bucket's padding is then filled with the next-ranked drafts.
                prof = engine_profile(cost, token_buckets)
                policy = CausalGreedy(dataclasses.replace(prof, token_buckets=()))
            else:
                policy = AsyncTopK(engine_profile(cost, token_buckets))
        if isinstance(policy, FixedGamma):
            check_gamma(policy.gamma, gamma, "gamma (fixed policy)")
        if isinstance(policy, AsyncTopK):
            check_gamma(policy.cold_start_gamma, gamma, "cold_start_gamma (async policy)")
        self.policy = policy
        self.is_async = isinstance(policy, AsyncTopK)
        # Algorithm 1 / top-K admit the K best-ranked drafts; the packed round pads R + K to a
        # token bucket anyway, so the next-ranked drafts fill the padding for free.
        self.fill_bucket = isinstance(policy, (AsyncTopK, CausalGreedy))
        self.token_buckets = tuple(token_buckets)
        self._history: list[np.ndarray] = []  # calibrated conf of recent rounds (async)
        self._next_capacity: int | None = None
        # Algorithm 1 runs on the host between the read-back and the next dispatch, so its time
        # is round time: one ranking per round and the SPS curve tabulated per token count
        # (the general policy path took ~0.8 ms a round, a quarter of a micro-model round)
        self._sps = None
        if (
            isinstance(policy, CausalGreedy)
            and self.token_buckets
            and policy.cost.layout == "tokens"
        ):
            self._sps = policy.cost.sps_for(0, np.arange(self.token_buckets[-1] + 1), 0)

    def calibrate(self, raw_conf: np.ndarray) -> np.ndarray:
        return self.sts.probs(raw_conf)

    def lengths(self, raw_conf: np.ndarray, caps: np.ndarray) -> np.ndarray:
        """Lengths [R] for this round, checked: integers in 0..min(γ, cap)."""
        r = raw_conf.shape[0]
        conf = self.calibrate(raw_conf)
        if self._sps is not None and r + r * self.gamma < self._sps.shape[0]:
            out = self._alg1(conf, np.asarray(caps))
        elif self.is_async:
            k = self._next_capacity
            if k is None:
                k = r * self.policy.cold_start_gamma
            a_sorted, order = _ranked(conf, np.asarray(caps))
            out = _admit(order, self._filled(r, min(int(k), _positive(a_sorted)), a_sorted), r)
            self._history = (self._history + [conf])[-2:]
        else:
            out = self.policy(conf, max_len=caps)
        out = np.asarray(out)
        if self.fill_bucket and self._sps is None and not self.is_async:
            out = self._fill(conf, out, caps)
        if out.shape != (r,) or out.dtype.kind not in "iu":
            raise PolicyError(
                f"policy returned lengths of shape {out.shape} dtype {out.dtype}; expected ({r},) "
                "integers"
            )
        bad = (out < 0) | (out > np.minimum(caps, self.gamma))
        if bad.any():
            raise PolicyError(
                f"policy returned lengths {out[bad][:4].tolist()} outside 0..min(γ={self.gamma}, "
                "remaining tokens - 1); a length past γ would verify undrafted tokens"
            )
        return out.astype(np.int32)

    def _alg1(self, conf: np.ndarray, caps: np.ndarray) -> np.ndarray:
        """Algorithm 1 (early stop on the unbucketed curve) then the bucket fill, from one
        ranking: equal to `CausalGreedy` + `_fill` (tests/test_engine_cost.py)."""
        r = conf.shape[0]
        a_sorted, order = _ranked(conf, caps)
        tau = np.cumsum(np.concatenate([[float(r)], a_sorted]))  # left to right, as the loop
        theta = tau * self._sps[r : r + a_sorted.size + 1]
        improves = (theta[1:] > theta[:-1]) & (a_sorted > 0)
        count = int(improves.size if improves.all() else np.argmin(improves))
        return _admit(order, self._filled(r, count, a_sorted), r)

    def _filled(self, r: int, count: int, a_sorted: np.ndarray) -> int:
        """`count` admitted drafts plus the token bucket's free room (next-ranked drafts)."""
        total = r + count
        bucket = next((b for b in self.token_buckets if b >= total), total)
        if bucket > total:
            count = min(count + bucket - total, _positive(a_sorted))
        return count

    def _fill(self, conf, lengths, caps) -> np.ndarray:
        """Top-(K + padding) instead of top-K, where padding = the token bucket's free room.

        Lossless like top-K itself: whether draft (r, j) is admitted depends on its rank and on
        K, and K (Algorithm 1's early stop) only on candidates ranked before it."""
        k = int(np.sum(lengths))
        total = conf.shape[0] + k
        bucket = next((b for b in self.token_buckets if b >= total), total)
        if bucket <= total:
            return lengths
        return top_k_lengths(conf, k + bucket - total, caps)

    def prepare_next(self, num_requests: int) -> None:
        """Async: the next round's capacity from the confidences of the round before this one
        (two rounds before the next). Call while the device runs the current round."""
        if not self.is_async:
            return
        if len(self._history) >= 2:
            stale = self._history[-2]
            self._next_capacity = int(self.policy.capacity(stale, num_requests))
        else:
            self._next_capacity = None
