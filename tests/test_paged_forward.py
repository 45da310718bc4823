"""The paged target forward == the dense `transformer.forward`, request by request: a packed
prefill of three prompts of different lengths, then packed multi-request steps (decode, a
verify whose tail is rejected and overwritten, a prefill chunk), pages interleaved in the pool."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models import transformer as tf
from dspark_jax.models.paged import (
    init_paged_cache,
    paged_forward_jit,
    paged_forward_kv_jit,
    write_new_kv,
)
from dspark_jax.testing import CompileCounter, random_params, tiny_target_config

CFG = tiny_target_config()
PAGE, B, P = 4, 8, 30  # a request holds up to 32 positions
PROMPTS = (5, 11, 17)
# per step: (new tokens, tokens then committed) per request; a rejected tail is overwritten
STEPS = [
    ((1, 1, 1), (1, 1, 1)),
    ((4, 0, 2), (2, 0, 2)),  # request 0 keeps 2 of 4 (its last 2 K/V become garbage)
    ((3, 5, 1), (3, 5, 1)),  # request 1: a prefill chunk
    ((5, 2, 5), (1, 2, 5)),
    ((1, 1, 1), (1, 1, 1)),
]


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, 3)


def _dense_step(params, caches, r, toks, start):
    pos = jnp.arange(start, start + len(toks), dtype=jnp.int32)[None]
    out, caches[r] = tf.forward_jit(CFG, params, jnp.asarray([toks], jnp.int32), pos, caches[r])
    return np.asarray(out.logits[0])


@pytest.mark.parametrize("q_per_req", [0, 17])
def test_paged_forward_equals_dense_forward(params, q_per_req):
    rng = np.random.default_rng(0)
    r = len(PROMPTS)
    tables = jnp.asarray(rng.permutation(P)[: r * B].reshape(r, B), jnp.int32)  # interleaved
    cache = init_paged_cache(CFG, P, PAGE)
    dense = [tf.init_cache(CFG, 1, B * PAGE) for _ in range(r)]
    committed = [0] * r
    steps = [(PROMPTS, PROMPTS)] + STEPS
    worst, programs = 0.0, 0
    for i, (new, keep) in enumerate(steps):
        t_bucket = 40 if i == 0 else 16
        toks = [rng.integers(0, CFG.vocab_size, n).tolist() for n in new]
        flat = sum(toks, []) + [0] * (t_bucket - sum(new))
        cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
        kv = np.asarray([c + n for c, n in zip(committed, new)], np.int32)
        with CompileCounter() as cc:
            out, cache = paged_forward_jit(
                CFG, params, np.asarray(flat, np.int32), cu, kv, tables, cache,
                q_per_req=q_per_req,
            )  # fmt: skip
            got = np.asarray(out.logits)[0]
        programs += cc.count
        for j in range(r):
            if new[j]:
                want = _dense_step(params, dense, j, toks[j], committed[j])
                diff = np.abs(got[cu[j] : cu[j + 1]] - want).max()
                worst = max(worst, float(diff))
            committed[j] += keep[j]
    print(f"paged vs dense logits, q_per_req={q_per_req}: max abs diff {worst:.3g}")
    assert worst <= 1e-5, worst
    assert programs == 2  # one per token bucket: new lengths and contents never retrace


def test_paged_forward_features_and_padding(params):
    """Features equal the dense ones; padding tokens write nothing to the pool."""
    cache = init_paged_cache(CFG, P, PAGE)
    tables = jnp.asarray(np.arange(2 * B).reshape(2, B)[::-1].copy(), jnp.int32)
    toks = jnp.asarray([7, 8, 9, 10, 11, 0, 0, 0], jnp.int32)
    cu = jnp.asarray([0, 3, 5], jnp.int32)
    kv = jnp.asarray([3, 2], jnp.int32)
    before = [np.asarray(k) for k in cache.k]
    out, cache = paged_forward_jit(CFG, params, toks, cu, kv, tables, cache)
    written = {int(tables[0, 0]), int(tables[1, 0])}
    for k0, k1 in zip(before, cache.k):
        changed = {p for p in range(P) if not np.array_equal(k0[p], np.asarray(k1[p]))}
        assert changed == written
    d_out, _ = tf.forward_jit(
        CFG, params, toks[None, :3], jnp.arange(3)[None], tf.init_cache(CFG, 1, 8)
    )
    np.testing.assert_allclose(np.asarray(out.features[0, :3]), d_out.features[0], atol=1e-5)


def test_a_wrong_block_table_is_caught(params):
    """The equality above can fail: a decode step reading another request's pages differs."""
    cache = init_paged_cache(CFG, P, PAGE)
    tables = np.arange(2 * B, dtype=np.int32).reshape(2, B)
    rng = np.random.default_rng(1)
    toks = rng.integers(0, CFG.vocab_size, 16).astype(np.int32)
    cu, kv = np.asarray([0, 8, 16], np.int32), np.asarray([8, 8], np.int32)
    _, cache = paged_forward_jit(CFG, params, toks, cu, kv, tables, cache)
    step = np.asarray([5, 6], np.int32)
    cu1, kv1 = np.asarray([0, 1, 2], np.int32), np.asarray([9, 9], np.int32)
    right, cache = paged_forward_jit(CFG, params, step, cu1, kv1, tables, cache)
    wrong, _ = paged_forward_jit(CFG, params, step, cu1, kv1, tables[::-1].copy(), cache)
    assert np.abs(np.asarray(right.logits) - np.asarray(wrong.logits)).max() > 1e-3


