"""Gemma 4 targets in the serving engine's forwards and engine (issue 41 item 3).

A tiny random Gemma 4 config with every feature at once (sliding and global layers with their own
head geometry and RoPE, K = V, KV-shared layers, per-layer inputs, experts, soft-capped logits)
and a sliding window shorter than the prompts: the packed forward (slot layout) equals the full
pass of `models.forward` in every attention layout, and the engine's greedy output equals plain
greedy decoding token for token. The paged layout: `test_gemma4_paged.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.config import Gemma4Config, TargetConfig
from dspark_jax.engine import RequestParams, ServingEngine
from dspark_jax.models import transformer as tf
from dspark_jax.models.cache import ring_positions
from dspark_jax.models.generate import generate
from dspark_jax.models.packed import packed_forward, packed_forward_kv, write_kv
from dspark_jax.testing import positions_like, random_params
from tests.engine_models import markov_drafter

S, F = "sliding_attention", "full_attention"
V, WINDOW = 64, 8
TOL = 5e-4  # float reassociation (max seen 2.6e-4 on logits of size ~1; a window off by one: 2.0)


def gemma_config(tie: bool = True, **gemma_kw) -> TargetConfig:
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
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4, tie_word_embeddings=tie,
        max_position_embeddings=512, target_layer_ids=(0, 2, 4), gemma=Gemma4Config(**g),
    )  # fmt: skip


CFG = gemma_config()


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, 0)


def _ring_of(dense, lengths, lookahead):
    """`dense`'s K/V in the engine's layout (`init_cache(lookahead=...)`): each sliding layer's
    ring holds the newest positions below each slot's length at position mod ring size."""
    ring = tf.init_cache(CFG, dense.batch, dense.max_len, lookahead=lookahead)
    rows = jnp.arange(dense.batch)[:, None]

    def put(r, d):
        if r.shape[2] == d.shape[2]:
            return d
        x = ring_positions(jnp.asarray(lengths) - 1, r.shape[2])  # [N, R]
        got = d[rows, :, jnp.maximum(x, 0)].transpose(0, 2, 1, 3)  # [N, K, R, d]
        return jnp.where((x >= 0)[:, None, :, None], got, 0)

    return ring._replace(k=tuple(map(put, ring.k, dense.k)), v=tuple(map(put, ring.v, dense.v)),
                         lengths=dense.lengths)  # fmt: skip


def test_packed_forward_equals_the_full_pass(params):
    """Three slots with committed prefixes of 20, 31 and 26 tokens (> 2 sliding windows) and
    3, 5 and 0 new tokens (plus bucket padding): each valid token's logits and features equal
    the full pass over its slot's whole sequence, in the slot-major and the per-token gather
    layouts, writing or read-only (then `write_kv`), and with the tokens' own K/V read back from
    the cache (`one_set`); a one-slot cache too. Every form on the serving engine's cache (each
    sliding layer a ring of window + 5 entries, which the prefixes wrap), two on the dense one;
    all write the same K/V."""
    rng = np.random.default_rng(1)
    lengths, per_slot, pad = [20, 31, 26], [3, 5, 0], 2
    n, s_max, s_b, g = len(lengths), 48, 40, 5
    seqs = [rng.integers(0, V, size=ln + c) for ln, c in zip(lengths, per_slot)]
    fwd = jax.jit(functools.partial(tf.forward, CFG))
    width = max(map(len, seqs))
    padded = jnp.asarray([np.pad(sq, (0, width - len(sq))) for sq in seqs], jnp.int32)
    full = fwd(params, padded, positions_like(padded))[0]  # the reference: one cache-free pass
    pos_all = positions_like(padded)
    _, cache = fwd(
        params, padded[:, : max(lengths)], pos_all[:, : max(lengths)], tf.init_cache(CFG, n, s_max)
    )  # each slot's prefix (past it: never read)
    cache = cache.with_lengths(lengths)
    ring = _ring_of(cache, lengths, g)
    sliding = [i for i, k in enumerate(ring.k) if k.shape[2] < s_max]
    assert sliding and all(ring.k[i].shape[2] == WINDOW + g for i in sliding)
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

    def check(out, idx, ref_row, ref_t):
        np.testing.assert_allclose(out.logits[0, idx], full.logits[ref_row, ref_t], atol=TOL)
        np.testing.assert_allclose(out.features[0, idx], full.features[ref_row, ref_t], atol=TOL)

    forms = [(g, False, False), (0, False, False), (g, True, False), (0, True, False),
             (g, False, True), (0, False, True)]  # fmt: skip
    outs = {}
    for c0, form in [(ring, f) for f in forms] + [(cache, forms[0]), (cache, forms[3])]:
        out, c = run(*form, c0, toks, slot, pos, valid, off)
        for t in np.flatnonzero(np.asarray(valid)):
            s = int(slot[t])
            check(out, t, s, lengths[s] + int(off[t]))
        outs[form, c0 is ring] = c
    ends = [ln + c for ln, c in zip(lengths, per_slot)]
    want = _ring_of(outs[forms[0], False], ends, g)  # the dense writes, as rings
    for key, c in outs.items():  # every form writes the same K/V
        ref = want if key[1] else outs[forms[0], False]
        for a, b in zip(c.k + c.v, ref.k + ref.v):
            np.testing.assert_allclose(a, b, atol=TOL / 10)
    # one slot (slot 1 alone): the tokens read its cache without the gather
    one = ring._replace(k=tuple(x[1:2] for x in ring.k), v=tuple(x[1:2] for x in ring.v))
    m = np.asarray(slot) == 1
    m &= np.asarray(valid)
    z = jnp.zeros((int(m.sum()),), jnp.int32)
    sel = lambda x: x[jnp.asarray(np.flatnonzero(m))]
    out, _ = run(0, False, False, one, sel(toks), z, sel(pos), sel(valid), sel(off))
    for j, t in enumerate(np.flatnonzero(m)):
        check(out, j, 1, lengths[1] + int(off[t]))


