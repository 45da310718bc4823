"""Device-resident rounds: up to K speculative rounds in one jitted call (`lax.while_loop`).

    state, out = packed_rounds(RoundsSpec(tcfg, dcfg, scfg, token_buckets, cache_buckets, K),
                               tparams, dparams, state, RoundsInputs(active, seeds, ...))

Every round is exactly the engine's packed round (`device.verify_forward` + `device.finish_round`):
the verification lengths are computed on the device by the same rule the host scheduler applies
(fixed γ / MTP-1: `min(γ_p, cap)`; static threshold: leading drafts whose raw confidence logit
is >= a per-position cut that `threshold_cuts` finds so that the comparison equals the host's
float64 `STS.probs(rho) >= θ` for every float32 `rho`), and each round's token bucket T and
cache bucket S are chosen on the device as the host would choose them, by `lax.switch` over the
compiled (T, S) verify forwards (with only one, it is called directly and writes the cache in
place, in the form the engine chose for its one-round program too: `device.verify_forward`'s
`one_set`). So a request's tokens do not depend on K: the K-round call runs the same
arithmetic, with the same keys (seed, position, round counter), as K one-round calls.

Stop ids and max_new_tokens are honoured on the device: a round in which any row finishes (a stop
id among its committed tokens, or its token budget reached) is the call's last one, so the host
can retire the request, admit a waiting one and re-plan the batch (sampling mode, buckets). The
host reads all rounds' outputs once per call and replays its per-round bookkeeping on them.
Algorithm 1 and the async top-K policy stay on the host (one round per call).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.engine import device as dev
from dspark_jax.models.packed import write_kv

MAX_STOP_IDS = 8  # stop ids per request the device checks; more -> one round per call


class RoundsOut(NamedTuple):
    emitted: jax.Array  # [K, N, γ+1] committed tokens per round (-1 past A+1 / inactive)
    num_accepted: jax.Array  # [K, N] (-1: non-finite logits, `device.finite_rows`)
    lengths: jax.Array  # [K, N] verified drafts per round
    next_conf: jax.Array  # [K, N, γ] raw confidence logits of the block pending after round k
    count: jax.Array  # [] rounds run (1..K; the rest of the arrays is padding)


def _forward_branch(tcfg, dcfg, num_tokens, cache_len, max_tokens, tparams, state, lengths_N,
                    active_N):  # fmt: skip
    """One (T, S) verify program of the switch: it reads the state and returns the tokens' K/V
    padded to the largest bucket (one output shape), written after the switch: a branch that
    returned the updated cache made the loop copy the whole cache every round."""
    logits, feats, kv = dev.verify_forward(
        tcfg, dcfg, num_tokens, cache_len, tparams, state, lengths_N, active_N, write=False
    )
    return logits, feats, kv.padded(max_tokens)


def device_lengths(state, active_N, room_N, gamma_p, use_threshold, cuts_G):
    """This round's lengths [N]: fixed `min(γ_p, room - 1)`, or (use_threshold) the number of
    leading drafts j < room - 1 with raw confidence >= cuts[j]."""
    g = state.prop_conf.shape[1]
    cap = room_N - 1
    fixed = jnp.minimum(gamma_p, cap)
    j = jnp.arange(g, dtype=jnp.int32)[None, :]
    keep = (state.prop_conf >= cuts_G[None, :]) & (j < cap[:, None])
    thr = jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1)
    out = jnp.where(use_threshold, thr, fixed)
    return jnp.where(active_N, out, 0).astype(jnp.int32)


class RoundsSpec(NamedTuple):
    """`packed_rounds`' static part: configs, sampling mode, the compiled bucket tuples, K (the
    output size) and the verify forward's form (`device.verify_forward`'s `one_set`, used with
    one (T, S) pair only)."""

    tcfg: object
    dcfg: object
    scfg: object
    token_buckets: tuple[int, ...]
    cache_buckets: tuple[int, ...]
    max_rounds: int
    one_set: bool = False


class RoundsInputs(NamedTuple):
    """`packed_rounds`' arrays, one row per slot where they have one."""

    active: jax.Array  # [N] bool (the same set in every round)
    seeds: jax.Array  # [N] uint32
    sampling: object  # SamplingParams [N]; None in greedy mode
    key: jax.Array  # the engine's root key
    room: jax.Array  # [N] int32 tokens each request may still emit (>= 1 when active)
    stop: jax.Array  # [N, MAX_STOP_IDS] int32 stop ids, -1 padded
    gamma_p: jax.Array  # int32 fixed γ
    use_threshold: jax.Array  # bool: lengths from `cuts` instead of gamma_p
    cuts: jax.Array  # [γ] float32 (`threshold_cuts`)
    n_rounds: jax.Array  # int32, 1..K rounds to run at most


