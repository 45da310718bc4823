"""Drafter training batches: what `losses.loss_fn` and the train steps take, built from token ids
and the frozen target (its features computed here, as the online feature mode does).

    batch = drafter_batch(target_cfg, target_params, input_ids_BxL, loss_mask_BxL)
    batch = batch_from_samples(target_cfg, target_params, samples)   # TokenizedSamples, padded

The batch (the contract of `losses.loss_fn`): `input_ids` int32 [B, L], `loss_mask` and
`attention_mask` uint8 [B, L] (right-padded; padding has both 0), `target_features` [B, L, m*H]
(raw outputs of `target_cfg.target_layer_ids`) and `target_hidden` [B, L, H] (the final-normed
last hidden state), in the target's dtype. Padding never changes a real token's features
(causal attention, positions 0..L-1).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.config import TargetConfig
from dspark_jax.train.data import TokenizedSample
from dspark_jax.train.features import target_features_jit
from dspark_jax.train.loader import InMemorySource, MicroBatch, load_rows

Batch = dict[str, jax.Array]


def drafter_batch(
    target_cfg: TargetConfig,
    target_params,
    input_ids_BxL,
    loss_mask_BxL,
    attention_mask_BxL=None,
) -> Batch:
    """The loss batch of token ids [B, L] and their loss mask [B, L] (> 0.5 = supervised; it is
    cleared where `attention_mask` is 0, default: every token is real). ValueError (one line)
    for shapes or ids that do not fit the target."""
    ids = np.asarray(input_ids_BxL)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must be integer [B, L], got {ids.dtype} {ids.shape}")
    if ids.size and not 0 <= ids.min() <= ids.max() < target_cfg.vocab_size:
        raise ValueError(
            f"input_ids hold ids in [{ids.min()}, {ids.max()}], outside the target's vocabulary "
            f"[0, {target_cfg.vocab_size}) — tokenize with the target's tokenizer"
        )
    am = np.ones(ids.shape, np.uint8) if attention_mask_BxL is None else attention_mask_BxL
    am = (np.asarray(am) > 0.5).astype(np.uint8)
    lm = np.asarray(loss_mask_BxL)
    for name, x in (("loss_mask", lm), ("attention_mask", am)):
        if x.shape != ids.shape:
            raise ValueError(f"{name} has shape {x.shape}; it must match input_ids {ids.shape}")
    ids_BxL = jnp.asarray(ids, jnp.int32)
    feats, hidden = target_features_jit(target_cfg, target_params, ids_BxL)
    return {
        "input_ids": ids_BxL,
        "loss_mask": jnp.asarray((lm > 0.5) & (am > 0), jnp.uint8),
        "attention_mask": jnp.asarray(am),
        "target_features": feats,
        "target_hidden": hidden,
    }


def batch_from_samples(
    target_cfg: TargetConfig,
    target_params,
    samples: Sequence[TokenizedSample],
    *,
    length: int | None = None,
    pad_id: int = 0,
) -> Batch:
    """The loss batch of `TokenizedSample`s, right-padded with `pad_id` to `length` (default: the
    longest sample; pass a bucket length to keep one compiled shape), collated as the trainer's
    loader does."""
    if not samples:
        raise ValueError("batch_from_samples needs at least one sample")
    longest = max(len(s) for s in samples)
    length = longest if length is None else int(length)
    if length < longest:
        raise ValueError(
            f"a sample has {longest} tokens, more than length={length} — raise length or "
            "truncate the samples"
        )
    mb = MicroBatch(np.arange(len(samples)), length)
    rows = load_rows(InMemorySource(samples), mb, pad_id=pad_id)
    return drafter_batch(
        target_cfg, target_params, rows["input_ids"], rows["loss_mask"], rows["attention_mask"]
    )


__all__ = ["Batch", "batch_from_samples", "drafter_batch"]
