"""The drafter's context cache in pages, under the target's block tables (docs/METHOD.md §2.9).

The drafter context (`BlockContext` for DSpark / DFlash, `Eagle3Context`) caches K/V of the
same committed positions as the target's cache, so in the paged engine it lives in pages
addressed by the *same* block tables (one `engine.pages.PagePool` for both; the drafter's pools
have its own n_kv and d). `drafters.extend_context` and `drafters.propose` take a
`PagedContext` given its rows' tables (`with_tables`) and work on the pages themselves:

  * extending writes the new positions' K/V straight into their pages (`write_pages`);
  * DSpark / DFlash's block attends, layer by layer, through the target's own
    `models.paged_attention` (request-major, γ queries per request, the block's own K/V as
    the call's new keys seen both ways, `block=True`), so an accelerator's paged-attention
    kernel serves the drafter as it serves the target;
  * Eagle3's extension attends the same way (causal, its new positions written first); its
    γ − 1 chained draft steps read its one layer's context through one read-only gather per
    round (the steps' own K/V are a second key set in one softmax, which the paged attention's
    single-set output cannot merge).

    pc = init_paged_context(cfg, rows=R, num_pages=P, page_size=page)   # kept in the state
    pc = drafters.extend_context(cfg, params, with_tables(pc, tables_RxB), feats, nxt, num_new)
    prop = drafters.propose(cfg, params, pc, anchor, key, seeds, ...)
    state_ctx = with_tables(pc, None)                                    # tables are per call

Shapes: R (rows), B (table bucket), P and page are static; values per call. Fields other than
k / v (lengths, Eagle3's g) stay dense per row (`rows`), as the engine's other row state.
Every position a call writes must lie in its row's table (< B * page): the engine grows a
request's pages before the round that fills them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.config import DrafterConfig
from dspark_jax.drafters.common import embed
from dspark_jax.drafters.dspark import (
    BlockDrafter,
    init_block_context,
    propose_from_block,
)
from dspark_jax.drafters.eagle3 import (
    Eagle3Context,
    Eagle3Drafter,
    init_eagle3_context,
    last_output,
    propose_eagle3,
)
from dspark_jax.models.layers import dtype_of
from dspark_jax.models.paged_attention import gather_pages, paged_attention, write_pages

__all__ = [
    "PagedContext",
    "init_paged_context",
    "paged_extend",
    "paged_propose",
    "put_rows",
    "take_rows",
    "with_tables",
]


class PagedContext(NamedTuple):
    """K and V page pools [P, page, n_kv, d] (a tuple per layer, or one array for Eagle3, as
    the dense context holds them), `rows`: the dense context with empty (S = 0) K/V, which
    carries the per-row fields (lengths, g), and `tables` [R, B]: the rows' block tables for
    this call (None in stored state)."""

    k: object
    v: object
    rows: object
    tables: jax.Array | None = None

    @property
    def lengths(self):
        return self.rows.lengths


def init_paged_context(cfg: DrafterConfig, rows: int, num_pages: int, page_size: int):
    shape = (num_pages, page_size, *cfg.kv_geometry)
    init = init_eagle3_context if cfg.kind == "eagle3" else init_block_context
    empty = init(cfg, rows, 0)
    pool = lambda x: jnp.zeros(shape, dtype_of(cfg.dtype))
    return PagedContext(jax.tree.map(pool, empty.k), jax.tree.map(pool, empty.v), empty)


def with_tables(pc: PagedContext, tables_RxB) -> PagedContext:
    """`pc` addressed through `tables_RxB` (None: stripped, the form the engine stores)."""
    return pc._replace(tables=tables_RxB)


def take_rows(pc: PagedContext, sel_M) -> PagedContext:
    """The context of rows `sel` [M]: their per-row fields and tables (the pools are every
    row's)."""
    tables = None if pc.tables is None else pc.tables[sel_M]
    return pc._replace(rows=jax.tree.map(lambda x: x[sel_M], pc.rows), tables=tables)


def put_rows(pc: PagedContext, part: PagedContext, sel_M) -> PagedContext:
    """`pc` with rows `sel` taken from `part` (a `take_rows` of it, then extended: its pools are
    the new ones)."""
    rows = jax.tree.map(lambda w, x: w.at[sel_M].set(x), pc.rows, part.rows)
    return part._replace(rows=rows, tables=pc.tables)


def _flat(x_BxKxTxD):
    """[B, n_kv, T, d] -> token-major [B * T, n_kv, d] (the pools' write layout)."""
    b, k, t, d = x_BxKxTxD.shape
    return x_BxKxTxD.transpose(0, 2, 1, 3).reshape(b * t, k, d)


def _new_positions(pc: PagedContext, t: int, num_new_B):
    """Positions [B, T] = lengths + t and their flat pool slots [B * T] (-1: past num_new)."""
    page = jax.tree.leaves(pc.k)[0].shape[1]
    off = jnp.arange(t, dtype=jnp.int32)[None, :]
    pos = pc.lengths[:, None] + off
    valid = off < num_new_B[:, None]
    safe = jnp.where(valid, pos, 0)
    pages = jnp.take_along_axis(pc.tables, safe // page, axis=1)
    return pos, jnp.where(valid, pages * page + safe % page, -1).reshape(-1)


def _ragged(b: int, t: int):
    """cu_q_lens [B + 1] of B requests with t tokens each."""
    return jnp.arange(b + 1, dtype=jnp.int32) * t


def paged_extend(model, pc: PagedContext, features_BxTxF, next_tokens_BxT, num_new_B):
    """`extend_context` on pages: the K/V of positions lengths + t (t < num_new[b]) written to
    their pages (Eagle3: attended causally over the pages, g updated); lengths += num_new."""
    b, t, _ = features_BxTxF.shape
    pos, slots = _new_positions(pc, t, num_new_B)
    lengths = pc.lengths + num_new_B
    if isinstance(model, BlockDrafter):
        kvs = [write_pages(kp, vp, _flat(kn), _flat(vn), slots)
               for (kn, vn), kp, vp in zip(model.context_kv(features_BxTxF, pos), pc.k, pc.v)]  # fmt: skip
        k, v = tuple(x for x, _ in kvs), tuple(y for _, y in kvs)
        return pc._replace(k=k, v=v, rows=pc.rows._replace(lengths=lengths))
    layer = model.layers[0]
    g_in = model.project(features_BxTxF)
    x = layer.inputs(model.embed(next_tokens_BxT), g_in)
    q, kk, vv = layer.self_attn.qkv(x, pos)  # q [B, T, n, d], kk / vv [B, n_kv, T, d]
    k, v = write_pages(pc.k, pc.v, _flat(kk), _flat(vv), slots)
    # request r's tokens are rows r*T .. r*T + T - 1 at positions lengths + t: kv_lens counts
    # all T (the padding rows' keys are never visible to a valid row: causal)
    a = paged_attention(q.reshape(b * t, *q.shape[2:]), k, v, pc.tables, pc.lengths + t,
                        _ragged(b, t), q_per_req=t, window=model.cfg.context_window or None,
                        scale=layer.scale)  # fmt: skip
    g_out = layer.finish(g_in, a.reshape(b, t, -1).astype(g_in.dtype))
    g = last_output(g_out, num_new_B, pc.rows.g)
    return pc._replace(k=k, v=v, rows=pc.rows._replace(lengths=lengths, g=g))


def paged_block(model: BlockDrafter, pc: PagedContext, anchor_B):
    """`dspark.single_block` on pages: z [R, γ, H] of one block per row (anchor + mask tokens
    at positions lengths + k), each layer's queries over the row's pages < lengths (windowed
    as the block's anchor) and the block's own K/V."""
    cfg = model.cfg
    g = cfg.block_size
    r = anchor_B.shape[0]
    ids = jnp.full((r, g), cfg.mask_token_id, jnp.int32).at[:, 0].set(anchor_B)
    pos = pc.lengths[:, None] + jnp.arange(g, dtype=jnp.int32)[None, :]
    x = embed(model.embed_tokens[...], ids, cfg.embed_scale)  # [R, γ, H]
    for layer, kp, vp in zip(model.layers, pc.k, pc.v):
        q, kb, vb = layer.attention_inputs(x, pos)
        a = paged_attention(q.reshape(r * g, *q.shape[2:]), kp, vp, pc.tables, pc.lengths + g,
                            _ragged(r, g), q_per_req=g, window=cfg.context_window or None,
                            new_kv=(_flat(kb), _flat(vb)), scale=layer.scale,
                            block=True)  # fmt: skip
        x = layer.finish(x, a.reshape(r, g, -1))
    return model.norm(x)


def paged_propose(model, pc: PagedContext, anchor_B, key, seeds_B, sampling=None, scfg=None,
                  rounds_B=None):  # fmt: skip
    """`drafters.propose` on pages (the module docstring says how each drafter reads them)."""
    if isinstance(model, Eagle3Drafter):
        gather = lambda pages: gather_pages(pages, pc.tables)
        dense = Eagle3Context(gather(pc.k), gather(pc.v), pc.lengths, pc.rows.g)
        return propose_eagle3(model, dense, key, seeds_B, sampling, scfg, rounds_B=rounds_B)
    z = paged_block(model, pc, anchor_B)
    return propose_from_block(model, z, pc.lengths, anchor_B, key, seeds_B, sampling, scfg,
                              rounds_B=rounds_B)  # fmt: skip
