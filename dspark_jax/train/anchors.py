"""Anchor sampling, block inputs, labels and the evaluation mask (docs/METHOD.md §2.3, §2.6–2.8).

All functions are pure and jit-able; `num_anchors`, `block_size` and `mask_token_id` are static.
Conventions for one sequence of length L and N anchor blocks of γ slots:
  * candidates: i in [0, L−2] with loss_mask[i] and loss_mask[i+1] (the anchor is itself a
    supervised token and so is its first label);
  * n = min(#candidates, N) anchors drawn uniformly without replacement, sorted ascending;
    slots j >= n are dummy blocks: anchor 0, keep = False, slot-0 token = mask token;
  * block j slot k: input token x_{a_j} (k = 0) or the mask token, position a_j + k,
    label x_{a_j+k+1} (index clamped to L−1; dummy blocks index 0), previous token
    (teacher forcing) x_{a_j+k};
  * eval_mask[j, k] = keep_j ∧ (a_j+k+1 < L) ∧ loss_mask[a_j+k+1], made prefix-contiguous along k;
  * the aligned target logits of slot k come from the target's final hidden at a_j + k
    (`target_pos`; the target's prediction of x_{a_j+k+1}).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class AnchorBlocks(NamedTuple):
    anchors: jax.Array  # [B, N] int32 anchor positions (dummy blocks: 0)
    keep: jax.Array  # [B, N] bool, False for dummy blocks
    block_ids: jax.Array  # [B, N, γ] int32 inputs: anchor token, then mask tokens
    positions: jax.Array  # [B, N, γ] int32 a_j + k
    target_ids: jax.Array  # [B, N, γ] int32 labels x_{a_j+k+1}
    prev_ids: jax.Array  # [B, N, γ] int32 teacher-forced previous tokens x_{a_j+k}
    eval_mask: jax.Array  # [B, N, γ] bool, prefix-contiguous supervision
    target_pos: jax.Array  # [B, N, γ] int32 where the target's prediction for the label lives


def anchor_candidates(loss_mask_BxL: jax.Array) -> jax.Array:
    """[B, L] bool: position i may be an anchor (mask[i] and mask[i+1]; never the last)."""
    m = loss_mask_BxL > 0.5 if loss_mask_BxL.dtype != jnp.bool_ else loss_mask_BxL
    nxt = jnp.concatenate([m[:, 1:], jnp.zeros_like(m[:, :1])], axis=1)
    return m & nxt


def sample_anchors(key: jax.Array, loss_mask_BxL: jax.Array, num_anchors: int):
    """(anchors [B, N] int32 sorted ascending with dummies (0) last, keep [B, N] bool).

    Uniform without replacement among the candidates, independently per row.
    """
    b, seq = loss_mask_BxL.shape
    cand = anchor_candidates(loss_mask_BxL)
    count = cand.sum(axis=1)
    u = jax.random.uniform(key, (b, seq))
    u = jnp.where(cand, u, 2.0)
    order = jnp.argsort(u, axis=1)[:, :num_anchors].astype(jnp.int32)
    if order.shape[1] < num_anchors:
        pad = jnp.full((b, num_anchors - order.shape[1]), seq + 1, jnp.int32)
        order = jnp.concatenate([order, pad], axis=1)
    j = jnp.arange(num_anchors)[None, :]
    keep = j < jnp.minimum(count, num_anchors)[:, None]
    # the first n entries of `order` are exactly the chosen candidates; sort them, dummies last
    chosen = jnp.sort(jnp.where(keep, order, seq + 1), axis=1)
    anchors = jnp.where(keep, chosen, 0).astype(jnp.int32)
    return anchors, keep


def make_blocks(
    input_ids_BxL: jax.Array,
    loss_mask_BxL: jax.Array,
    anchors_BxN: jax.Array,
    keep_BxN: jax.Array,
    block_size: int,
    mask_token_id: int,
) -> AnchorBlocks:
    """Block inputs, positions, labels, previous tokens and the evaluation mask."""
    b, seq = input_ids_BxL.shape
    m = loss_mask_BxL > 0.5 if loss_mask_BxL.dtype != jnp.bool_ else loss_mask_BxL
    k = jnp.arange(block_size, dtype=jnp.int32)[None, None, :]
    a = anchors_BxN[:, :, None]
    keep = keep_BxN[:, :, None]
    label_idx = a + k + 1
    safe = jnp.where(keep, jnp.minimum(label_idx, seq - 1), 0)
    take = jax.vmap(lambda row, idx: row[idx])
    target_ids = take(input_ids_BxL, safe)
    anchor_tok = jnp.take_along_axis(input_ids_BxL, anchors_BxN, axis=1)
    prev_ids = jnp.concatenate([anchor_tok[:, :, None], target_ids[:, :, :-1]], axis=-1)
    first = jnp.where(keep_BxN, anchor_tok, mask_token_id)
    block_ids = jnp.full(target_ids.shape, mask_token_id, jnp.int32).at[:, :, 0].set(first)
    ok = keep & (label_idx < seq) & take(m, safe)
    eval_mask = jnp.cumprod(ok.astype(jnp.int32), axis=-1).astype(bool)
    positions = a + k
    target_pos = jnp.maximum(safe - 1, 0)
    return AnchorBlocks(
        anchors_BxN.astype(jnp.int32),
        keep_BxN,
        block_ids.astype(jnp.int32),
        positions.astype(jnp.int32),
        target_ids.astype(jnp.int32),
        prev_ids.astype(jnp.int32),
        eval_mask,
        target_pos.astype(jnp.int32),
    )
