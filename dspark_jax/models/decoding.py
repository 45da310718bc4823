"""The target's decoding contract on the device: prefill, extend, per-token keys and sampling,
and the decode loop's state and step (pure functions and their jitted versions).
`models.generate` drives them for batched generation; the serving engine reuses `prefill`,
`extend` and `sample_tokens`.

Randomness: the token at position `p` of the request with seed `s` is drawn with key
`fold_in(fold_in(key, s), p)`, so a request's output depends on neither the other rows of its
batch nor on padding.

Building blocks: `prefill` / `prefill_jit` (prompt K/V and the last prompt token's logits),
`extend` / `extend_jit` (T new tokens per row from each row's committed length, verification
style, not committed), `token_keys` and `sample_tokens`; `start` (prefill + first token) and
`decode_step` / `_decode_loop` (one step / the `lax.while_loop` of them); `bucket_size` and
`PAD_TOKEN`, the host's shape rule for the batches these take.

Shapes are written as suffixes: B batch (bucket), P prompt bucket, S cache length, T new tokens,
V vocab, K stop ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax import parallel
from dspark_jax.buckets import bucket_up, pow2_bucket
from dspark_jax.config import TargetConfig
from dspark_jax.errors import RequestError
from dspark_jax.models import transformer as tf
from dspark_jax.spec.sampling import (
    SamplingConfig,
    SamplingParams,
    gumbel_noise,
    sample_transformed,
)

PAD_TOKEN = 0  # what fills a prompt bucket past a row's length (never attended to)


def bucket_size(n: int, buckets: Sequence[int], what: str = "size") -> int:
    """The smallest bucket >= n; RequestError if n exceeds the largest one."""
    b = bucket_up(n, buckets)
    if b is not None:
        return b
    raise RequestError(
        f"{what} {n} exceeds the largest bucket {max(buckets)}; pass larger buckets "
        f"(e.g. {what.split()[0]}_buckets=(..., {pow2_bucket(n, 1)}))"
    )


def _lm_logits(cfg: TargetConfig, params: nnx.State, hidden_BxTxH: jax.Array) -> jax.Array:
    return tf.build(cfg, params).logits(hidden_BxTxH)


def prefill(
    cfg: TargetConfig,
    params: nnx.State,
    tokens_BxP: jax.Array,
    lengths_B: jax.Array,
    cache: tf.KVCache,
    start_B: jax.Array | None = None,
) -> tuple[jax.Array, tf.ForwardOut, tf.KVCache]:
    """Write the K/V of right-padded prompts (or prompt chunks) and return the last prompt
    token's logits.

    Static: cfg, shapes. Arrays: params, tokens_BxP (right-padded), lengths_B (>= 1: valid
    tokens per row), cache, start_B (None: 0; else each row's chunk starts at that position, its
    earlier positions already in the cache — the serving engine's chunked prefill into a slot).
    Row b is fed at positions start_b + [0, P); K/V written past its valid tokens are padding
    that the row's next token overwrites before anything reads it (transformer contract).
    Returns (logits_BxV fp32 at the last valid token, ForwardOut without logits (features and
    hidden [B, P, ...], padding included), cache committed to start_B + lengths_B).
    """
    b, p = tokens_BxP.shape
    positions_BxP = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    if start_B is not None:
        positions_BxP = start_B[:, None] + positions_BxP
        cache = cache.with_lengths(start_B)
    out, cache = tf.forward(cfg, params, tokens_BxP, positions_BxP, cache, compute_logits=False)
    last_BxH = out.hidden[jnp.arange(b), lengths_B - 1]
    logits_BxV = _lm_logits(cfg, params, last_BxH[:, None, :])[:, 0]
    end_B = lengths_B if start_B is None else start_B + lengths_B
    return logits_BxV, out, cache.with_lengths(end_B)


def extend(
    cfg: TargetConfig,
    params: nnx.State,
    tokens_BxT: jax.Array,
    cache: tf.KVCache,
    *,
    compute_logits: bool = True,
) -> tuple[tf.ForwardOut, tf.KVCache]:
    """Feed T tokens per row at positions `cache.lengths + [0, T)` (decode / verification).

    Static: cfg, compute_logits, shapes. Arrays: params, tokens_BxT, cache.
    The lengths are NOT advanced: the caller commits the accepted prefix with
    `cache.with_lengths(...)`; K/V of rejected tokens stay in place and are overwritten later.
    """
    t = tokens_BxT.shape[1]
    positions_BxT = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return tf.forward(cfg, params, tokens_BxT, positions_BxT, cache, compute_logits=compute_logits)


def token_keys(key: jax.Array, seeds_B: jax.Array, positions_B: jax.Array) -> jax.Array:
    """Per-row keys `fold_in(fold_in(key, seed), position)` [B]: independent of batch layout."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(key, s), p))(
        seeds_B, positions_B
    )


