"""Ragged paged attention: the new tokens of R requests, flattened into one token bucket, attend
to their requests' K/V stored in a pool of fixed-size pages, read through a block table.

    out_TxF = paged_attention(q_TxNxD, k_pages, v_pages, block_tables_RxB, kv_lens_R,
                              cu_q_lens_R1, q_per_req=0, window=None, softcap=None, scale=None,
                              impl="xla")
    k_pages, v_pages = write_pages(k_pages, v_pages, k_TxKxD, v_TxKxD, slot_mapping_T)

Shapes (static: they choose the compiled program; per call: values only):
  q_TxNxD             [T, n_q, d]            T: the token bucket (static)
  k_pages, v_pages    [P, page, n_kv, d]     one layer's pool (static); n_q a multiple of n_kv
  block_tables_RxB    [R, B] int32           R: request bucket, B: page-table bucket (static);
                                             row r lists request r's pages in order; entries
                                             past its last page are never read (any index)
  kv_lens_R           [R] int32, per call    request r's visible context *including* its new
                                             tokens: its keys are positions [0, kv_lens[r])
  cu_q_lens_R1        [R + 1] int32, per call  request r's new tokens are q[cu[r]:cu[r+1]], at
                                             positions kv_lens[r] - q_len ... kv_lens[r] - 1;
                                             tokens from cu[R] on are bucket padding
  slot_mapping_T      [T] int32, per call    token t's K/V goes to flat slot page*page + offset
                                             of the pool; < 0: padding, the write is dropped

Semantics are `layers.attend`'s (the one attention: fp32 scores scaled by `scale`, default
1/sqrt(d) (Gemma 4: 1), optional soft-capping, masked softmax, a query with no visible key gives 0): a query at position p sees
its own request's keys at positions j <= p (causal within the new tokens, all of the prefix),
and with `window` only j > p - window. The caller writes the new tokens' K/V (`write_pages`)
before attending, so they are read back from the pool like the prefix (one key set), or passes
them as `new_kv` (a second key set; the pool is then only read).

`impl` is the seam for kernels: "xla" is the pure-JAX path below (the reference); a Pallas
ragged paged attention kernel registers itself with `register_impl` under another name and
takes the same arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.models.layers import attend

__all__ = [
    "TokenMap",
    "gather_pages",
    "paged_attention",
    "register_impl",
    "slot_mapping",
    "token_map",
    "write_pages",
]


class TokenMap(NamedTuple):
    """Where each token of a flat bucket belongs (all [T])."""

    req: jax.Array  # int32 request index (padding: clamped into [0, R))
    offset: jax.Array  # int32 index among its request's new tokens (padding: 0)
    pos: jax.Array  # int32 absolute position (padding: -1)
    valid: jax.Array  # bool, False for bucket padding


def token_map(cu_q_lens_R1: jax.Array, kv_lens_R: jax.Array, num_tokens: int) -> TokenMap:
    """The request, offset and position of each of `num_tokens` (static) bucket tokens."""
    r_max = kv_lens_R.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    # the last r with cu[r] <= t skips requests with no new tokens (cu[r] == cu[r + 1])
    req = jnp.searchsorted(cu_q_lens_R1, t, side="right").astype(jnp.int32) - 1
    req = jnp.clip(req, 0, r_max - 1)
    valid = t < cu_q_lens_R1[r_max]
    start = cu_q_lens_R1[req]
    q_len = cu_q_lens_R1[req + 1] - start
    offset = jnp.where(valid, t - start, 0)
    pos = jnp.where(valid, kv_lens_R[req] - q_len + offset, -1)
    return TokenMap(req, offset.astype(jnp.int32), pos.astype(jnp.int32), valid)


def slot_mapping(block_tables_RxB: jax.Array, tm: TokenMap, page_size: int) -> jax.Array:
    """[T] int32 flat pool slot of each token's K/V (page * page_size + offset); -1 for padding.
    Every valid token's page must be in its request's table (pos < B * page_size)."""
    safe = jnp.maximum(tm.pos, 0)
    page = block_tables_RxB[tm.req, safe // page_size]
    return jnp.where(tm.valid, page * page_size + safe % page_size, -1).astype(jnp.int32)


def write_pages(k_pages, v_pages, k_TxKxD, v_TxKxD, slot_mapping_T):
    """The pools with each token's K/V [T, n_kv, d] at its flat slot; slots < 0 are dropped."""
    p, page, nkv, d = k_pages.shape
    idx = jnp.where(slot_mapping_T >= 0, slot_mapping_T, p * page)  # out of range: dropped
    if idx.shape[0] == 1:  # one row is written as two (the second dropped): for a one-row
        # scatter XLA:CPU lays the pool out differently and copies it, every layer, every call
        # (a one-token paged forward took 4-7x a two-token one at the demo's size)
        idx = jnp.pad(idx, (0, 1), constant_values=p * page)
        k_TxKxD, v_TxKxD = (jnp.pad(x, ((0, 1), (0, 0), (0, 0))) for x in (k_TxKxD, v_TxKxD))

    def put(pages, x):
        flat = pages.reshape(p * page, nkv, d)
        return flat.at[idx].set(x.astype(pages.dtype), mode="drop").reshape(pages.shape)

    return put(k_pages, k_TxKxD), put(v_pages, v_TxKxD)


