"""Packed (ragged) forward of the target over a flat token bucket, for the serving engine.

    out, cache = packed_forward(cfg, params, tokens_T, slot_T, offset_T, pos_T, valid_T, cache,
                                cache_len)

`T` tokens from any number of cache slots are laid out flat: token t is the `offset_T[t]`-th
token of this call in slot `slot_T[t]`, at absolute position `pos_T[t]`; a slot's tokens sit at
consecutive positions after its committed prefix (`pos_T - offset_T`, the slot's cache length).
`valid_T[t] = False` marks bucket padding (its K/V write is dropped and its outputs are garbage
the caller ignores). Every dense layer (projections, MLP, LM head) runs on exactly T rows, so
the cost of a verification forward follows the number of tokens the scheduler admitted
(`R + sum l_r`, padded to a bucket), not `slots x (gamma + 1)`.

Attention: token t sees its slot's committed prefix (cache positions < pos - offset, bounded by
the static `cache_len` bucket) and this call's tokens of its own slot at offsets <= its own
(their K/V straight from the layer; one softmax over both sets). `packed_forward` writes each
layer's K/V into the cache before that layer reads it (XLA then updates the cache in place; a
write after the reads made it copy the whole cache), `packed_forward_kv` only reads the cache
and returns the K/V (`NewKV`, written later by `write_kv`). The device-resident rounds need the
latter: they choose among verify programs with `lax.switch`, and a branch that returned the
updated cache made the loop copy the whole cache every round. Both read the same values (the
prefix mask stops before the written positions).

`one_set=True` (writing forward only): the tokens read their own K/V back from the cache, in one
key set with the prefix (each token sees its slot's positions up to its own, as plain decoding's
`transformer.forward` does) instead of a second set straight from the layer: one score product,
one value product and a plain softmax per layer instead of two each and a merge, 5% of a batch-1
8-token verify forward of the demo's target (3.09 vs 3.27 ms, 32-round loop, interleaved). It
needs `cache_len` past every valid token's own position (the engine's cache bucket rule). The
two forms differ by float reassociation, so a caller uses it only where every program that must
give the same tokens does (the engine: when it has a single (T, S) verify program).

Cache layouts of the prefix read: with one slot (batch-1 decoding) the tokens attend to it
directly. With several slots and `slot_tokens` (at most that many tokens per slot, as the
engine's verify packs them) the queries are laid out slot-major, `[slots, slot_tokens]`, for
attention only: each slot's query rows read that slot's cache in place, `slots x slot_tokens x
cache_len` scores and no copy of the cache — when those padded rows are at most
`SLOT_MAJOR_PAD` x T (a static choice per token bucket). Otherwise every token gathers its slot's
cache (`T` copies of `cache_len` keys and values per layer, cheaper when few slots' tokens are
verified; docs/MEASUREMENTS.md: verify_layout).

This composes the target's own layers (`transformer.DecoderLayer`, `gemma4.Gemma4Layer`: their
`attention_inputs` and `finish`, the model's `embed` and `kv_source`) and `layers.attend`, and
swaps only each layer's cache step, so a packed forward equals the batched one up to float
reassociation. Gemma 4: a sliding layer's window is a mask on the cache prefix and on the
call's own tokens (key position > query position - window), a KV-shared layer attends to its
source layer's cache entry and new K/V, scores are unscaled. A sliding layer's entry shorter
than the cache is a ring (`cache.ring_positions`: position p at index p mod R, the serving
engine's R = window + γ + 1): it is read whole, and written at p mod R. Writing before reading
(`packed_forward`) then needs at most R - window + 1 tokens per slot, so a token never overwrites
a key a query of the same call still reads (the verify's γ + 1); `packed_forward_kv` + `write_kv`
take any number (a prefill chunk).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.config import TargetConfig
from dspark_jax.models import transformer as tf
from dspark_jax.models.cache import outputs, ring_index, ring_positions
from dspark_jax.models.layers import attend

# The slot-major layout's padded query rows (slots x slot_tokens) at most this many times the
# bucket's tokens: measured crossover of the two layouts on the demo's target at 8 and 32 slots
# (docs/MEASUREMENTS.md: verify_layout)
SLOT_MAJOR_PAD = 4


class NewKV(NamedTuple):
    """The K/V a packed forward computed, not yet in the cache: per layer [n_kv, T, d_h], each
    token's slot [T] and cache position [T] (`cache.max_len` for padding: the write is dropped)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    slot: jax.Array
    pos: jax.Array

    def padded(self, num_tokens: int) -> NewKV:
        """The same writes over `num_tokens` >= T rows (the extra rows dropped): one shape for
        every token bucket."""
        extra = num_tokens - self.slot.shape[0]
        if extra == 0:
            return self
        pad = lambda x: jnp.pad(x, ((0, 0), (0, extra), (0, 0)))
        drop = jnp.full((extra,), jnp.iinfo(jnp.int32).max, jnp.int32)
        return NewKV(
            tuple(pad(x) for x in self.k), tuple(pad(x) for x in self.v),
            jnp.concatenate([self.slot, jnp.zeros((extra,), jnp.int32)]),
            jnp.concatenate([self.pos, drop]),
        )  # fmt: skip