def sample_tokens(
    logits_BxV: jax.Array,
    key: jax.Array,
    seeds_B: jax.Array,
    positions_B: jax.Array,
    sampling: SamplingParams | None,
    scfg: SamplingConfig,
) -> jax.Array:
    """Draw the token at `positions_B` for each row [B] int32.

    Static: scfg. Arrays: logits_BxV, key, seeds_B, positions_B, sampling ([B] knobs; unused and
    may be None when `scfg.greedy`). Greedy takes the argmax (first index on ties).
    """
    if scfg.greedy:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    keys = token_keys(key, seeds_B, positions_B)
    # sample_from_logits(keys, transform_logits(...))'s token, one vocabulary reduction per row
    return sample_transformed(gumbel_noise(keys, logits_BxV.shape[-1]), logits_BxV, sampling, scfg)


class DecodeState(NamedTuple):
    """Loop carry of the decode loop (all arrays; the cache is updated in place)."""

    cache: tf.KVCache  # committed lengths = position of last_B
    last_B: jax.Array  # int32, last sampled token, not yet fed to the model
    tokens_BxS: jax.Array  # int32, generated token at position p stored at [b, p]
    num_new_B: jax.Array  # int32, tokens generated so far (last_B included)
    done_B: jax.Array  # bool, row finished (stop token sampled or max_new reached)


class DecodeRequest(NamedTuple):
    """Per-row request arrays, constant during the loop (all arrays, never static)."""

    max_new_B: jax.Array  # int32 >= 0 (0 = padding row)
    stop_K: jax.Array  # int32 stop ids, padded with -1
    key: jax.Array  # base PRNG key
    seeds_B: jax.Array  # uint32
    sampling: SamplingParams | None


def _record(state: DecodeState, tok_B, pos_B, req: DecodeRequest) -> DecodeState:
    """Store freshly sampled tokens at pos_B for rows still running and update done flags."""
    live_B = ~state.done_B
    s = state.tokens_BxS.shape[1]
    rows = jnp.arange(tok_B.shape[0])
    tokens = state.tokens_BxS.at[rows, jnp.where(live_B, pos_B, s)].set(tok_B, mode="drop")
    num_new = state.num_new_B + live_B.astype(jnp.int32)
    stopped = jnp.any(tok_B[:, None] == req.stop_K[None, :], axis=-1)
    done = state.done_B | (live_B & (stopped | (num_new >= req.max_new_B)))
    last = jnp.where(live_B, tok_B, state.last_B)
    return state._replace(last_B=last, tokens_BxS=tokens, num_new_B=num_new, done_B=done)


def on_params_mesh(cache: tf.KVCache, params) -> tf.KVCache:
    """`cache` constrained to `parallel.cache_shardings` on the mesh the params are placed on
    (traced: their abstract mesh): rows over (data, fsdp), K/V heads over tensor, as the
    serving engine's; unchanged on one device."""
    mesh = jax.typeof(jax.tree.leaves(params)[0]).sharding.mesh
    if not mesh.axis_names or mesh.size == 1:
        return cache
    return jax.lax.with_sharding_constraint(cache, parallel.cache_shardings(cache, mesh))