def gather_pages(pages, block_tables_XxB):
    """Heads-first contiguous K or V [X, n_kv, B * page, d] of the tables' pages, in order."""
    g = pages[block_tables_XxB]  # [X, B, page, n_kv, d]
    x, b, page, nkv, d = g.shape
    return g.reshape(x, b * page, nkv, d).transpose(0, 2, 1, 3)


def _visible(key_pos_S, pos_X, valid_X, window, below_X=None, block=False):
    """[X, S] bool: key j visible to a query at pos p: j <= p (and j > p - window); with
    `below_X`, only keys j < below (the prefix before the call's own tokens); with `block`
    the window is measured from below - 1 for every query (a drafter's block sees the prefix
    its anchor's previous position sees)."""
    last = pos_X if below_X is None else below_X - 1
    m = (key_pos_S[None, :] <= last[:, None]) & valid_X[:, None]
    if window is not None:
        m = m & (key_pos_S[None, :] > (last if block else pos_X)[:, None] - window)
    return m


def _xla(q_TxNxD, k_pages, v_pages, block_tables_RxB, kv_lens_R, cu_q_lens_R1,
         *, q_per_req, window, softcap, new_kv=None, scale=None, block=False):  # fmt: skip
    """Pure JAX over `layers.attend`. Two layouts of the same reads:
    token-major (`q_per_req=0`): every token gathers its request's pages, T groups of one query
    (T copies of the context: cheap for few tokens over short contexts);
    request-major (`q_per_req=G`): each request's pages gathered once and its new tokens laid
    out as G query rows (R x G x S scores; every request must have at most G new tokens).
    With `new_kv` the pool is read for the prefix only and the call's own K/V are a second key
    set (one softmax over both); `block` (request-major with `new_kv` only): a request's new
    tokens see each other both ways and the window is the block's (`_visible`)."""
    t = q_TxNxD.shape[0]
    r, b = block_tables_RxB.shape
    page = k_pages.shape[1]
    tm = token_map(cu_q_lens_R1, kv_lens_R, t)
    key_pos = jnp.arange(b * page, dtype=jnp.int32)
    below = None if new_kv is None else tm.pos - tm.offset
    if block and not (q_per_req and new_kv is not None):
        raise ValueError("paged_attention: block=True needs q_per_req > 0 and new_kv")
    if not q_per_req:
        tables = block_tables_RxB[tm.req]  # [T, B]
        k, v = gather_pages(k_pages, tables)[None], gather_pages(v_pages, tables)[None]
        mask = _visible(key_pos, tm.pos, tm.valid, window, below)[None, :, None, :]  # [1,T,1,S]
        sets = [(k, v, mask)]
        if new_kv is not None:  # token i sees token j of its request at offset <= its own
            same = (tm.req[None, :] == tm.req[:, None]) & (tm.offset[None, :] <= tm.offset[:, None])
            own = same & tm.valid[None, :] & tm.valid[:, None]
            if window is not None:
                own = own & (tm.pos[None, :] > tm.pos[:, None] - window)
            kn, vn = (x.transpose(1, 0, 2)[None] for x in new_kv)  # [1, n_kv, T, d]
            sets.append((kn, vn, own[None]))
        return attend(q_TxNxD[None], sets, scale=scale, softcap=softcap)[0]
    g = int(q_per_req)
    # out of range (padding, or a request's tokens past G: a caller's error): dropped, output 0
    row = jnp.where(tm.valid & (tm.offset < g), tm.req * g + tm.offset, r * g)
    by_row = lambda x, fill: (
        jnp.full((r * g,) + x.shape[1:], fill, x.dtype).at[row].set(x, mode="drop")
    )
    q_g, pos_g = by_row(q_TxNxD, 0), by_row(tm.pos, -1)
    k = gather_pages(k_pages, block_tables_RxB)[None]  # [1, R, n_kv, S, d]
    v = gather_pages(v_pages, block_tables_RxB)[None]
    below_g = None if below is None else by_row(below, 0)
    mask = _visible(key_pos, pos_g, pos_g >= 0, window, below_g, block)
    sets = [(k, v, mask.reshape(1, r, g, b * page))]
    if new_kv is not None:  # row i of a request sees its rows j <= i (causal within the call;
        p = pos_g.reshape(r, g)  # a block: every row of its request)
        own = (p[:, None, :] >= 0) & (p[:, :, None] >= 0)
        own = own if block else own & jnp.tril(jnp.ones((g, g), bool))
        if window is not None and not block:
            own = own & (p[:, None, :] > p[:, :, None] - window)
        kn, vn = (by_row(x, 0).reshape(r, g, *x.shape[1:]).transpose(0, 2, 1, 3)[None]
                  for x in new_kv)  # fmt: skip  # [1, R, n_kv, G, d]
        sets.append((kn, vn, own[None]))
    a = attend(q_g[None], sets, scale=scale, softcap=softcap)[0]  # [R * G, n_q * d]
    return jnp.where((row < r * g)[:, None], a[jnp.minimum(row, r * g - 1)], 0).astype(a.dtype)