def test_allocator_driven_rounds_with_preemption_and_recompute(params):
    """`PagePool` drives the tables: three requests grow by 1-3 tokens a round in a pool too
    small for all of them; the newest is preempted and later recomputes its whole history into
    fresh pages. Every round's logits equal a cache-free forward of each request's history."""
    from dspark_jax.engine.pages import PagePool

    rng = np.random.default_rng(2)
    pool, rows, t_bucket, max_len = PagePool(12, PAGE, table_buckets=(B,)), 3, 40, B * PAGE
    hist = {r: rng.integers(0, CFG.vocab_size, 3 + 4 * r).tolist() for r in range(rows)}
    waiting, fresh = list(range(rows)), set()
    cache, worst, preempted, finished = init_paged_cache(CFG, 12, PAGE), 0.0, 0, 0
    for _ in range(100):
        new = {r: 0 for r in range(rows)}
        for r in pool.running:
            new[r] = int(rng.integers(1, 4))
        for v in pool.reserve({r: len(hist[r]) + n for r, n in new.items() if r in pool}):
            waiting.append(v)
            new[v] = 0
            preempted += 1
        while waiting and pool.can_admit(len(hist[waiting[0]])):
            r = waiting.pop(0)
            pool.admit(r, len(hist[r]))
            fresh.add(r)
        for r in range(rows):
            if r in fresh:  # (re)computed: its whole history is this round's prefill
                new[r], fresh = len(hist[r]), fresh - {r}
            elif new[r]:
                hist[r] += rng.integers(0, CFG.vocab_size, new[r]).tolist()
        toks = sum((hist[r][len(hist[r]) - new[r] :] for r in range(rows)), [])
        cu = np.concatenate([[0], np.cumsum([new[r] for r in range(rows)])]).astype(np.int32)
        kv = np.asarray([len(hist[r]) if r in pool else 0 for r in range(rows)], np.int32)
        tables = pool.block_tables([r if r in pool else None for r in range(rows)])
        toks = np.asarray(toks + [0] * (t_bucket - len(toks)), np.int32)
        out, cache = paged_forward_jit(CFG, params, toks, cu, kv, tables, cache)
        got = np.asarray(out.logits)[0]
        for r in range(rows):
            if new[r]:
                ids = np.zeros((1, max_len), np.int32)
                ids[0, : len(hist[r])] = hist[r]
                want, _ = tf.forward_jit(CFG, params, ids, np.arange(max_len)[None])
                want = np.asarray(want.logits)[0, len(hist[r]) - new[r] : len(hist[r])]
                worst = max(worst, float(np.abs(got[cu[r] : cu[r + 1]] - want).max()))
            if r in pool and len(hist[r]) >= max_len - 4:  # finished: its pages return
                pool.free(r)
                finished += 1
        pool.check()
        if finished == rows:
            break
    print(f"allocator-driven paged vs cache-free: max abs diff {worst:.3g}, {preempted} preempted")
    assert finished == rows and pool.free_pages == 12
    assert worst <= 1e-5 and preempted >= 1


def test_read_only_forward_then_write_equals_the_writing_forward(params):
    """`write=False` (pools only read, K/V returned) + `write_new_kv` == the writing forward."""
    rng = np.random.default_rng(4)
    tables = rng.permutation(P)[: 2 * B].reshape(2, B).astype(np.int32)
    cache = init_paged_cache(CFG, P, PAGE)
    toks = rng.integers(0, CFG.vocab_size, 16).astype(np.int32)
    _, cache = paged_forward_jit(CFG, params, toks, np.asarray([0, 7, 13], np.int32),
                                 np.asarray([7, 6], np.int32), tables, cache)  # fmt: skip
    step = rng.integers(0, CFG.vocab_size, 8).astype(np.int32)
    cu, kv = np.asarray([0, 3, 5], np.int32), np.asarray([10, 8], np.int32)
    for qpr in (0, 3):
        ro, new = paged_forward_kv_jit(CFG, params, step, cu, kv, tables, cache, q_per_req=qpr)
        ro_cache = write_new_kv(cache, new)
        wr, wr_cache = paged_forward_jit(CFG, params, step, cu, kv, tables,
                                         jax.tree.map(jnp.copy, cache), q_per_req=qpr)  # fmt: skip
        assert np.abs(np.asarray(ro.logits) - np.asarray(wr.logits))[0, :5].max() <= 1e-5
        for a, b in zip(ro_cache.k + ro_cache.v, wr_cache.k + wr_cache.v):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 2])
def test_a_one_token_forward_updates_the_pools_in_place(params, tokens):
    """No layer's K/V pool is copied in the compiled forward: for a one-row scatter XLA:CPU once
    laid the pools out differently and copied all of them on every call (4-7x the forward)."""
    cache = init_paged_cache(CFG, P, PAGE)
    args = (jnp.zeros((tokens,), jnp.int32), jnp.asarray([0, tokens], jnp.int32),
            jnp.asarray([9], jnp.int32), jnp.zeros((1, B), jnp.int32), cache)  # fmt: skip
    hlo = paged_forward_jit.lower(CFG, params, *args).compile().as_text()
    pool = "f32[{}]".format(",".join(map(str, cache.k[0].shape)))
    copies = [ln for ln in hlo.splitlines() if f"= {pool}" in ln and " copy(" in ln]
    assert not copies, copies[:2]
