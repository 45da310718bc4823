"""Ragged paged attention == `layers.attend` over each request's contiguous K/V (and a float64
numpy softmax): mixed lengths, an empty request, page boundaries, GQA, window, soft-capping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models.layers import attend
from dspark_jax.models.paged_attention import (
    gather_pages,
    paged_attention,
    register_impl,
    slot_mapping,
    token_map,
    write_pages,
)
from dspark_jax.testing import CompileCounter

PAGE, B, P, T = 4, 4, 20, 12
# (kv_len incl. new tokens, new tokens): mid-page, exactly one page, one decode token, empty
REQS = [(13, 3), (4, 4), (9, 1), (0, 0)]


def _case(nq, nkv, d=8, seed=0, reqs=REQS):
    """A pool holding each request's contiguous K/V at random interleaved pages."""
    rng = np.random.default_rng(seed)
    r = len(reqs)
    order = rng.permutation(P)[: r * B].reshape(r, B)  # distinct pages, interleaved
    tables = jnp.asarray(order, jnp.int32)
    kv_lens = jnp.asarray([kv for kv, _ in reqs], jnp.int32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum([q for _, q in reqs])]), jnp.int32)
    k_dense = rng.normal(size=(r, nkv, B * PAGE, d)).astype(np.float32)
    v_dense = rng.normal(size=(r, nkv, B * PAGE, d)).astype(np.float32)
    # the pool: garbage everywhere, then every request's [0, kv_len) written through write_pages
    k_pages = jnp.asarray(rng.normal(size=(P, PAGE, nkv, d)), jnp.float32)
    v_pages = jnp.asarray(rng.normal(size=(P, PAGE, nkv, d)), jnp.float32)
    for i, (kv, _) in enumerate(reqs):
        full = jnp.asarray([kv] + [0] * (r - 1), jnp.int32)
        one = jnp.asarray([0, kv] + [kv] * (r - 1), jnp.int32)
        tm = token_map(one, full, B * PAGE)
        slots = slot_mapping(tables[i : i + 1].repeat(r, 0), tm, PAGE)
        k_new = jnp.asarray(k_dense[i].transpose(1, 0, 2))  # [S, n_kv, d]
        v_new = jnp.asarray(v_dense[i].transpose(1, 0, 2))
        k_pages, v_pages = write_pages(k_pages, v_pages, k_new, v_new, slots)
    q = jnp.asarray(rng.normal(size=(T, nq, d)), jnp.float32)
    return q, k_pages, v_pages, tables, kv_lens, cu, k_dense, v_dense


def _dense(q, k_dense, v_dense, reqs, window, softcap):
    """`attend` per request over its contiguous K/V, rows in bucket order; padding rows 0."""
    out = np.zeros((q.shape[0], q.shape[1] * q.shape[2]), np.float32)
    start = 0
    for r, (kv, ql) in enumerate(reqs):
        if ql == 0:
            continue
        pos = jnp.arange(kv - ql, kv)
        key = jnp.arange(kv)
        mask = key[None, :] <= pos[:, None]
        if window is not None:
            mask &= key[None, :] > pos[:, None] - window
        kv_set = (k_dense[r : r + 1, :, :kv], v_dense[r : r + 1, :, :kv], mask[None])
        a = attend(q[None, start : start + ql], [kv_set], softcap=softcap)
        out[start : start + ql] = np.asarray(a[0])
        start += ql
    return out


