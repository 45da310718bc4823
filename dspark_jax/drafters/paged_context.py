"""The drafter's context cache in pages, shared block tables with the target (a first step).

The drafter context (`BlockContext` for DSpark / DFlash, `Eagle3Context`) caches K/V
[R, n_kv, S, d] of the same committed positions as the target's cache, so it can live in pages
addressed by the *same* block tables (one `engine.pages.PagePool` for both; the drafter's pools
have its own n_kv and d). This adapter keeps the drafters untouched: a round gathers a dense
view of each request's pages (`view`: S = B * page positions, [R, n_kv, S, d]), runs
`extend_context` and `propose` on it as today, and writes back only the positions it appended
(`commit`). The copy of the view costs R x S per drafter layer per round; a paged drafter
attention (the block's queries over `paged_attention` plus its own block) removes it later.

    pc = init_paged_context(cfg, rows=R, num_pages=P, page_size=page)
    ctx = view(pc, tables_RxB)                       # a BlockContext / Eagle3Context
    ctx2 = drafters.extend_context(cfg, params, ctx, feats, next_tokens, num_new)
    prop = drafters.propose(cfg, params, ctx2, ...)
    pc = commit(pc, ctx2, tables_RxB, start_R=ctx.lengths, num_new_R=num_new, max_new=T)

Shapes: R (rows), B (table bucket), P, page and `max_new` are static; values per call. Fields
other than k / v (lengths, Eagle3's g) stay dense per row, as the engine's other row state.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.config import DrafterConfig
from dspark_jax.drafters.api import init_context
from dspark_jax.models.layers import dtype_of
from dspark_jax.models.paged_attention import gather_pages, write_pages

__all__ = ["PagedContext", "commit", "init_paged_context", "view"]


class PagedContext(NamedTuple):
    """K and V page pools [P, page, n_kv, d] (a tuple per layer, or one array for Eagle3, as
    the dense context holds them) and `rows`: the dense context with empty (S = 0) K/V, which
    carries the per-row fields (lengths, g)."""

    k: object
    v: object
    rows: object


def init_paged_context(cfg: DrafterConfig, rows: int, num_pages: int, page_size: int):
    shape = (num_pages, page_size, *cfg.kv_geometry)
    empty = init_context(cfg, rows, 0)
    pool = lambda x: jnp.zeros(shape, dtype_of(cfg.dtype))
    return PagedContext(jax.tree.map(pool, empty.k), jax.tree.map(pool, empty.v), empty)


def view(pc: PagedContext, tables_RxB):
    """The dense context [R, n_kv, B * page, d] of each row's pages (entries at or past a row's
    length are garbage, never read: the drafters' own contract)."""
    gather = lambda pages: gather_pages(pages, tables_RxB)
    return pc.rows._replace(k=jax.tree.map(gather, pc.k), v=jax.tree.map(gather, pc.v))


def commit(pc: PagedContext, ctx, tables_RxB, start_R, num_new_R, max_new: int) -> PagedContext:
    """The pools with positions [start, start + num_new) of the dense `ctx` (a `view` after
    `extend_context`) written to their pages; the per-row fields taken from `ctx`. Static:
    max_new (>= every num_new), shapes."""
    page = jax.tree.leaves(pc.k)[0].shape[1]
    r = start_R.shape[0]
    off = jnp.arange(max_new, dtype=jnp.int32)[None, :]
    pos = start_R[:, None] + off  # [R, max_new]
    valid = off < num_new_R[:, None]
    safe = jnp.where(valid, pos, 0)
    pages = jnp.take_along_axis(tables_RxB, safe // page, axis=1)
    slots = jnp.where(valid, pages * page + safe % page, -1).reshape(-1)
    rows = jnp.arange(r)[:, None]

    def new_kv(x):  # [R, n_kv, S, d] -> the appended positions [R * max_new, n_kv, d]
        return x[rows, :, jnp.minimum(safe, x.shape[2] - 1)].reshape(r * max_new, *x.shape[1::2])

    def put(k_pool, v_pool, k, v):
        return write_pages(k_pool, v_pool, new_kv(k), new_kv(v), slots)

    if isinstance(pc.k, tuple):
        kv = [put(*a) for a in zip(pc.k, pc.v, ctx.k, ctx.v)]
        k, v = tuple(x for x, _ in kv), tuple(y for _, y in kv)
    else:
        k, v = put(pc.k, pc.v, ctx.k, ctx.v)
    empty = lambda x: x[:, :, :0]
    return PagedContext(k, v, ctx._replace(k=jax.tree.map(empty, ctx.k),
                                           v=jax.tree.map(empty, ctx.v)))  # fmt: skip