AttentionImpl = Callable[..., jax.Array]
_IMPLS: dict[str, AttentionImpl] = {"xla": _xla}


def register_impl(name: str, fn: AttentionImpl) -> None:
    """Make `fn` (paged_attention's arguments, keyword-only q_per_req / window / softcap, and
    new_kv and scale if it supports them; returns [T, n_q * d]) selectable as `impl=name`."""
    _IMPLS[name] = fn


def paged_attention(
    q_TxNxD: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables_RxB: jax.Array,
    kv_lens_R: jax.Array,
    cu_q_lens_R1: jax.Array,
    *,
    q_per_req: int = 0,
    window: int | None = None,
    softcap: float | None = None,
    new_kv: tuple[jax.Array, jax.Array] | None = None,
    scale: float | None = None,
    block: bool = False,
    impl: str = "xla",
) -> jax.Array:
    """Attention of the bucket's queries over their requests' paged K/V: [T, n_q * d] in q's
    dtype, zeros for padding tokens. Static: shapes, q_per_req (0: token-major layout; G:
    request-major, for at most G new tokens per request: a request's tokens past G get zeros),
    window, softcap, impl. Per call: the values
    of block_tables, kv_lens, cu_q_lens (module docstring). `new_kv` ((k, v) [T, n_kv, d] of
    the call's tokens, not yet in the pool): the pool is read only below each request's new
    tokens and these are attended directly, so the pools need not be written first (the
    device-resident rounds write once, after choosing among programs). `scale` (static): the
    scores' scale, None: 1/sqrt(d) (Gemma 4's layers: 1). `block` (static; with q_per_req
    and new_kv): a drafter's block, whose tokens see each other both ways and the prefix
    below their first position, windowed from there (`drafters.paged_context`). Only impls
    that say so accept `new_kv`, `scale` or `block`."""
    if impl not in _IMPLS:
        raise ValueError(f"paged_attention: impl={impl!r} unknown; registered: {sorted(_IMPLS)}")
    nq, nkv = q_TxNxD.shape[1], k_pages.shape[2]
    if nq % nkv:
        raise ValueError(f"paged_attention: {nq} query heads not a multiple of {nkv} kv heads")
    if window is not None and window < 1:
        raise ValueError(f"paged_attention: window={window} must be >= 1 (None: no window)")
    kw = dict(q_per_req=q_per_req, window=window, softcap=softcap)
    if new_kv is not None:
        kw["new_kv"] = new_kv
    if scale is not None:
        kw["scale"] = scale
    if block:
        kw["block"] = True
    return _IMPLS[impl](q_TxNxD, k_pages, v_pages, block_tables_RxB, kv_lens_R, cu_q_lens_R1,
                        **kw)  # fmt: skip