def _numpy(q, k_dense, v_dense, reqs, window, softcap):
    """The same attention in float64 numpy, one query at a time."""
    q = np.asarray(q, np.float64)
    t, nq, d = q.shape
    g = nq // k_dense.shape[1]
    out = np.zeros((t, nq, d))
    start = 0
    for r, (kv, ql) in enumerate(reqs):
        for i in range(ql):
            p = kv - ql + i
            lo = 0 if window is None else max(0, p - window + 1)
            for h in range(nq):
                k, v = k_dense[r, h // g, lo : p + 1], v_dense[r, h // g, lo : p + 1]
                s = k @ q[start + i, h] / np.sqrt(d)
                if softcap is not None:
                    s = softcap * np.tanh(s / softcap)
                e = np.exp(s - s.max())
                out[start + i, h] = (e / e.sum()) @ v
        start += ql
    return out.reshape(t, nq * d)


def test_write_pages_then_gather_is_the_contiguous_cache():
    q, kp, vp, tables, kv_lens, _, k_dense, _ = _case(4, 2)
    got = np.asarray(gather_pages(kp, tables))  # [R, n_kv, S, d]
    for r, (kv, _) in enumerate(REQS):
        np.testing.assert_array_equal(got[r, :, :kv], k_dense[r, :, :kv])


@pytest.mark.parametrize("q_per_req", [0, 4])
@pytest.mark.parametrize(
    "nq,nkv,window,softcap",
    [(4, 2, None, None), (2, 2, None, None), (6, 2, None, None), (4, 2, 3, None),
     (4, 1, 6, None), (4, 2, None, 5.0), (4, 2, 5, 2.0)],
)  # fmt: skip
def test_paged_equals_dense_attention(q_per_req, nq, nkv, window, softcap):
    q, kp, vp, tables, kv_lens, cu, k_dense, v_dense = _case(nq, nkv)
    got = paged_attention(q, kp, vp, tables, kv_lens, cu, q_per_req=q_per_req, window=window,
                          softcap=softcap)  # fmt: skip
    got = np.asarray(got)
    dense = _dense(q, k_dense, v_dense, REQS, window, softcap)
    ref = _numpy(q, k_dense, v_dense, REQS, window, softcap)
    n_valid = sum(ql for _, ql in REQS)
    assert np.abs(got - dense).max() <= 1e-5
    assert np.abs(got - ref).max() <= 1e-5
    assert not got[n_valid:].any()  # padding tokens: zeros


def test_layouts_agree_jitted_without_retrace_on_new_lengths():
    """One program per (layout, shapes): new lengths and tables reuse it; both layouts agree."""
    fn = jax.jit(paged_attention, static_argnames=("q_per_req", "window", "softcap", "impl"))
    other = [(7, 2), (16, 1), (3, 3), (12, 5)]
    cases = [_case(4, 2, seed=s, reqs=rq) for s, rq in ((0, REQS), (1, other))]
    for qpr in (0, 5):
        fn(*cases[0][:6], q_per_req=qpr).block_until_ready()
    with CompileCounter() as cc:
        q, kp, vp, tables, kv_lens, cu, kd, vd = cases[1]
        a = fn(q, kp, vp, tables, kv_lens, cu, q_per_req=0)
        b = fn(q, kp, vp, tables, kv_lens, cu, q_per_req=5)
        a, b = np.asarray(a), np.asarray(b)
    assert np.abs(a - b).max() <= 1e-5
    assert np.abs(a - _dense(q, kd, vd, other, None, None)).max() <= 1e-5
    assert cc.count == 0, cc.names


def test_write_pages_drops_padding_and_impl_seam():
    q, kp, vp, tables, kv_lens, cu, _, _ = _case(4, 2)
    junk = jnp.full((3, 2, 8), 7.0)
    kp2, vp2 = write_pages(kp, vp, junk, junk, jnp.asarray([-1, -1, -1], jnp.int32))
    np.testing.assert_array_equal(np.asarray(kp2), np.asarray(kp))
    calls = []

    def spy(*args, **kw):
        calls.append(kw)
        return paged_attention(*args, **kw)

    register_impl("spy", spy)
    a = paged_attention(q, kp, vp, tables, kv_lens, cu, impl="spy", window=3)
    b = paged_attention(q, kp, vp, tables, kv_lens, cu, window=3)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert calls == [dict(q_per_req=0, window=3, softcap=None)]
    with pytest.raises(ValueError, match="unknown"):
        paged_attention(q, kp, vp, tables, kv_lens, cu, impl="nope")


@pytest.mark.parametrize("q_per_req,window", [(0, None), (4, None), (0, 3), (4, 2)])
def test_new_kv_read_only_equals_write_then_read(q_per_req, window):
    """Attending the call's K/V directly (pool unwritten) == writing them first."""
    q, kp, vp, tables, kv_lens, cu, _, _ = _case(4, 2, seed=3)
    rng = np.random.default_rng(5)
    k_new = jnp.asarray(rng.normal(size=(T, 2, 8)), jnp.float32)
    v_new = jnp.asarray(rng.normal(size=(T, 2, 8)), jnp.float32)
    slots = slot_mapping(tables, token_map(cu, kv_lens, T), PAGE)
    kw = dict(q_per_req=q_per_req, window=window)
    kp2, vp2 = write_pages(kp, vp, k_new, v_new, slots)
    want = np.asarray(paged_attention(q, kp2, vp2, tables, kv_lens, cu, **kw))
    got = np.asarray(paged_attention(q, kp, vp, tables, kv_lens, cu, new_kv=(k_new, v_new), **kw))
    assert np.abs(got - want).max() <= 1e-5
    # the pool's stale values at the new tokens' slots are really not read
    assert (
        np.abs(np.asarray(paged_attention(q, kp, vp, tables, kv_lens, cu, **kw)) - want).max()
        > 1e-3
    )


def test_request_major_overflow_gives_zeros_not_another_requests_rows():
    """Tokens past q_per_req (a caller's error) come out 0; the other requests are unchanged."""
    q, kp, vp, tables, kv_lens, cu, _, _ = _case(4, 2)
    full = np.asarray(paged_attention(q, kp, vp, tables, kv_lens, cu, q_per_req=4))
    short = np.asarray(paged_attention(q, kp, vp, tables, kv_lens, cu, q_per_req=2))
    # request 0 has tokens 0..2, request 1 tokens 3..6, request 2 token 7 (module REQS)
    keep = np.asarray([0, 1, 3, 4, 7])
    np.testing.assert_array_equal(short[keep], full[keep])
    assert not short[[2, 5, 6]].any()
