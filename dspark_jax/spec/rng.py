"""The randomness convention: every draw is keyed by (stream, request seed, position).

    key(stream, seed, position) = fold_in(fold_in(fold_in(root, stream), seed), position)

``root`` is one PRNG key for the whole engine (typed ``jax.random.key`` or raw ``PRNGKey``);
``seed`` is the request's seed (uint32 range); ``position`` is the absolute sequence position of
the token the draw is about. The convention of docs/ARCHITECTURE.md §4.4,
``fold_in(fold_in(key, request_seed), position)``, is this with ``key = stream_key(root, stream)``.

Streams (one per kind of draw, so no two draws ever share a key):

* ``SAMPLE`` (0): the target's token at ``position`` - plain autoregressive decoding, and the
  correction / bonus token of a speculative round. A round that verifies no drafts therefore
  reproduces plain decoding exactly (same key, same distribution, Gumbel-max sampler) when plain
  decoding is keyed with ``stream_key(root, SAMPLE)`` (e.g. ``models.generate`` folds seed and
  position into whatever key it is given: pass it ``stream_key(root, SAMPLE)``).
* ``DRAFT`` (1): the drafter's proposal at ``position``.
* ``ACCEPT`` (2): the uniform that accepts or rejects the draft at ``position``.
* ``DRAFT_ROUND`` (3): the drafter's proposal at ``position`` in the request's round ``r``
  (``key = fold_in(fold_in(fold_in(stream_key(root, 3), seed), r), position)``). The serving
  engine uses it: a position drafted in round ``r`` and not committed is re-drafted in a later
  round with fresh noise, so an admission decided from round ``r``'s confidences (the async
  scheduler's stale capacity) cannot correlate with the value a later round draws.

Why this matters for correctness:

* a request's draws depend only on its own seed and positions, never on its slot, on the other
  requests in the batch or on padding - so results are reproducible across batch compositions;
* the draft token, its acceptance uniform and the resampled token use disjoint streams, so they
  are independent, which the proof of lossless speculative sampling requires.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

SAMPLE = 0
DRAFT = 1
ACCEPT = 2
DRAFT_ROUND = 3

__all__ = [
    "SAMPLE",
    "DRAFT",
    "ACCEPT",
    "DRAFT_ROUND",
    "RequestRng",
    "stream_key",
    "position_keys",
    "round_position_keys",
]


class RequestRng(NamedTuple):
    """Per-request randomness for one round (a pytree of arrays; nothing static).

    Attributes:
      key: the engine's root key (shared by all requests).
      seeds: ``[B]`` int32/uint32 request seeds.
      positions: ``[B]`` int32 absolute position of each request's anchor (its last committed
        token). Draft slot ``i`` (0-based) is the token at ``positions + 1 + i``.
    """

    key: jax.Array
    seeds: jax.Array  # [B]
    positions: jax.Array  # [B]


def stream_key(root: jax.Array, stream: int) -> jax.Array:
    """The key of one stream (``SAMPLE``, ``DRAFT`` or ``ACCEPT``)."""
    return jax.random.fold_in(root, stream)


def position_keys(root: jax.Array, stream: int, seeds: jax.Array, positions: jax.Array):
    """Keys for ``(seed, position)`` pairs: seeds ``[B]``, positions ``[B]`` or ``[B, N]``.

    Returns a key array shaped like ``positions``. Traceable.
    """
    key = stream_key(root, stream)
    seeds = jnp.asarray(seeds).astype(jnp.uint32)
    positions = jnp.asarray(positions).astype(jnp.uint32)

    def one(seed, position):
        return jax.random.fold_in(jax.random.fold_in(key, seed), position)

    if positions.ndim == 1:
        return jax.vmap(one)(seeds, positions)
    return jax.vmap(jax.vmap(one, in_axes=(None, 0)))(seeds, positions)


def round_position_keys(root: jax.Array, seeds: jax.Array, rounds: jax.Array, positions):
    """DRAFT_ROUND keys for ``(seed, round, position)``: seeds and rounds ``[B]``, positions
    ``[B, N]``. Returns ``[B, N]`` keys. Traceable."""
    key = stream_key(root, DRAFT_ROUND)
    seeds = jnp.asarray(seeds).astype(jnp.uint32)
    rounds = jnp.asarray(rounds).astype(jnp.uint32)
    positions = jnp.asarray(positions).astype(jnp.uint32)

    def row(seed, rnd, pos_N):
        k = jax.random.fold_in(jax.random.fold_in(key, seed), rnd)
        return jax.vmap(lambda p: jax.random.fold_in(k, p))(pos_N)

    return jax.vmap(row)(seeds, rounds, positions)
