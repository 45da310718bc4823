"""A reference Pallas kernel for ragged paged attention, registered as
`paged_attention(..., impl="pallas_interpret")` (importing this module registers it).

It shows the kernel's shape at the seam, not a tuned kernel: one program per request (grid [R]),
the request's G query rows ([G, n_q, d], the request-major layout: `q_per_req=G` is required) in
a block, and a loop over the request's pages only (ceil(kv_len / page) of them, read through
the block table) with an online softmax (running max, sum and accumulator in fp32). The pools
are whole-array operands: fine in `interpret=True` mode (CPU tests), whereas a TPU/GPU kernel
would keep them in HBM (`memory_space=ANY`) and copy each page in (double-buffered), with the
block table and lengths as scalar-prefetch operands.

Semantics are `layers.attend`'s (module `paged_attention`): scores q.k / sqrt(d) in fp32,
optional soft-capping then the causal / window mask, a row with no visible key gives 0. It
equals the pure-JAX path up to float reassociation (the online softmax sums page by page).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dspark_jax.models.layers import _NEG
from dspark_jax.models.paged_attention import register_impl, token_map

__all__ = ["ragged_paged_attention_pallas"]


def _kernel(tables_ref, kv_lens_ref, q_lens_ref, q_ref, k_ref, v_ref, o_ref,
            *, page, window, softcap, scale):  # fmt: skip
    r = pl.program_id(0)
    q = q_ref[0].astype(jnp.float32)  # [G, n_q, d]
    g, nq, d = q.shape
    nkv = k_ref.shape[2]
    kv_len, q_len = kv_lens_ref[r], q_lens_ref[r]
    row = jnp.arange(g, dtype=jnp.int32)
    pos = kv_len - q_len + row  # [G] the rows' positions (rows >= q_len are padding)
    live = row < q_len

    def body(j, carry):
        m, den, acc = carry  # running max, sum, accumulator: [G, n_q], [G, n_q], [G, n_q, d]
        p_idx = tables_ref[r, j]
        k = jnp.repeat(k_ref[p_idx].astype(jnp.float32), nq // nkv, axis=1)  # [page, n_q, d]
        v = jnp.repeat(v_ref[p_idx].astype(jnp.float32), nq // nkv, axis=1)
        s = jnp.einsum("ghd,phd->ghp", q, k)
        s = s / math.sqrt(d) if scale is None else s * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        key = j * page + jnp.arange(page, dtype=jnp.int32)
        vis = (key[None, :] <= pos[:, None]) & live[:, None]
        if window is not None:
            vis = vis & (key[None, :] > pos[:, None] - window)
        vis = vis[:, None, :]  # [G, 1, page]
        s = jnp.where(vis, s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(vis, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        den = den * corr + p.sum(-1)
        acc = acc * corr[..., None] + jnp.einsum("ghp,phd->ghd", p, v)
        return m_new, den, acc

    init = (jnp.full((g, nq), _NEG), jnp.zeros((g, nq)), jnp.zeros((g, nq, d)))
    _, den, acc = jax.lax.fori_loop(0, (kv_len + page - 1) // page, body, init)
    out = jnp.where(den[..., None] > 0, acc / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
    o_ref[0] = out.astype(o_ref.dtype)


def ragged_paged_attention_pallas(q_TxNxD, k_pages, v_pages, block_tables_RxB, kv_lens_R,
                                  cu_q_lens_R1, *, q_per_req, window, softcap, scale=None,
                                  interpret=True):  # fmt: skip
    """`paged_attention`'s contract (its arguments, [T, n_q * d] out); static: q_per_req (> 0:
    at most that many new tokens per request), window, softcap, scale, interpret, shapes."""
    if not q_per_req:
        raise ValueError("pallas paged attention lays queries out per request: pass q_per_req=G")
    t, nq, d = q_TxNxD.shape
    r, b = block_tables_RxB.shape
    g = int(q_per_req)
    tm = token_map(cu_q_lens_R1, kv_lens_R, t)
    # out of range (padding, or a request's tokens past G: a caller's error): dropped, output 0
    row = jnp.where(tm.valid & (tm.offset < g), tm.req * g + tm.offset, r * g)
    q_g = jnp.zeros((r * g, nq, d), q_TxNxD.dtype).at[row].set(q_TxNxD, mode="drop")
    q_lens = (cu_q_lens_R1[1:] - cu_q_lens_R1[:-1]).astype(jnp.int32)
    whole = lambda x: pl.BlockSpec(x.shape, lambda i: (0,) * x.ndim)
    kernel = functools.partial(_kernel, page=k_pages.shape[1], window=window, softcap=softcap,
                               scale=scale)  # fmt: skip
    out = pl.pallas_call(
        kernel,
        grid=(r,),
        in_specs=[
            whole(block_tables_RxB), whole(kv_lens_R), whole(q_lens),
            pl.BlockSpec((1, g, nq, d), lambda i: (i, 0, 0, 0)),
            whole(k_pages), whole(v_pages),
        ],
        out_specs=pl.BlockSpec((1, g, nq, d), lambda i: (i, 0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((r, g, nq, d), q_TxNxD.dtype),
        interpret=interpret,
    )(block_tables_RxB.astype(jnp.int32), kv_lens_R.astype(jnp.int32), q_lens,
      q_g.reshape(r, g, nq, d), k_pages, v_pages)  # fmt: skip
    a = out.reshape(r * g, nq * d)[jnp.minimum(row, r * g - 1)]
    return jnp.where((row < r * g)[:, None], a, 0).astype(q_TxNxD.dtype)


register_impl("pallas_interpret", ragged_paged_attention_pallas)