def write_kv(cache: tf.KVCache, kv: NewKV) -> tf.KVCache:
    """The cache with `kv`'s tokens written at [slot, :, pos] (lengths unchanged); a ring entry
    (a Gemma 4 sliding layer's) takes each slot's newest `size` of them at pos mod size, so a
    slot may bring more tokens than its ring holds (a prefill chunk)."""
    s_max, rows = cache.max_len, kv.slot[None, :]
    pos = jnp.minimum(kv.pos, s_max)  # past the cache: dropped
    top = jax.ops.segment_max(jnp.where(pos < s_max, pos, -1), kv.slot, cache.batch)[kv.slot]

    def put(c, x):
        size = c.shape[2]
        at = ring_index(jnp.where(pos > top - size, pos, s_max), size, s_max)
        return _put(c, rows, jnp.arange(c.shape[1])[:, None], at[None], x)  # the layer's heads

    return cache._replace(k=tuple(map(put, cache.k, kv.k)), v=tuple(map(put, cache.v, kv.v)))


def _put(cache_NxKxSxD, rows_1xT, heads_Kx1, pos_1xT, x_KxTxD):
    return cache_NxKxSxD.at[rows_1xT, heads_Kx1, pos_1xT].set(
        x_KxTxD.astype(cache_NxKxSxD.dtype), mode="drop"
    )


def packed_forward(
    cfg: TargetConfig, params, tokens_T, slot_T, offset_T, pos_T, valid_T,
    cache: tf.KVCache, cache_len: int, *, compute_logits: bool = True, slot_tokens: int = 0,
    one_set: bool = False,
) -> tuple[tf.ForwardOut, tf.KVCache]:  # fmt: skip
    """`packed_forward_kv` that writes the tokens' K/V into the cache (lengths unchanged: the
    caller commits): each layer writes before it reads, so XLA updates the cache in place.
    `one_set` (static): the tokens' own K/V read back from the cache (module docstring)."""
    return _forward(cfg, params, tokens_T, slot_T, offset_T, pos_T, valid_T, cache, cache_len,
                    compute_logits, slot_tokens, write=True, one_set=one_set)  # fmt: skip


def packed_forward_kv(
    cfg: TargetConfig,
    params,
    tokens_T: jax.Array,
    slot_T: jax.Array,
    offset_T: jax.Array,
    pos_T: jax.Array,
    valid_T: jax.Array,
    cache: tf.KVCache,
    cache_len: int,
    *,
    compute_logits: bool = True,
    slot_tokens: int = 0,
) -> tuple[tf.ForwardOut, NewKV]:
    """Static: cfg, cache_len, compute_logits, slot_tokens (0: never slot-major), T. Returns
    ForwardOut with [1, T, ...] arrays (logits fp32, features, hidden) and the tokens' K/V; the
    cache is only read."""
    return _forward(cfg, params, tokens_T, slot_T, offset_T, pos_T, valid_T, cache, cache_len,
                    compute_logits, slot_tokens, write=False, one_set=False)  # fmt: skip


class _Layout(NamedTuple):
    """How a packed call's queries meet the cache: slot-major (`by_slot`: each slot's G query rows
    read its cache in place; `row` places token t, `back` reads it back) or token-major (each
    token reads its own slot's prefix); the context and own-token masks of that layout."""

    by_slot: bool
    one_slot: bool
    n_slots: int
    g: int
    row: jax.Array | None
    back: jax.Array | None
    m_ctx: jax.Array
    m_own: jax.Array | None


