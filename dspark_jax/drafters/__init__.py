"""Drafters: DSpark (DFlash backbone + Markov + confidence heads), DFlash, Eagle3.

One interface for all three, dispatched on the static `DrafterConfig.kind`.

Parameters (`DrafterParams`, a NamedTuple of two `nnx.State`s):
  * `trainable` — every `nnx.Param`: fc, hidden_norm, layers.*, norm, markov_head.*,
    confidence_head.* (Eagle3: fc, layers.0.*, norm). The optimizer sees only this.
  * `frozen` — the `FrozenParam` leaves `embed_tokens` [V, H] and `lm_head` [H, V] (kernel layout,
    [in, out]): frozen copies of the target's embedding and output head (docs/METHOD.md §2.1). Build
    it with `frozen_from_target(cfg, target_params)`; it is never differentiated or updated.
  Split a built module yourself with `nnx.split(module, nnx.Param, FrozenParam)`.

Training (pure): `dspark_jax.train.losses.loss_fn(cfg, trainable, frozen, batch, rng)` is the
one entry point (anchor sampling, labels, target logits, loss, metrics). Its pieces:
  * DSpark/DFlash (`dspark.py`): `BlockDrafter.context_kv(features, positions)` once per
    sequence (per layer K/V [B, n_kv, T, d_h], heads-first like every cache), then
    `BlockDrafter.blocks(ctx_kv, anchors, keep, block_ids, positions)` -> z [B, N_a, γ, H] for
    N_a anchor blocks at once (anchor-bounded packing, docs/METHOD.md §2.5), then
    `dspark.teacher_forced(model, z, prev_ids)` -> corrected logits and confidence logits.
  * Eagle3: `eagle3.ttt_hidden(model, features, input_ids, valid_len)` -> the γ steps of the
    training-time test (docs/METHOD.md §5.2); logits = `model.logits(g)`.
  Get the module with `build(cfg, params)`.

Inference (pure, jit-able; `cfg` and `scfg` static, everything else arrays):
  * `init_context(cfg, batch, max_len)` -> empty drafter context state (its own KV cache).
  * `extend_context(cfg, params, ctx, features[B,T,m*H], next_tokens[B,T], num_new[B])` -> ctx:
    append the target features of committed positions `ctx.lengths + t` (t < num_new[b]);
    `next_tokens[b, t]` is the committed token at position `ctx.lengths + t + 1` (only Eagle3
    reads it: it pairs feature t with token t+1). Prefill = `extend_context` on an empty context
    with the prompt's features and `next_tokens = prompt[1:] + [first sampled token]`.
    After a verify round with A accepted drafts: features of positions start..start+A and
    next_tokens = [d_1..d_A, new_anchor], num_new = A + 1.
  * `propose(cfg, params, ctx, anchor[B], key, seeds[B], sampling, scfg)` -> Proposal:
    tokens [B, γ] int32, probs [B, γ, V] fp32 (the exact distribution each token was drawn
    from, after the sampling transform), conf_logits [B, γ] fp32 (None for DFlash/Eagle3).
    The anchor sits at position `ctx.lengths`; the draft token of slot k at `ctx.lengths + k + 1`
    and is drawn with `spec.rng.position_keys(key, DRAFT, seeds, position)`, so a request's
    draft does not depend on the batch it shares. `sampling`/`scfg` are the target's
    `spec.sampling` knobs (same transform). `propose` never writes the context: rejected drafts
    need no rollback.
"""

from __future__ import annotations

from dspark_jax.drafters.api import (
    build,
    extend_context,
    frozen_from_target,
    graphdef,
    init_context,
    init_params,
    narrow_context_window,
    prefill_context,
    propose,
    share_target_tables,
)
from dspark_jax.drafters.common import (
    DrafterParams,
    FrozenParam,
    Proposal,
)

__all__ = [
    "DrafterParams",
    "FrozenParam",
    "Proposal",
    "build",
    "extend_context",
    "frozen_from_target",
    "graphdef",
    "init_context",
    "init_params",
    "narrow_context_window",
    "prefill_context",
    "propose",
    "share_target_tables",
]
