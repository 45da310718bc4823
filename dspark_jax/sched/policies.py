"""Prefix schedulers: per-request verification lengths from draft confidences (host, numpy).

Every policy maps confidences ``conf [R, G]`` (``c_{r,j}`` in [0, 1], the drafter's estimate that
slot ``j`` is accepted given slots ``< j`` were; calibrate with ``sched.sts`` first) to lengths
``[R]`` int32 in ``0..G``: request ``r`` verifies its first ``lengths[r]`` drafts. All functions
also accept leading batch axes ``conf [..., R, G]`` (independent scheduling problems) and an
optional cap ``max_len [..., R]`` (slots ``>= max_len`` are never admitted).

Policies (one interface, :class:`Policy`):

* :class:`FixedGamma` - every request verifies ``gamma`` drafts (MTP-1 is ``gamma=1``).
* :class:`StaticThreshold` - docs/METHOD.md §6.4: cut at the first slot whose own ``c_k < theta``.
* :class:`CausalGreedy` - paper Algorithm 1. Survivals ``a_{r,j} = prod_{i<=j} c_{r,i}``; sort all
  ``(r, j)`` with ``a > 0`` by ``a`` descending (ties: smaller ``j`` first, then smaller ``r``);
  from ``lengths = 0`` (each request verifies its anchor: ``tau* = R``) admit candidates in order
  while ``Theta = tau* x SPS(charged tokens)`` strictly improves, and **stop at the first one that
  does not** (early stop).
* :class:`AsyncTopK` - the asynchronous variant: a capacity ``K`` is chosen from the confidences of
  two rounds earlier by an unconstrained global search (``argmax_K Theta(K)``, no early stop); the
  current round admits the ``K`` largest current survivals (same order and ties).

Token buckets (a ``"tokens"`` profile with ``token_buckets``, what the serving engine runs: the
engine calls these same classes, `engine.scheduler`). A round of ``R + K`` tokens is padded to
the next bucket, so :class:`CausalGreedy` and :class:`AsyncTopK` then admit the next-ranked drafts
into the padding, which costs nothing (:func:`bucket_fill_count`). :class:`CausalGreedy` walks
the profile's *unbucketed* curve (up to the largest bucket) for its early stop: the bucketed
curve's cliffs (one more draft crossing into the next bucket looks like a loss even when the
drafts that would fill that bucket pay for it) stop it early (below). Both stay lossless: the
fill admits by rank, and its count depends only on ``K`` and ``R``. The functions
(:func:`causal_greedy_lengths`, :func:`top_k_lengths`) are the plain algorithms on the profile as
given, without the fill.

Losslessness (paper Appendix A). The admission of slot ``j`` of request ``r`` must not depend on
the value of draft ``d_{r,j}``. Confidences of later slots ``c_{r,j+1}, ...`` are computed from
``d_{r,j}``, so a policy may look only at candidates ranked before ``(r, j)``: survivals are
non-increasing along a row and ties go to the earlier slot, so every ``(r, j' > j)`` ranks after
``(r, j)`` whatever its value. Algorithm 1 with early stop decides ``(r, j)`` from the prefix of
the ranking up to ``(r, j)``; top-K admission decides it from ``(r, j)``'s rank; ``K`` comes from
older rounds. A *retrospective* global search on the current round (kept only in the tests) looks
past ``(r, j)`` and is biased. Admitted sets are prefixes of each row by the same argument.

When is the early stop optimal? (layout ``"tokens"`` without buckets.) Let ``S_K`` be the sum of
the ``K`` largest survivals and ``T = 1 / SPS`` the step time, so Algorithm 1 walks
``f(K) = (R + S_K) / T(R + K)``. ``S`` is concave (its increments are sorted descending). If ``T``
is convex, positive and non-decreasing (true for the affine latency ``alpha + beta * B`` and for any
log-concave SPS), then ``g_t(K) = R + S_K - t T(R + K)`` is concave for every ``t >= 0``, and with
``t = f(K+1)``: ``g_t(K) >= 0 = g_t(K+1)`` gives ``g_t(K+2) <= 0``, i.e. once ``f`` stops
increasing it never increases again. So the first non-improving step is the global maximum over
``K``, and because the top-``K`` set is the best prefix-closed set of ``K`` drafts, Algorithm 1
reaches the brute-force optimum over all ``lengths``. The claim is false for SPS that is merely
monotone or unimodal: a bucket cliff (``SPS(1)=1, SPS(2)=SPS(3)=0.5``, ``R=1``, ``c=(0.9, 1)``)
stops the greedy at ``lengths=0`` (``Theta=1`` vs ``0.95``) although ``lengths=2`` gives ``1.4``.
Seeing past such a cliff would require the retrospective look-ahead that breaks losslessness.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import numpy as np

from dspark_jax.buckets import bucket_up_array
from dspark_jax.sched.cost import CostProfile

__all__ = [
    "Policy",
    "FixedGamma",
    "StaticThreshold",
    "CausalGreedy",
    "AsyncTopK",
    "make_policy",
    "survival",
    "fixed_lengths",
    "threshold_lengths",
    "causal_greedy_lengths",
    "global_capacity",
    "top_k_lengths",
    "bucket_fill_count",
    "causal_greedy_reference",
]


def _conf(conf, max_len) -> np.ndarray:
    c = np.asarray(conf, np.float64)
    if c.ndim < 2:
        raise ValueError(f"conf must be [..., R, G], got shape {c.shape}")
    if max_len is not None:
        slot = np.arange(c.shape[-1])
        c = np.where(slot < np.asarray(max_len)[..., None], c, 0.0)
    return c


def survival(conf) -> np.ndarray:
    """``a_{r,j} = prod_{i<=j} c_{r,i}`` (float64, same shape); confidences clipped to [0, 1]."""
    return np.cumprod(np.clip(np.asarray(conf, np.float64), 0.0, 1.0), axis=-1)


def fixed_lengths(conf, gamma: int, max_len=None) -> np.ndarray:
    """``min(gamma, G, max_len)`` for every request; ``conf`` only gives the shape."""
    c = np.asarray(conf)
    out = np.full(c.shape[:-1], min(int(gamma), c.shape[-1]), np.int32)
    return out if max_len is None else np.minimum(out, np.asarray(max_len)).astype(np.int32)


def threshold_lengths(conf, theta: float, max_len=None) -> np.ndarray:
    """Number of leading slots whose own confidence is ``>= theta`` (docs/METHOD.md §6.4)."""
    keep = _conf(conf, max_len) >= theta
    if max_len is not None:
        keep &= np.arange(keep.shape[-1]) < np.asarray(max_len)[..., None]
    return np.sum(np.cumprod(keep, axis=-1), axis=-1).astype(np.int32)


def _ranked(conf, max_len):
    """Survivals flattened slot-major and sorted descending (stable: ties by slot, then request).

    Returns ``(a_sorted [..., N], order [..., N], R, G)`` with ``N = R * G``; flat index
    ``j * R + r``.
    """
    a = survival(_conf(conf, max_len))  # [..., R, G]
    num_req, num_slots = a.shape[-2:]
    a_flat = np.swapaxes(a, -1, -2).reshape(a.shape[:-2] + (num_slots * num_req,))
    order = np.argsort(-a_flat, axis=-1, kind="stable")
    return np.take_along_axis(a_flat, order, axis=-1), order, num_req, num_slots


def _objective(a_sorted, order, num_req, cost: CostProfile, base_requests=None) -> np.ndarray:
    """``Theta_K`` for admitting the first ``K = 0..N`` ranked candidates: ``[..., N + 1]``."""
    r = num_req if base_requests is None else np.asarray(base_requests)[..., None]
    zero = np.zeros(a_sorted.shape[:-1] + (1,))
    # Accumulate left to right from r, exactly like the sequential loop ((r + a1) + a2 ...), so
    # float rounding never makes a negligible candidate look like an improvement here but not
    # there.
    start = np.broadcast_to(np.asarray(r, np.float64), zero.shape)
    tau = np.cumsum(np.concatenate([start, a_sorted], axis=-1), axis=-1)  # [..., N+1]
    k = np.arange(a_sorted.shape[-1] + 1)
    if cost.layout == "padded":
        slot = order // max(num_req, 1) + 1  # [..., N] 1-based slot of each candidate
        longest = np.concatenate([zero.astype(np.int64), np.maximum.accumulate(slot, -1)], -1)
    else:
        longest = 0
    return tau * cost.sps_for(r, k, longest)


def _lengths_from_count(order, count, num_req, num_slots) -> np.ndarray:
    """Admit the first ``count [...]`` ranked candidates; return per-request lengths ``[..., R]``."""
    if order.ndim == 1:  # one round (the engine's case): flat index j * R + r
        return np.bincount(order[: int(count)] % num_req, minlength=num_req).astype(np.int32)
    admitted_sorted = np.arange(order.shape[-1]) < np.asarray(count)[..., None]
    admitted = np.zeros(order.shape, bool)
    np.put_along_axis(admitted, order, admitted_sorted, axis=-1)
    admitted = admitted.reshape(order.shape[:-1] + (num_slots, num_req))
    return np.sum(admitted, axis=-2).astype(np.int32)


def causal_greedy_lengths(conf, cost: CostProfile, max_len=None) -> np.ndarray:
    """Paper Algorithm 1 (causal greedy with early stop), vectorised. ``[..., R]`` int32."""
    a_sorted, order, num_req, num_slots = _ranked(conf, max_len)
    if a_sorted.shape[-1] == 0:
        return np.zeros(a_sorted.shape[:-1] + (num_req,), np.int32)
    theta = _objective(a_sorted, order, num_req, cost)
    improves = (theta[..., 1:] > theta[..., :-1]) & (a_sorted > 0)  # [..., N]
    count = np.where(improves.all(-1), improves.shape[-1], np.argmin(improves, axis=-1))
    return _lengths_from_count(order, count, num_req, num_slots)


def global_capacity(conf, cost: CostProfile, num_requests=None, max_len=None) -> np.ndarray:
    """``argmax_K Theta(K)`` over all ``K`` (no early stop; first maximum on ties). ``[...]``.

    Only lossless when ``conf`` is from an *earlier* round than the one being scheduled (the
    asynchronous variant). ``num_requests`` (default: ``R`` of ``conf``) is the base ``tau*``
    and request count of the round the capacity is for.
    """
    a_sorted, order, num_req, _ = _ranked(conf, max_len)
    theta = _objective(a_sorted, order, num_req, cost, num_requests)
    positive = np.sum(a_sorted > 0, axis=-1)  # [...]
    theta = np.where(np.arange(theta.shape[-1]) <= positive[..., None], theta, -np.inf)
    return np.argmax(theta, axis=-1).astype(np.int64)


def top_k_lengths(conf, capacity, max_len=None) -> np.ndarray:
    """Admit the ``capacity [...]`` largest survivals with ``a > 0`` (ties: earlier slot, then
    earlier request). ``[..., R]`` int32."""
    a_sorted, order, num_req, num_slots = _ranked(conf, max_len)
    count = np.minimum(np.asarray(capacity), np.sum(a_sorted > 0, axis=-1))
    return _lengths_from_count(order, count, num_req, num_slots)


def bucket_fill_count(num_requests, count, positive, token_buckets) -> np.ndarray:
    """``count [...]`` admitted drafts plus the free room of the token bucket that ``R + count``
    tokens are padded to (the next-ranked drafts, at most ``positive [...]`` candidates with
    ``a > 0`` in all). Unchanged without buckets or beyond the largest one."""
    count = np.asarray(count, np.int64)
    if not token_buckets:
        return count
    total = num_requests + count
    bucket = bucket_up_array(total, token_buckets)
    room = np.where(bucket > 0, bucket - total, 0)
    return np.minimum(count + room, np.maximum(np.asarray(positive), count))


def causal_greedy_reference(conf, cost: CostProfile) -> np.ndarray:
    """Algorithm 1 written as the paper's plain loop (``conf [R, G]``); the vectorised version is
    tested against it, and the benchmark uses it as its baseline."""
    c = np.asarray(conf, np.float64)
    num_req, num_slots = c.shape
    cands = []
    for r in range(num_req):
        a = 1.0
        for j in range(num_slots):
            a *= min(max(c[r, j], 0.0), 1.0)
            if a > 0:
                cands.append((-a, j, r))
    cands.sort()
    lengths = [0] * num_req
    tau, drafts, longest = float(num_req), 0, 0
    best = tau * float(cost.sps_for(num_req, 0, 0))
    for neg_a, j, r in cands:
        new_tau, new_longest = tau - neg_a, max(longest, j + 1)
        theta = new_tau * float(cost.sps_for(num_req, drafts + 1, new_longest))
        if not theta > best:
            break
        lengths[r], tau, drafts, longest, best = j + 1, new_tau, drafts + 1, new_longest, theta
    return np.asarray(lengths, np.int32)


class Policy(Protocol):
    """``policy(conf [R, G], *, max_len=None, stale_conf=None) -> lengths [R] int32``.

    ``stale_conf`` are the same slots' confidences from two rounds earlier (read only by
    :class:`AsyncTopK`). Leading batch axes are allowed on every array.
    """

    def __call__(self, conf, *, max_len=None, stale_conf=None) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class FixedGamma:
    """Verify ``gamma`` drafts per request (MTP-1: ``gamma=1``; plain decoding: ``gamma=0``)."""

    gamma: int

    def __post_init__(self):
        if self.gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {self.gamma}")

    def __call__(self, conf, *, max_len=None, stale_conf=None) -> np.ndarray:
        return fixed_lengths(conf, self.gamma, max_len)


@dataclasses.dataclass(frozen=True)
class StaticThreshold:
    """Truncate at the first slot whose own confidence is below ``theta`` (0 = keep all)."""

    theta: float

    def __post_init__(self):
        if not 0.0 <= self.theta <= 1.0:
            raise ValueError(f"theta must be in [0, 1], got {self.theta}")

    def __call__(self, conf, *, max_len=None, stale_conf=None) -> np.ndarray:
        return threshold_lengths(conf, self.theta, max_len)


def _fills_bucket(cost: CostProfile) -> bool:
    return cost.layout == "tokens" and bool(cost.token_buckets)


@dataclasses.dataclass(frozen=True)
class CausalGreedy:
    """DSpark's hardware-aware scheduler (paper Algorithm 1, early stop): the serving engine's.

    With a ``"tokens"`` profile that has ``token_buckets`` (the engine's), the early stop walks
    the unbucketed curve up to the largest bucket and the bucket's padding is filled with the
    next-ranked drafts (module docstring); otherwise :func:`causal_greedy_lengths` on ``cost``.
    """

    cost: CostProfile

    @functools.cached_property
    def _sps(self) -> np.ndarray:
        """SPS of the unbucketed curve per token count 0..largest bucket (tabulated once: the
        engine runs this between a round's read-back and the next dispatch)."""
        flat = dataclasses.replace(self.cost, token_buckets=())
        return flat.sps(np.arange(self.cost.token_buckets[-1] + 1))

    def __call__(self, conf, *, max_len=None, stale_conf=None) -> np.ndarray:
        if not _fills_bucket(self.cost):
            return causal_greedy_lengths(conf, self.cost, max_len)
        a_sorted, order, num_req, num_slots = _ranked(conf, max_len)
        n = max(min(a_sorted.shape[-1], self.cost.token_buckets[-1] - num_req), 0)
        a = a_sorted[..., :n]
        count = np.zeros(a.shape[:-1], np.int64)
        if n:
            start = np.full(a.shape[:-1] + (1,), float(num_req))
            tau = np.cumsum(np.concatenate([start, a], axis=-1), axis=-1)  # as the loop adds
            theta = tau * self._sps[num_req : num_req + n + 1]
            improves = (theta[..., 1:] > theta[..., :-1]) & (a > 0)
            count = np.where(improves.all(-1), n, np.argmin(improves, axis=-1))
        positive = np.sum(a_sorted > 0, axis=-1)
        count = bucket_fill_count(num_req, count, positive, self.cost.token_buckets)
        return _lengths_from_count(order, count, num_req, num_slots)


@dataclasses.dataclass(frozen=True)
class AsyncTopK:
    """Asynchronous variant: capacity from ``stale_conf`` (two rounds earlier), top-K now.

    Until two rounds of history exist (``stale_conf=None``) the capacity is
    ``R * cold_start_gamma``.
    """

    cost: CostProfile
    cold_start_gamma: int = 1

    def capacity(self, stale_conf, num_requests) -> np.ndarray:
        return global_capacity(stale_conf, self.cost, num_requests)

    def admit(self, conf, capacity, max_len=None) -> np.ndarray:
        """The ``capacity [...]`` largest survivals, then (a ``"tokens"`` profile with
        ``token_buckets``) the next-ranked drafts into the token bucket's padding."""
        if not _fills_bucket(self.cost):
            return top_k_lengths(conf, capacity, max_len)
        a_sorted, order, num_req, num_slots = _ranked(conf, max_len)
        positive = np.sum(a_sorted > 0, axis=-1)
        count = np.minimum(np.asarray(capacity), positive)
        count = bucket_fill_count(num_req, count, positive, self.cost.token_buckets)
        return _lengths_from_count(order, count, num_req, num_slots)

    def __call__(self, conf, *, max_len=None, stale_conf=None) -> np.ndarray:
        c = np.asarray(conf)
        num_req = c.shape[-2]
        if stale_conf is None:
            k = np.full(c.shape[:-2], num_req * self.cold_start_gamma)
        else:
            k = self.capacity(stale_conf, num_req)
        return self.admit(c, k, max_len)


def make_policy(name: str, **kw) -> Policy:
    """``"fixed"`` (gamma), ``"threshold"`` (theta), ``"dspark"`` (cost), ``"async"`` (cost)."""
    table = {
        "fixed": FixedGamma,
        "threshold": StaticThreshold,
        "dspark": CausalGreedy,
        "async": AsyncTopK,
    }
    if name not in table:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(table)}")
    return table[name](**kw)