def _layout(cache, cache_len, slot_T, offset_T, pos_T, valid_T, slot_tokens, one_set,
            window=None, ring=None) -> _Layout:  # fmt: skip
    """The layout and its masks; `window` (a Gemma 4 sliding layer's; None: full attention)
    also hides keys `window` or more positions before the query, in the prefix and among the
    call's own tokens (a slot's tokens sit at consecutive positions: offsets stand for them).
    `ring`: the layer's cache entry is a ring of that many entries (`cache.ring_positions`;
    None: dense), read over its first `cache_len` entries."""
    t = slot_T.shape[0]
    base_T = jnp.where(valid_T, pos_T - offset_T, 0)  # the slot's committed length (padding: 0)
    key_idx = jnp.arange(cache_len, dtype=jnp.int32)
    n_slots = cache.k[0].shape[0]
    one_slot = n_slots == 1
    # slot-major pays attention for every slot's G rows; the gather pays a copy per token: the
    # first wins once the padded rows are at most SLOT_MAJOR_PAD x the tokens
    by_slot = not one_slot and 0 < n_slots * slot_tokens <= SLOT_MAJOR_PAD * t
    g, row, back = int(slot_tokens), None, None

    def seen(top, pos):
        """[X, cache_len]: the cache entries a query at `pos` reads when `top` is the newest
        position it may see there (entries past top, and keys outside its window, hidden)."""
        if ring is None:
            keys, ok = key_idx[None, :], key_idx[None, :] <= top[:, None]
        else:
            keys = ring_positions(top, ring)[:, :cache_len]
            ok = keys >= 0
        return ok if window is None else ok & (keys > pos[:, None] - window)

    if by_slot:  # slot-major query layout [N * G] for attention
        row = jnp.where(valid_T, slot_T * g + offset_T, n_slots * g)  # out of range: dropped
        valid_NG = jnp.zeros((n_slots * g,), bool).at[row].set(True, mode="drop")
        base_NG = jnp.zeros((n_slots * g,), jnp.int32).at[row].set(base_T, mode="drop")
        pos_NG = jnp.zeros((n_slots * g,), jnp.int32).at[row].set(pos_T, mode="drop")
        m_ctx = seen(base_NG - 1, pos_NG).reshape(1, n_slots, g, cache_len)
        own = valid_NG.reshape(n_slots, 1, g) & valid_NG.reshape(n_slots, g, 1)
        j, i = jnp.arange(g)[None, :], jnp.arange(g)[:, None]
        near = (j <= i) if window is None else (j <= i) & (j > i - window)
        m_own = (own & near)[None]  # [1, N, G, G]
        back = jnp.minimum(row, n_slots * g - 1)  # token t's row (padding tokens: any row)
    else:  # token-major: the prefix (per token), this call's tokens of the same slot (shared)
        m_ctx = seen(base_T - 1, pos_T)[None, :, None, :]
        j, i = offset_T[None, :], offset_T[:, None]
        near = (j <= i) if window is None else (j <= i) & (j > i - window)
        same = (slot_T[None, :] == slot_T[:, None]) & near
        m_own = (same & valid_T[None, :])[None]  # [1, T, T]
    if one_set:  # the prefix and this call's tokens of the slot: cache positions <= own
        upto_T = jnp.where(valid_T, pos_T, -1)
        if by_slot:
            upto_NG = jnp.full((n_slots * g,), -1, jnp.int32).at[row].set(upto_T, mode="drop")
            m_ctx = seen(upto_NG, upto_NG).reshape(1, n_slots, g, cache_len)
        else:
            m_ctx = seen(upto_T, upto_T)[None, :, None, :]
    return _Layout(by_slot, one_slot, n_slots, g, row, back, m_ctx, m_own)


