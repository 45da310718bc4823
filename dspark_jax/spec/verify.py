"""Chain verification: exact speculative (rejection) sampling of one round, batched and jitted.

A round for request b: the anchor sits at position ``pos``; the drafter proposed ``L`` tokens
``d_0..d_{L-1}`` (static ``L``) of which the scheduler admitted the first ``n = lengths[b]``
(``0 <= n <= L``); the target scored ``[anchor, d_0..d_{L-1}]`` giving ``L+1`` distributions
``p_t[0..L]`` where ``p_t[i]`` is the target's distribution for slot ``i`` (and ``p_t[n]`` the
bonus).

Sampled mode (exact for any draft distribution ``p_d``):

* for ``i = 0..n-1`` accept ``d_i`` iff ``u_i * p_d[i](d_i) < p_t[i](d_i)``, i.e. with probability
  ``min(1, p_t[i](d_i) / p_d[i](d_i))``; ``A`` = length of the leading run of accepts;
* if ``A < n``: the next token is drawn from ``normalize(max(0, p_t[A] - p_d[A]))`` (the residual;
  if its mass is <= 1e-8, rejection had probability <= 1e-8 and ``p_t[A]`` is used);
* if ``A == n``: the next token is a bonus draw from ``p_t[n]``.

The round emits ``d_0..d_{A-1}`` and the next token. For losslessness the caller must ensure:

1. ``d_i`` was drawn from ``p_d[i]`` - the very probabilities passed in - with
   :func:`dspark_jax.spec.sampling.probs_from_logits` and the same ``SamplingParams`` as the
   target; or pass ``draft_probs=None`` when drafts are a deterministic function of the context
   (argmax drafting), which is verified exactly as a one-hot ``p_d``;
2. ``lengths[b]`` was chosen without looking at the values of the drafts it admits: admission of
   slot ``i`` may depend on ``d_0..d_{i-1}`` but not on ``d_i`` (see ``sched.policies``);
3. the acceptance uniforms and the resample are independent of the drafts (``spec.rng`` streams).

Greedy mode (``SamplingConfig(greedy=True)``): accept ``d_i`` iff it equals ``argmax p_t[i]``; the
next token is ``argmax p_t[A]``. No randomness. Temperature-0 rows inside a sampled batch are exact
point masses and give the same result. There is never a silent fallback from sampled to greedy.

Masking: slots ``i >= n`` of ``draft_tokens`` / ``draft_probs`` and target positions ``> n`` are
never read in a way that can change the output - they may hold garbage (NaN, out-of-range ids).

Randomness: ``spec.rng`` - slot ``i``'s uniform is ``key(ACCEPT, seed, pos + 1 + i)`` and the next
token's draw is ``key(SAMPLE, seed, pos + 1 + A)``; a request's result does not depend on the other
rows of the batch or on padding.

Shapes are comments at the definitions: ``B`` requests, ``L`` static draft slots, ``V`` vocab.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.spec import rng as rng_lib
from dspark_jax.spec.sampling import (
    SamplingConfig,
    SamplingParams,
    check_logits,
    sample_from_logits,
    transform_logits,
)

__all__ = [
    "RESIDUAL_EPS",
    "verify",
    "verify_core",
    "verify_distributions",
    "acceptance_prob",
    "residual_dist",
]

RESIDUAL_EPS = 1e-8


def acceptance_prob(pt_d: jax.Array, pd_d: jax.Array) -> jax.Array:
    """``min(1, p_t(d) / p_d(d))`` elementwise; a draft the drafter could not draw (``p_d(d)=0``)
    is accepted iff the target allows it."""
    safe = jnp.where(pd_d > 0, pd_d, 1.0)
    return jnp.where(pd_d > 0, jnp.minimum(1.0, pt_d / safe), (pt_d > 0).astype(pt_d.dtype))


def residual_dist(pt: jax.Array, pd: jax.Array) -> jax.Array:
    """``normalize(max(0, p_t - p_d))`` over the last axis ``[..., V]``; ``p_t`` if the mass is
    <= ``RESIDUAL_EPS`` (then rejection itself had probability <= ``RESIDUAL_EPS``)."""
    r = jnp.maximum(pt - pd, 0.0)  # [..., V]
    mass = jnp.sum(r, axis=-1, keepdims=True)  # [..., 1]
    ok = mass > RESIDUAL_EPS
    return jnp.where(ok, r / jnp.where(ok, mass, 1.0), pt)


def _take(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [..., V], idx [...] -> x[..., idx] with idx clipped into range (masked ids are garbage)."""
    idx = jnp.clip(idx, 0, x.shape[-1] - 1)
    return jnp.take_along_axis(x, idx[..., None], axis=-1)[..., 0]


