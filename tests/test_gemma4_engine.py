"""Gemma 4 targets in the serving engine's forwards and engine (issue 41 item 3).

A tiny random Gemma 4 config with every feature at once (sliding and global layers with their own
head geometry and RoPE, K = V, KV-shared layers, per-layer inputs, experts, soft-capped logits)
and a sliding window shorter than the prompts: the packed forward (slot layout) equals the full
pass of `models.forward` in every attention layout, and the engine's greedy output equals plain
greedy decoding token for token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.config import Gemma4Config, TargetConfig
from dspark_jax.models import transformer as tf
from dspark_jax.models.packed import packed_forward, packed_forward_kv, write_kv
from dspark_jax.testing import positions_like, random_params

S, F = "sliding_attention", "full_attention"
V, WINDOW = 64, 8
TOL = 5e-4  # float reassociation (max seen 2.6e-4 on logits of size ~1; a window off by one: 2.0)


def gemma_config(**gemma_kw) -> TargetConfig:
    g = dict(
        layer_types=(S, S, F, S, S, F),
        sliding_window=WINDOW,
        global_head_dim=32,
        global_kv_heads=1,
        k_eq_v=True,
        global_rope_theta=1e5,
        global_rope_fraction=0.5,
        final_logit_softcapping=10.0,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=V,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    )
    g.update(gemma_kw)
    return TargetConfig(
        architecture="gemma4", vocab_size=V, hidden_size=64, intermediate_size=96, num_layers=6,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4, tie_word_embeddings=True,
        max_position_embeddings=512, target_layer_ids=(0, 2, 4), gemma=Gemma4Config(**g),
    )  # fmt: skip


CFG = gemma_config()


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, 0)


def test_packed_forward_equals_the_full_pass(params):
    """Three slots with committed prefixes of 20, 31 and 26 tokens (> 2 sliding windows) and
    3, 5 and 0 new tokens (plus bucket padding): each valid token's logits and features equal
    the full pass over its slot's whole sequence, in the slot-major and the per-token gather
    layouts, writing or read-only (then `write_kv`), and with the tokens' own K/V read back from
    the cache (`one_set`); a one-slot cache too."""
    rng = np.random.default_rng(1)
    lengths, per_slot, pad = [20, 31, 26], [3, 5, 0], 2
    n, s_max, s_b, g = len(lengths), 48, 40, 5
    seqs = [rng.integers(0, V, size=ln + c) for ln, c in zip(lengths, per_slot)]
    full = []  # the reference: each slot's sequence in one cache-free pass
    for sq in seqs:
        toks = jnp.asarray(sq, jnp.int32)[None]
        full.append(tf.forward(CFG, params, toks, positions_like(toks))[0])
    cache = tf.init_cache(CFG, n, s_max)
    for i, (sq, ln) in enumerate(zip(seqs, lengths)):  # each slot's prefix through the cache
        one = tf.init_cache(CFG, 1, s_max)
        toks = jnp.asarray(sq[:ln], jnp.int32)[None]
        _, one = tf.forward(CFG, params, toks, positions_like(toks), one)
        put = functools.partial(lambda i, c, o: c.at[i].set(o[0]), i)
        cache = cache._replace(k=tuple(map(put, cache.k, one.k)), v=tuple(map(put, cache.v, one.v)))
    cache = cache.with_lengths(lengths)
    slot = np.concatenate([np.full(c, i) for i, c in enumerate(per_slot)] + [np.zeros(pad)])
    off = np.concatenate([np.arange(c) for c in per_slot] + [np.zeros(pad)])
    valid = np.arange(len(slot)) < sum(per_slot)
    toks = np.concatenate([sq[ln:] for sq, ln in zip(seqs, lengths)] + [np.zeros(pad)])
    slot, off = jnp.asarray(slot, jnp.int32), jnp.asarray(off, jnp.int32)
    pos = jnp.asarray(lengths)[slot] + off
    toks, valid = jnp.asarray(toks, jnp.int32), jnp.asarray(valid)

    @functools.partial(jax.jit, static_argnums=(0, 1, 2))
    def run(slot_tokens, read_only, one_set, cache, toks, slot, pos, valid, off):
        args = (CFG, params, toks, slot, off, pos, valid, cache, s_b)
        if read_only:
            out, kv = packed_forward_kv(*args, slot_tokens=slot_tokens)
            return out, write_kv(cache, kv)
        return packed_forward(*args, slot_tokens=slot_tokens, one_set=one_set)

    def check(out, idx, ref, ref_t):
        np.testing.assert_allclose(out.logits[0, idx], ref.logits[0, ref_t], atol=TOL)
        np.testing.assert_allclose(out.features[0, idx], ref.features[0, ref_t], atol=TOL)

    outs = {}
    for form in [(g, False, False), (0, False, False), (g, True, False), (0, True, False),
                 (g, False, True), (0, False, True)]:  # fmt: skip
        out, c = run(*form, cache, toks, slot, pos, valid, off)
        for t in np.flatnonzero(np.asarray(valid)):
            s = int(slot[t])
            check(out, t, full[s], lengths[s] + int(off[t]))
        outs[form] = c
    for c in outs.values():  # every form writes the same K/V
        for a, b in zip(c.k + c.v, outs[(0, False, False)].k + outs[(0, False, False)].v):
            np.testing.assert_allclose(a, b, atol=TOL / 10)
    # one slot (slot 1 alone): the tokens read its cache without the gather
    one = cache._replace(k=tuple(x[1:2] for x in cache.k), v=tuple(x[1:2] for x in cache.v))
    m = np.asarray(slot) == 1
    m &= np.asarray(valid)
    z = jnp.zeros((int(m.sum()),), jnp.int32)
    sel = lambda x: x[jnp.asarray(np.flatnonzero(m))]
    out, _ = run(0, False, False, one, sel(toks), z, sel(pos), sel(valid), sel(off))
    for j, t in enumerate(np.flatnonzero(m)):
        check(out, j, full[1], lengths[1] + int(off[t]))
