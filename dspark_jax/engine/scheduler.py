"""Verification-length policies as the engine runs them (host, numpy), with boundary checks.

The engine calls `Scheduler.lengths(raw_conf [R, γ], caps [R])` once per round. Confidences are
STS-calibrated here (`sched.sts.STS`) before any policy sees them. The policies are the public
`sched.policies` classes, with a cost profile carrying this engine's token buckets
(`engine_profile`): Algorithm 1 and the asynchronous top-K fill the bucket a round is padded to
with the next-ranked drafts, inside the policy, so `CausalGreedy(profile)(conf, max_len=caps)`
gives the engine's lengths. The asynchronous top-K policy keeps its own history: the capacity
for the next round is computed from the calibrated confidences of the round before the current
one (`prepare_next`, called while the device runs the current round), so only the top-K
selection on fresh confidences sits on the critical path.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dspark_jax.compat import check_gamma, check_sts
from dspark_jax.errors import ConfigError, PolicyError
from dspark_jax.sched.cost import CostProfile
from dspark_jax.sched.policies import AsyncTopK, CausalGreedy, FixedGamma, StaticThreshold
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
                policy = CausalGreedy(engine_profile(cost, token_buckets))
            else:
                policy = AsyncTopK(engine_profile(cost, token_buckets))
        elif isinstance(policy, CausalGreedy | AsyncTopK):  # charged what this engine runs
            policy = dataclasses.replace(policy, cost=engine_profile(policy.cost, token_buckets))
        if isinstance(policy, FixedGamma):
            check_gamma(policy.gamma, gamma, "gamma (fixed policy)")
        if isinstance(policy, AsyncTopK):
            check_gamma(policy.cold_start_gamma, gamma, "cold_start_gamma (async policy)")
        self.policy = policy
        self.is_async = isinstance(policy, AsyncTopK)
        self.token_buckets = tuple(token_buckets)
        self._history: list[np.ndarray] = []  # calibrated conf of recent rounds (async)
        self._next_capacity: int | None = None

    def calibrate(self, raw_conf: np.ndarray) -> np.ndarray:
        return self.sts.probs(raw_conf)

    def lengths(self, raw_conf: np.ndarray, caps: np.ndarray) -> np.ndarray:
        """Lengths [R] for this round, checked: integers in 0..min(γ, cap)."""
        r = raw_conf.shape[0]
        conf = self.calibrate(raw_conf)
        caps = np.asarray(caps)
        if self.is_async:
            k = self._next_capacity
            if k is None:
                k = r * self.policy.cold_start_gamma
            out = self.policy.admit(conf, k, caps)
            self._history = (self._history + [conf])[-2:]
        else:
            out = self.policy(conf, max_len=caps)
        out = np.asarray(out)
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