def _row_select(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, N, ...], idx [B] -> x[b, idx[b]] (idx clipped into range)."""
    idx = jnp.clip(idx, 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, idx.reshape((-1, 1) + (1,) * (x.ndim - 2)), axis=1)[:, 0]


def _target_probs(z: jax.Array, lse: jax.Array) -> jax.Array:
    """z [..., V] transformed logits, lse [...] their logsumexp -> probabilities [..., V]."""
    return jnp.exp(z - lse[..., None])


def _leading_run(accepted: jax.Array) -> jax.Array:
    """[B, L] bool -> [B] int32 length of the leading run of True."""
    return jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _draft_probs_or_one_hot(draft_tokens, draft_probs, vocab, dtype):
    if draft_probs is None:
        return jax.nn.one_hot(draft_tokens, vocab, dtype=dtype)  # [B, L, V]
    return draft_probs.astype(dtype)


def verify_core(
    target_logits: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array | None,
    lengths: jax.Array,
    rng: rng_lib.RequestRng | None,
    params: SamplingParams | None,
    cfg: SamplingConfig,
) -> tuple[jax.Array, jax.Array]:
    """Traceable verification (no checks); call it inside your own jitted step.

    Args (arrays unless marked static):
      target_logits: ``[B, L+1, V]`` raw target logits (the transform is applied here).
      draft_tokens: ``[B, L]`` int.
      draft_probs: ``[B, L, V]`` the distributions the drafts were drawn from (after the same
        transform), or ``None`` (static) for deterministic / one-hot drafts. Unused when greedy.
      lengths: ``[B]`` int in ``0..L``: drafts admitted per request.
      rng: :class:`~dspark_jax.spec.rng.RequestRng` (unused, may be None, when greedy).
      params: :class:`SamplingParams` ``[B]`` (unused, may be None, when greedy).
      cfg: static :class:`SamplingConfig`.

    Returns:
      ``(num_accepted [B] int32 in 0..lengths, next_token [B] int32)``.
    """
    batch, l_plus_1, vocab = target_logits.shape
    num_slots = l_plus_1 - 1
    lengths = lengths.astype(jnp.int32)
    slot = jnp.arange(num_slots, dtype=jnp.int32)  # [L]
    valid = slot[None, :] < lengths[:, None]  # [B, L]

    if cfg.greedy:
        top = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, L+1]
        accepted = valid & (draft_tokens == top[:, :num_slots])  # [B, L]
        num_accepted = _leading_run(accepted)
        return num_accepted, _row_select(top, num_accepted)

    # p_t = exp(z - logsumexp z): acceptance needs p_t only at the drafts and the next token
    # only the row at A, so the full [B, L+1, V] distribution is never materialised.
    z = transform_logits(target_logits, params, cfg)  # [B, L+1, V]
    lse = jax.nn.logsumexp(z, axis=-1)  # [B, L+1]
    key, seeds, positions = rng
    if num_slots == 0:
        num_accepted = jnp.zeros((batch,), jnp.int32)
        next_dist = _target_probs(z[:, 0], lse[:, 0])  # [B, V]
    else:
        pd = _draft_probs_or_one_hot(draft_tokens, draft_probs, vocab, z.dtype)  # [B, L, V]
        pt_d = jnp.exp(_take(z[:, :num_slots], draft_tokens) - lse[:, :num_slots])  # [B, L]
        pd_d = _take(pd, draft_tokens)  # [B, L]
        slot_positions = positions.astype(jnp.int32)[:, None] + 1 + slot[None, :]  # [B, L]
        keys = rng_lib.position_keys(key, rng_lib.ACCEPT, seeds, slot_positions)  # [B, L]
        u = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k, dtype=z.dtype)))(keys)  # [B, L]
        # u * p_d < p_t  <=>  u < min(1, p_t / p_d) for p_d > 0, without dividing.
        accepted = valid & (u * pd_d < pt_d)
        num_accepted = _leading_run(accepted)  # [B]
        pt_next = _target_probs(_row_select(z, num_accepted), _row_select(lse, num_accepted))
        pd_next = _row_select(pd, jnp.minimum(num_accepted, num_slots - 1))  # [B, V]
        bonus = (num_accepted == lengths)[:, None]
        next_dist = jnp.where(bonus, pt_next, residual_dist(pt_next, pd_next))  # [B, V]
    next_positions = positions.astype(jnp.int32) + 1 + num_accepted  # [B]
    next_keys = rng_lib.position_keys(key, rng_lib.SAMPLE, seeds, next_positions)  # [B]
    # jax.random.categorical's draw (sample_from_logits: the same tokens, keys made first)
    next_token = sample_from_logits(next_keys, jnp.log(next_dist))
    return num_accepted, next_token


_verify_jit = jax.jit(verify_core, static_argnames=("cfg",))


@jax.jit
def _bad_probs(p: jax.Array) -> jax.Array:
    """[..., V] -> [...] bool: NaN or negative entries."""
    return jnp.any(jnp.isnan(p) | (p < 0), axis=-1)


def _check_inputs(target_logits, draft_tokens, draft_probs, lengths, rng, params, cfg):
    """Shape and value checks at the API boundary (host side, may sync with the device)."""
    if not isinstance(cfg, SamplingConfig):
        raise TypeError(f"cfg must be a SamplingConfig, got {type(cfg).__name__}")
    if target_logits.ndim != 3:
        raise ValueError(f"target_logits must be [B, L+1, V], got shape {target_logits.shape}")
    batch, l_plus_1, vocab = target_logits.shape
    num_slots = l_plus_1 - 1
    if draft_tokens.shape != (batch, num_slots):
        raise ValueError(
            f"draft_tokens must be [B, L] = {(batch, num_slots)} to match target_logits "
            f"{target_logits.shape}, got {draft_tokens.shape}"
        )
    if draft_probs is not None and draft_probs.shape != (batch, num_slots, vocab):
        raise ValueError(
            f"draft_probs must be [B, L, V] = {(batch, num_slots, vocab)} or None (one-hot "
            f"drafts), got {draft_probs.shape}"
        )
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must be [B] = ({batch},), got {lengths.shape}")
    lengths_np = np.asarray(lengths)
    if np.any((lengths_np < 0) | (lengths_np > num_slots)):
        raise ValueError(
            f"lengths must lie in 0..L = 0..{num_slots}; got min {lengths_np.min()} max "
            f"{lengths_np.max()} (pad drafts to a larger static L instead)"
        )
    if not cfg.greedy:
        if rng is None or params is None:
            raise ValueError(
                "sampled verification needs rng=RequestRng(...) and params=SamplingParams(...); "
                "for greedy decoding pass cfg=SamplingConfig(greedy=True) explicitly"
            )
        for name, arr in (("rng.seeds", rng.seeds), ("rng.positions", rng.positions)):
            if jnp.shape(arr) != (batch,):
                raise ValueError(f"{name} must be [B] = ({batch},), got {jnp.shape(arr)}")
        for name, arr in zip(params._fields, params):
            if jnp.shape(arr) != (batch,):
                raise ValueError(f"params.{name} must be [B] = ({batch},), got {jnp.shape(arr)}")
    if params is not None:
        problem = cfg.covers(params)
        if problem:
            raise ValueError(problem)
    slot = np.arange(l_plus_1)
    check_logits(target_logits, "target_logits", valid=slot[None, :] <= lengths_np[:, None])
    drafts = np.asarray(draft_tokens)
    used = slot[None, :num_slots] < lengths_np[:, None]
    if np.any(used & ((drafts < 0) | (drafts >= vocab))):
        raise ValueError(f"draft_tokens at admitted slots must lie in 0..{vocab - 1}")
    if draft_probs is not None and not cfg.greedy:
        if np.any(np.asarray(_bad_probs(draft_probs)) & used):
            raise ValueError("draft_probs at admitted slots contain NaN or negative values")


def verify(
    target_logits: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array | None,
    lengths: jax.Array,
    rng: rng_lib.RequestRng | None,
    params: SamplingParams | None,
    cfg: SamplingConfig,
    *,
    validate: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Verify one round for ``B`` requests (jitted; see the module docstring for the math).

    Same arguments as :func:`verify_core`. With ``validate=True`` (default) shapes, lengths,
    draft ids and NaN/+inf target logits at read positions are checked on the host first and a
    ``ValueError`` says what to fix; this syncs with the device, so a hot loop that validated its
    inputs once may pass ``validate=False``. Static: ``cfg``, the shapes and whether
    ``draft_probs`` is None; everything else is an array (no recompiles when values change).

    Returns ``(num_accepted [B] int32, next_token [B] int32)``.
    """
    target_logits = jnp.asarray(target_logits)
    draft_tokens = jnp.asarray(draft_tokens, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    if draft_probs is not None:
        draft_probs = jnp.asarray(draft_probs)
    if validate:
        _check_inputs(target_logits, draft_tokens, draft_probs, lengths, rng, params, cfg)
    if cfg.greedy:
        rng, params, draft_probs = None, None, None
    return _verify_jit(target_logits, draft_tokens, draft_probs, lengths, rng, params, cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def verify_distributions(
    target_logits: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array | None,
    lengths: jax.Array,
    params: SamplingParams | None,
    cfg: SamplingConfig,
) -> tuple[jax.Array, jax.Array]:
    """The exact law of a round, from the same formulas :func:`verify_core` samples with.

    Used by the enumeration tests and for analysis. Arguments as in :func:`verify_core`.

    Returns:
      accept_prob: ``[B, L]`` probability that slot ``i`` is accepted given slots ``< i`` were
        (0 for slots ``>= lengths``).
      next_dist: ``[B, L+1, V]``; row ``a`` is the law of the next token given ``A == a``:
        the residual for ``a < lengths``, ``p_t[lengths]`` for ``a == lengths``, zeros beyond.
    """
    batch, l_plus_1, vocab = target_logits.shape
    num_slots = l_plus_1 - 1
    lengths = lengths.astype(jnp.int32)
    slot = jnp.arange(num_slots, dtype=jnp.int32)
    valid = slot[None, :] < lengths[:, None]  # [B, L]
    rows = jnp.arange(l_plus_1, dtype=jnp.int32)[None, :]  # [1, L+1]
    is_bonus = (rows == lengths[:, None])[..., None]  # [B, L+1, 1]
    reachable = (rows <= lengths[:, None])[..., None]  # [B, L+1, 1]
    if cfg.greedy:
        top = jnp.argmax(target_logits, axis=-1)  # [B, L+1]
        accept = (valid & (draft_tokens == top[:, :num_slots])).astype(jnp.float32)
        next_dist = jax.nn.one_hot(top, vocab, dtype=jnp.float32)  # [B, L+1, V]
        return accept, jnp.where(reachable, next_dist, 0.0)
    z = transform_logits(target_logits, params, cfg)  # [B, L+1, V]
    pt = _target_probs(z, jax.nn.logsumexp(z, axis=-1))  # same formula as verify_core
    pd = _draft_probs_or_one_hot(draft_tokens, draft_probs, vocab, pt.dtype)  # [B, L, V]
    accept = acceptance_prob(_take(pt[:, :num_slots], draft_tokens), _take(pd, draft_tokens))
    accept = jnp.where(valid, accept, 0.0)  # [B, L]
    pd_pad = jnp.concatenate([pd, jnp.zeros_like(pt[:, :1])], axis=1)  # [B, L+1, V]
    next_dist = jnp.where(is_bonus, pt, residual_dist(pt, pd_pad))
    return accept, jnp.where(reachable, next_dist, 0.0)
