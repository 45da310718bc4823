"""Packed (ragged) forward of the target over a flat token bucket, for the serving engine.

    out, cache = packed_forward(cfg, params, tokens_T, slot_T, pos_T, valid_T, cache, cache_len)

`T` tokens from any number of cache slots are laid out flat: token t belongs to slot `slot_T[t]`
at absolute position `pos_T[t]`; `valid_T[t] = False` marks bucket padding (its K/V write is
dropped and its outputs are garbage the caller ignores). Every dense layer (projections, MLP, LM
head) runs on exactly T rows, so the cost of a verification forward follows the number of tokens
the scheduler admitted (`R + sum l_r`, padded to a bucket), not `slots x (gamma + 1)`.

Attention: each token writes its K/V to `cache[slot, :, pos]`, then reads its own slot's cache at
indices `<= pos` (`transformer.py`'s cache contract: the slot's committed prefix plus the tokens
of this call at smaller positions, which the same layer wrote just before). Reads are bounded by
the static `cache_len` (a cache-length bucket >= every valid token's position + 1), so attention
costs `T x cache_len`, not `T x max_len`. With one slot (batch-1 decoding) the tokens attend to
it directly. With several slots and `slot_offset_T` / `slot_tokens` (token t is the
`slot_offset_T[t]`-th of at most `slot_tokens` tokens of its slot, as the engine's verify packs
them), the queries are laid out slot-major, `[slots, slot_tokens]`, for attention only: each
slot's queries read that slot's cache in place, `slots x slot_tokens x cache_len` scores and no
copy of the cache — when those padded rows are at most `SLOT_MAJOR_PAD` x T (a static choice per
token bucket). Otherwise every token gathers its slot's cache (`T` copies of `cache_len` keys
and values per layer, which dominated a full batched round; cheaper when few slots' tokens are
verified: benchmarks/verify_layout.py).

This composes `transformer.py`'s modules and `layers.attend` (same parameters, same RMSNorm /
RoPE / GQA code), so a packed forward equals the batched one up to float reassociation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.config import TargetConfig
from dspark_jax.models import transformer as tf
from dspark_jax.models.layers import attend

# The slot-major layout's padded query rows (slots x slot_tokens) at most this many times the
# bucket's tokens: measured crossover of the two layouts on the demo's target at 8 and 32 slots
# (benchmarks/verify_layout.py)
SLOT_MAJOR_PAD = 4


def packed_forward(
    cfg: TargetConfig,
    params,
    tokens_T: jax.Array,
    slot_T: jax.Array,
    pos_T: jax.Array,
    valid_T: jax.Array,
    cache: tf.KVCache,
    cache_len: int,
    *,
    compute_logits: bool = True,
    slot_offset_T: jax.Array | None = None,
    slot_tokens: int = 0,
) -> tuple[tf.ForwardOut, tf.KVCache]:
    """Static: cfg, cache_len, compute_logits, slot_tokens, T. Returns ForwardOut with
    [1, T, ...] arrays (logits fp32, features, hidden) and the cache with the valid tokens' K/V
    written (lengths unchanged: the caller commits)."""
    model = tf.build(cfg, params)
    s_max = cache.max_len
    cache_len = min(int(cache_len), s_max)
    x = jnp.take(model.embed_tokens[...], tokens_T, axis=0)[None]  # [1, T, H]
    pos_1xT = pos_T[None].astype(jnp.int32)
    write = jnp.where(valid_T, pos_T, s_max)[None, :]  # [1, T]; s_max -> dropped
    heads = jnp.arange(cfg.num_kv_heads)[:, None]  # [K, 1]
    slot_row = slot_T[None, :]
    key_idx = jnp.arange(cache_len, dtype=jnp.int32)
    mask = (key_idx[None, :] <= pos_T[:, None])[None, :, None, :]  # [1, T, 1, S_b]
    n_slots = cache.k[0].shape[0]
    one_slot = n_slots == 1
    # slot-major pays attention for every slot's G rows; the gather pays a copy per token: the
    # first wins once the padded rows are at most SLOT_MAJOR_PAD x the tokens
    by_slot = (
        not one_slot
        and slot_offset_T is not None
        and n_slots * slot_tokens <= SLOT_MAJOR_PAD * tokens_T.shape[0]
    )
    if by_slot:  # slot-major query layout [N * G] for attention (padding rows see no key)
        g = int(slot_tokens)
        row = jnp.where(valid_T, slot_T * g + slot_offset_T, n_slots * g)  # out of range: dropped
        pos_NG = jnp.full((n_slots * g,), -1, jnp.int32).at[row].set(pos_1xT[0], mode="drop")
        mask_NG = (key_idx[None, :] <= pos_NG[:, None]).reshape(1, n_slots, g, cache_len)
        back = jnp.minimum(row, n_slots * g - 1)  # token t's row (padding tokens: any row)
    feats, new_k, new_v = {}, [], []
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(x), pos_1xT)  # q [1, T, n, d], k/v [1, K, T, d]
        ck, cv = cache.k[i], cache.v[i]  # [N, K, S, d]
        ck = ck.at[slot_row, heads, write].set(k[0].astype(ck.dtype), mode="drop")
        cv = cv.at[slot_row, heads, write].set(v[0].astype(cv.dtype), mode="drop")
        if one_slot:  # every token reads slot 0: no per-token copy of the cache
            a = attend(q, [(ck[:, :, :cache_len], cv[:, :, :cache_len], mask[:, :, 0])])
        elif by_slot:  # slot n's G query rows read slot n's cache in place
            q_g = jnp.zeros((1, n_slots * g) + q.shape[2:], q.dtype)
            q_g = q_g.at[0, row].set(q[0], mode="drop")
            kv = (ck[None, :, :, :cache_len], cv[None, :, :, :cache_len], mask_NG)
            a = attend(q_g, [kv])[:, back]  # [1, T, n*d]
        else:
            kg = ck[:, :, :cache_len][slot_T][None]  # [1, T, K, S_b, d]: token t's own slot
            vg = cv[:, :, :cache_len][slot_T][None]
            a = attend(q, [(kg, vg, mask)])  # [1, T, n*d]; T groups of one query
        x = x + attn.o_proj(a)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        new_k.append(ck)
        new_v.append(cv)
        if i in cfg.target_layer_ids:
            feats[cfg.target_layer_ids.index(i)] = x
    features = jnp.concatenate([feats[j] for j in sorted(feats)], axis=-1)
    hidden = model.norm(x)
    logits = model.logits(hidden) if compute_logits else None
    cache = cache._replace(k=tuple(new_k), v=tuple(new_v))
    return tf.ForwardOut(logits, features, hidden), cache
