"""The target's forward output and dense KV cache types, shared by every target family
(`transformer.py`, `gemma4.py`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class ForwardOut(NamedTuple):
    logits: jax.Array | None  # [B, T, V] fp32 (None when compute_logits=False)
    features: jax.Array  # [B, T, m*H] raw outputs of cfg.target_layer_ids, concatenated in order
    hidden: jax.Array  # [B, T, H] final-normed last hidden state


def outputs(model, x, feats, compute_logits: bool) -> ForwardOut:
    """The forward's outputs from the last layer's `x` and the feature layers' (index, x) pairs:
    the features in `target_layer_ids` order, the final norm, the logits (`model.norm`,
    `model.logits`)."""
    features = jnp.concatenate([f for _, f in sorted(feats, key=lambda t: t[0])], axis=-1)
    hidden = model.norm(x)
    return ForwardOut(model.logits(hidden) if compute_logits else None, features, hidden)


class KVCache(NamedTuple):
    """Per-layer K and V [B, n_kv, S, d_h] and committed lengths [B] (int32).

    One entry per layer that computes K/V: every layer of `transformer.py`; in Gemma 4 the first
    `num_layers - num_kv_shared_layers` layers (the KV-shared ones read those), with each layer's
    own n_kv and d_h (its global layers have their own head geometry).

    A Gemma 4 sliding layer's entry may be a ring of R < max_len entries (the serving engine's,
    `gemma4.ring_len`): position p lives at index p mod R, and the positions an entry holds are
    read off `ring_positions`. With R = max_len the ring is the dense layout (p at index p)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        """Positions per slot: the longest entry's (a sliding layer's ring may be shorter)."""
        return max(k.shape[2] for k in self.k)

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    def with_lengths(self, lengths) -> KVCache:
        """Commit / roll back: only the length moves, K/V past it are simply never read."""
        return self._replace(lengths=jnp.asarray(lengths, jnp.int32))


def ring_positions(top_X: jax.Array, size: int) -> jax.Array:
    """[X, size]: the position each entry of a ring of `size` entries holds when `top` is the
    newest position written and every position before it was written in order (an entry not
    written yet, or a row with top < 0: a negative position). For `size` past top this is the
    dense layout: entry j holds position j for j <= top."""
    j = jnp.arange(size, dtype=jnp.int32)[None, :]
    top = top_X[:, None].astype(jnp.int32)
    return top - jnp.mod(top - j, size)


def ring_index(pos_X: jax.Array, size: int, max_len: int) -> jax.Array:
    """Where position `pos` is written in a ring of `size` entries: pos mod size, and `size`
    (out of range: the write is dropped) for positions >= `max_len` (padding)."""
    return jnp.where(pos_X < max_len, jnp.mod(pos_X, size), size).astype(jnp.int32)