def start(
    cfg: TargetConfig,
    params: nnx.State,
    tokens_BxP: jax.Array,
    lengths_B: jax.Array,
    req: DecodeRequest,
    *,
    scfg: SamplingConfig,
    cache_len: int,
) -> DecodeState:
    """Allocate the cache, prefill every row and sample each row's first new token.

    Static: cfg, scfg, cache_len (S), shapes. Arrays: params, tokens_BxP, lengths_B, req.
    """
    b = tokens_BxP.shape[0]
    cache = on_params_mesh(tf.init_cache(cfg, b, cache_len), params)
    logits_BxV, _, cache = prefill(cfg, params, tokens_BxP, lengths_B, cache)
    tok_B = sample_tokens(logits_BxV, req.key, req.seeds_B, lengths_B, req.sampling, scfg)
    state = DecodeState(
        cache=cache.with_lengths(lengths_B - 1),  # position of last_B once it is set
        last_B=jnp.zeros((b,), jnp.int32),
        tokens_BxS=jnp.zeros((b, cache_len), jnp.int32),
        num_new_B=jnp.zeros((b,), jnp.int32),
        done_B=req.max_new_B <= 0,
    )
    state = _record(state, tok_B, lengths_B, req)
    # Rows that just recorded their first token advance to its position.
    cache = state.cache.with_lengths(lengths_B - 1 + state.num_new_B)
    return state._replace(cache=cache)


def decode_step(
    cfg: TargetConfig, params: nnx.State, state: DecodeState, req: DecodeRequest, *, scfg
) -> DecodeState:
    """Feed every row's last token at its position, sample the next one, record it.

    Static: cfg, scfg, shapes. Arrays: params, state (donated in the jitted version), req.
    Finished rows still compute (their K/V write lands at their own uncommitted position) but
    record nothing and do not advance.
    """
    cache = state.cache
    pos_B = cache.lengths  # position of last_B
    out, cache = tf.forward(cfg, params, state.last_B[:, None], pos_B[:, None], cache)
    tok_B = sample_tokens(out.logits[:, 0], req.key, req.seeds_B, pos_B + 1, req.sampling, scfg)
    live_B = ~state.done_B
    state = _record(state._replace(cache=cache), tok_B, pos_B + 1, req)
    return state._replace(cache=cache.with_lengths(pos_B + live_B.astype(jnp.int32)))


def _generate(cfg, params, tokens_BxP, lengths_B, req, *, scfg, cache_len):
    """Prefill + `lax.while_loop` decode; returns (tokens_BxS, num_new_B)."""
    state = start(cfg, params, tokens_BxP, lengths_B, req, scfg=scfg, cache_len=cache_len)
    return _decode_loop(cfg, params, state, req, scfg=scfg, cache_len=cache_len)


def _decode_loop(cfg, params, state, req, *, scfg, cache_len):
    """`lax.while_loop` of `decode_step` from a started state; returns (tokens_BxS, num_new_B)."""

    def cond(carry):
        i, st = carry
        return (i < cache_len) & ~jnp.all(st.done_B)

    def body(carry):
        i, st = carry
        return i + 1, decode_step(cfg, params, st, req, scfg=scfg)

    _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
    return state.tokens_BxS, state.num_new_B


generate_jit = jax.jit(_generate, static_argnames=("cfg", "scfg", "cache_len"))
generate_jit.__doc__ = """Whole generation in one dispatch: prefill then a device-side while loop.

Static: cfg, scfg, cache_len, shapes (B, P, K). Arrays: params, tokens_BxP, lengths_B, req.
Returns tokens_BxS (token at position p stored at [b, p]) and num_new_B.
"""


start_jit = jax.jit(start, static_argnames=("cfg", "scfg", "cache_len"))
decode_step_jit = jax.jit(decode_step, static_argnames=("cfg", "scfg"), donate_argnames=("state",))
prefill_jit = jax.jit(prefill, static_argnames=("cfg",), donate_argnames=("cache",))
extend_jit = jax.jit(extend, static_argnames=("cfg", "compute_logits"), donate_argnames=("cache",))