def _verify(spec: RoundsSpec, tparams, state, lengths, active):
    """The round's verify forward: the only (T, S) program, writing the cache in place, or the
    (T, S) pair the host would choose, by `lax.switch` over read-only branches whose K/V is
    written after the switch (`_forward_branch`)."""
    tcfg, dcfg, _, token_buckets, cache_buckets, _, one_set = spec
    if len(token_buckets) * len(cache_buckets) == 1:
        return dev.verify_forward(tcfg, dcfg, token_buckets[0], cache_buckets[0], tparams, state,
                                  lengths, active, one_set=one_set)  # fmt: skip
    branches = [
        functools.partial(_forward_branch, tcfg, dcfg, t, s, max(token_buckets))
        for t in token_buckets
        for s in cache_buckets
    ]
    tb = jnp.asarray(token_buckets, jnp.int32)
    cb = jnp.asarray(cache_buckets, jnp.int32)
    total = jnp.sum(jnp.where(active, lengths + 1, 0))
    need = jnp.max(jnp.where(active, state.cache.lengths + 1 + lengths, 0))
    it = jnp.minimum(jnp.searchsorted(tb, total, side="left"), len(token_buckets) - 1)
    ic = jnp.minimum(jnp.searchsorted(cb, need, side="left"), len(cache_buckets) - 1)
    index = it * len(cache_buckets) + ic
    logits, feats, kv = jax.lax.switch(index, branches, tparams, state, lengths, active)
    return logits, feats, write_kv(state.cache, kv)


def _finished(ro: dev.RoundOut, inp: RoundsInputs, room):
    """[N] rows that finish in this round: a committed stop id, the token budget reached, or
    non-finite logits (the host ends the request with an error)."""
    a = ro.num_accepted
    i = jnp.arange(ro.emitted.shape[1])[None, :]
    stop = inp.stop[:, None, :]
    hit = (ro.emitted[:, :, None] == stop) & (stop >= 0)
    hit = jnp.any(hit & (i <= a[:, None])[:, :, None], axis=(1, 2))
    return inp.active & (hit | (a + 1 >= room) | (a < 0))  # a < 0: non-finite logits


def packed_rounds(spec: RoundsSpec, tparams, dparams, state: dev.SlotState, inp: RoundsInputs):
    """Up to min(n_rounds, max_rounds) rounds over the active slots (`state` donated); the loop
    ends after a round in which any row finishes. Returns (state, RoundsOut)."""

    def one_round(state, lengths):
        fwd = _verify(spec, tparams, state, lengths, inp.active)
        return dev.finish_round(spec.dcfg, spec.scfg, dparams, state, fwd, lengths, inp.active,
                                inp.seeds, inp.sampling, inp.key)  # fmt: skip

    return resident_loop(spec, state, inp, one_round)


def resident_loop(spec: RoundsSpec, state, inp: RoundsInputs, one_round):
    """The device loop of `packed_rounds` (and of the paged layout's): each round's lengths
    from `device_lengths`, then `one_round(state, lengths) -> (state, RoundOut)`, until
    `n_rounds` (at most `spec.max_rounds`) or a round in which a row finishes."""
    g = spec.dcfg.block_size
    n = inp.active.shape[0]
    k_max = spec.max_rounds

    def body(carry):
        k, state, room, outs, _ = carry
        lengths = device_lengths(state, inp.active, room, inp.gamma_p, inp.use_threshold, inp.cuts)
        state, ro = one_round(state, lengths)
        done = _finished(ro, inp, room)
        room = room - (ro.num_accepted + 1)
        outs = RoundsOut(
            outs.emitted.at[k].set(ro.emitted),
            outs.num_accepted.at[k].set(ro.num_accepted),
            outs.lengths.at[k].set(lengths),
            outs.next_conf.at[k].set(ro.next_conf),
            k + 1,
        )
        go = (k + 1 < jnp.minimum(inp.n_rounds, k_max)) & ~jnp.any(done)
        return k + 1, state, room, outs, go

    outs = RoundsOut(
        jnp.full((k_max, n, g + 1), -1, jnp.int32),
        jnp.zeros((k_max, n), jnp.int32),
        jnp.zeros((k_max, n), jnp.int32),
        jnp.zeros((k_max, n, g), jnp.float32),
        jnp.int32(0),
    )
    room = jnp.asarray(inp.room, jnp.int32)
    carry = (jnp.int32(0), state, room, outs, jnp.any(inp.active) & (inp.n_rounds > 0))
    _, state, _, outs, _ = jax.lax.while_loop(lambda c: c[4], body, carry)
    return state, outs


# ---- host side -------------------------------------------------------------------------------


def _ordered(x: np.ndarray) -> np.ndarray:
    """float32 -> int64 keys in the floats' order (so bisection walks adjacent floats)."""
    b = x.astype(np.float32).view(np.int32).astype(np.int64)
    return np.where(b < 0, -(b & 0x7FFFFFFF), b)


def _from_ordered(k: int) -> np.float32:
    b = k if k >= 0 else (-k) | -0x80000000
    return np.array([b], np.int64).astype(np.int32).view(np.float32)[0]


def threshold_cuts(sts, gamma: int, theta: float) -> np.ndarray:
    """Per-position cut c_j [γ] float32: for every float32 rho, rho >= c_j exactly when the host
    policy admits it (`sts.probs` of rho at position j >= theta, computed in float64).
    NaN when no float32 qualifies (never admitted)."""
    cuts = np.empty(gamma, np.float32)
    for j in range(gamma):

        def ok(k, j=j):
            rho = np.zeros(gamma, np.float32)
            rho[j] = _from_ordered(k)
            return bool(sts.probs(rho[None])[0, j] >= theta)

        lo, hi = int(_ordered(np.float32(-np.inf))), int(_ordered(np.float32(np.inf)))
        if ok(lo):
            cuts[j] = -np.inf
            continue
        if not ok(hi):
            cuts[j] = np.nan
            continue
        while hi - lo > 1:  # invariant: not ok(lo), ok(hi) (the host map is monotone in rho)
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        cuts[j] = _from_ordered(hi)
    return cuts