def _attend_cached(lay: _Layout, q, k, v, ck, cv, slot_T, one_set: bool, scale=None):
    """One layer's attention of the call's queries q [1, T, n, d] over the cache ck / cv
    [N, K, S_b, d] (and, unless `one_set`, the call's own k / v [1, K, T, d])."""
    n_slots, g, row = lay.n_slots, lay.g, lay.row
    if lay.by_slot:  # slot n's G query rows read slot n's cache in place and its own G tokens
        q_g = jnp.zeros((1, n_slots * g) + q.shape[2:], q.dtype).at[0, row].set(q[0], mode="drop")
        if one_set:
            return attend(q_g, [(ck[None], cv[None], lay.m_ctx)], scale=scale)[:, lay.back]
        kv_g = [
            jnp.zeros((n_slots * g,) + y.shape[1:2] + y.shape[3:], y.dtype)
            .at[row]
            .set(y[0].transpose(1, 0, 2), mode="drop")
            .reshape(n_slots, g, y.shape[1], -1)
            .transpose(0, 2, 1, 3)[None]
            for y in (k, v)
        ]  # [1, N, K, G, d]
        sets = [(ck[None], cv[None], lay.m_ctx), (kv_g[0], kv_g[1], lay.m_own)]
        return attend(q_g, sets, scale=scale)[:, lay.back]
    own = [] if one_set else [(k, v, lay.m_own)]
    if lay.one_slot:  # every token reads slot 0: no per-token copy of the cache
        return attend(q, [(ck, cv, lay.m_ctx[:, :, 0])] + own, scale=scale)
    # token t gathers its own slot's prefix: T groups of one query
    return attend(q, [(ck[slot_T][None], cv[slot_T][None], lay.m_ctx)] + own, scale=scale)


def _forward(cfg, params, tokens_T, slot_T, offset_T, pos_T, valid_T, cache, cache_len,
             compute_logits, slot_tokens, *, write: bool, one_set: bool):  # fmt: skip
    """The forward; `write`: each layer writes its tokens' K/V into the cache before reading it
    (returns the cache), else the cache is only read (returns `NewKV`). The reads are the same
    either way: the prefix mask stops before the written positions. `one_set` (needs `write`):
    each token reads the cache up to its own position, its own tokens' K/V included."""
    if one_set and not write:
        raise ValueError("packed forward: one_set reads the tokens' K/V from the cache: write it")
    model = tf.build(cfg, params)
    s_max = cache.max_len
    cache_len = min(int(cache_len), s_max)
    x, inputs = model.embed(tokens_T[None])  # [1, T, H], Gemma 4: per-layer inputs [1, T, L, P]
    pos_1xT = pos_T[None].astype(jnp.int32)
    args = (cache, slot_T, offset_T, pos_T, valid_T, slot_tokens, one_set)
    lays = {}  # per (window, ring, entries read): the layout and its masks
    write_T = jnp.where(valid_T, pos_T, s_max).astype(jnp.int32)  # s_max: dropped
    rows = slot_T[None, :]
    feats, kvs, new_k, new_v, out_k, out_v = {}, {}, [], [], [], []
    for i, layer in enumerate(model.layers):
        # q [1, T, n, d], k / v [1, K, T, d] (None: a KV-shared layer reads its source's)
        q, k, v = layer.attention_inputs(x, pos_1xT)
        src = model.kv_source(i)
        if src == i:
            ck, cv = cache.k[i], cache.v[i]  # [N, K, S, d] (a ring: S < s_max)
            size = ck.shape[2]
            if write:  # then read: in place (a write after the reads made XLA copy the cache)
                heads, at = jnp.arange(ck.shape[1])[:, None], ring_index(write_T, size, s_max)
                ck, cv = (
                    _put(ck, rows, heads, at[None], k[0]),
                    _put(cv, rows, heads, at[None], v[0]),
                )
                out_k.append(ck)
                out_v.append(cv)
            new_k.append(k[0])
            new_v.append(v[0])
            s_b = min(cache_len, size)  # [N, K, S_b, d]
            kvs[i] = (k, v, ck[:, :, :s_b], cv[:, :, :s_b], size if size < s_max else None)
        k, v, ck, cv, ring = kvs[src]
        key = (layer.window, ring, ck.shape[2])
        if key not in lays:
            lays[key] = _layout(args[0], ck.shape[2], *args[1:], layer.window, ring)
        a = _attend_cached(lays[key], q, k, v, ck, cv, slot_T, one_set, layer.scale)
        x = layer.finish(x, a, None if inputs is None else inputs[:, :, i])
        if i in cfg.target_layer_ids:
            feats[cfg.target_layer_ids.index(i)] = x
    out = outputs(model, x, list(feats.items()), compute_logits)
    if write:
        return out, cache._replace(k=tuple(out_k), v=tuple(out_v))
    return out, NewKV(tuple(new_k), tuple(new_v), slot_T.astype(jnp.int32), write_T)