def gemma_pair(gamma=4, mix=0.25, head_scale=8.0, markov_bias=500.0, seed=0):
    """(tcfg, tparams, dcfg, dparams): `engine_models.agreeing_pair` for a Gemma 4 target. The
    target's branches (post norms) are scaled down and its untied head maps each token's own
    embedding direction to `perm[token]`, so its next token is mostly `perm[current]` but the
    context changes it now and then; the drafter (a Gemma-style DSpark drafter of the target:
    `DrafterConfig.layer_config`, soft-capped logits) drafts the permutation chain."""
    tcfg = gemma_config(tie=False)
    tp = jax.tree.map(lambda x: x, random_params(tcfg, seed))
    for layer in tp["layers"].values():
        for name in ("post_attention_layernorm", "post_feedforward_layernorm",
                     "post_per_layer_input_norm"):  # fmt: skip
            w = layer[name]["weight"]
            layer[name]["weight"] = w.replace(w[...] * mix)
        layer["layer_scalar"] = layer["layer_scalar"].replace(1.0 + layer["layer_scalar"][...])
    tp["norm"]["weight"] = tp["norm"]["weight"].replace(jnp.ones_like(tp["norm"]["weight"][...]))
    perm = np.random.default_rng(seed).permutation(V)
    emb = np.asarray(tf.embedding_table(tp))
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    head = np.zeros((tcfg.hidden_size, V), np.float32)
    head[:, perm] = (unit * head_scale).T
    tp["lm_head"]["kernel"] = tp["lm_head"]["kernel"].replace(jnp.asarray(head))
    dcfg, dp = markov_drafter(tcfg, tp, perm, gamma, markov_bias, seed)
    return tcfg, tp, dcfg, dp


G = 4
PROMPT_LENS, MAX_NEW = [20, 33, 27, 40, 24], [30, 18, 25, 12, 22]  # prompts > 2 windows


@pytest.fixture(scope="module")
def pair():
    return gemma_pair(gamma=G)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [[int(t) for t in rng.integers(0, V - 1, size=n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def refs(pair, prompts):
    tcfg, tp, _, _ = pair
    return [generate(tcfg, tp, [p], max_new_tokens=m)[0] for p, m in zip(prompts, MAX_NEW)]


def _engine(pair, mode, **kw):
    """Sliding layers keep rings of WINDOW + G + 1 = 13 entries; prompt chunks of 16 wrap them."""
    tcfg, tp, dcfg, dp = pair
    kw = {"token_buckets": (8, 15), "kv_layout": "slots", **kw}  # the rings: slot layout
    return ServingEngine(
        tcfg, dcfg, tp, dp, num_slots=3, max_len=80, prompt_buckets=(16,), cache_buckets=(80,),
        modes=(mode,), **kw,
    )  # fmt: skip


def test_engine_greedy_equals_plain_decoding(pair, prompts, refs):
    """Five requests on three slots (prompts of 20-40 tokens, chunked prefill, later arrivals
    into freed slots): the engine's greedy output equals `models.generate` token for token, with
    drafts accepted and rejected (the target leaves the drafter's chain where its context says)."""
    eng = _engine(pair, "greedy")
    cache = eng.programs.state.cache  # the sliding layers computing K/V keep rings
    assert [k.shape[2] for k in cache.k] == [WINDOW + G + 1, WINDOW + G + 1, 80, WINDOW + G + 1]
    assert eng.memory_plan.target_kv == sum(x.nbytes for x in jax.tree.leaves(cache))
    handles = []
    for k, (p, m) in enumerate(zip(prompts, MAX_NEW)):
        handles.append(eng.submit(p, RequestParams(m, temperature=0.0)))
        if k % 2:
            eng.step()
    while eng.has_work():
        eng.step()
    outs = [h.result() for h in handles]
    for out, ref in zip(outs, refs):
        assert out.tokens == ref
    perm = np.random.default_rng(0).permutation(V)  # gemma_pair's chain (seed 0)
    chain = [perm[a] == b for p, r in zip(prompts, refs) for a, b in zip([p[-1]] + r, r)]
    assert 0.5 < np.mean(chain) < 0.95  # the context changes the target's next token now and then
    assert sum(map(len, refs)) / sum(o.stats.rounds for o in outs) > 1.5  # drafts accepted
    assert sum(sum(o.num_accepted) for o in outs) < sum(sum(o.proposed) for o in outs)


def test_sampled_mode_greedy_row_and_neighbour_independence(pair, prompts, refs):
    """On an engine compiled for temperature sampling, three rounds per call (verify forwards that
    only read the cache, then `write_kv`, and the one-key-set form): a T = 0 request equals
    greedy decoding, and a sampled request's output does not depend on its neighbours (draws
    keyed by seed and position)."""
    eng = _engine(pair, "sampled", rounds_per_call=3, token_buckets=(15,))
    p = RequestParams(16, temperature=0.9, seed=11)
    alone = eng.generate([prompts[1]], p)[0].tokens
    h = [eng.submit(prompts[0], RequestParams(MAX_NEW[0], temperature=0.0)),
         eng.submit(prompts[2], RequestParams(20, temperature=1.2, seed=3))]  # fmt: skip
    eng.step()
    mine = eng.submit(prompts[1], p)
    while eng.has_work():
        eng.step()
    assert mine.result().tokens == alone
    assert h[0].result().tokens == refs[0]
