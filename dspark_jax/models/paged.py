"""The target's forward over a flat token bucket with a paged KV cache, for the serving engine.

    out, cache = paged_forward(cfg, params, tokens_T, cu_q_lens_R1, kv_lens_R, block_tables_RxB,
                               cache)

One function for prefill (chunks), decode and packed multi-request verification: the bucket
holds R requests' new tokens back to back (`paged_attention`'s ragged layout: request r's are
tokens cu[r]:cu[r+1], at positions kv_lens[r] - q_len ... kv_lens[r] - 1, so `kv_lens` already
counts them); tokens from cu[R] on are padding (outputs garbage, K/V writes dropped).

Cache (`PagedKVCache`): per layer a pool of pages [P, page, n_kv, d] for K and for V, shared by
all requests; the host allocator (`engine/pages.py`) owns which pages a request holds and passes
its block table. Each layer writes its tokens' K/V into their pages before attending, so they
are read back with the prefix (one key set, the `one_set` form of `packed.py`); `write=False`
only reads the pools and returns the tokens' K/V (`PagedNewKV`, written later by `write_new_kv`),
as `packed_forward_kv` does for the device-resident rounds (`paged_forward_kv_jit`, which does
not donate the pools). Rejected K/V are not erased: the next call's `kv_lens` say what is
visible, and the next tokens overwrite them.

Shapes: T, R, B (pages per request bucket), P and page are static (one program per (T, R, B));
the values of tokens, cu_q_lens, kv_lens and block_tables are per call. This composes the
target's own layers, as `packed.py` does (`transformer.DecoderLayer`, `gemma4.Gemma4Layer`:
their `attention_inputs`, `finish`, `window` and `scale`, the model's `embed` and `kv_source`),
and swaps only each layer's cache step, so it equals `transformer.forward` on a dense cache up
to float reassociation.

Gemma 4: one pool per layer that computes K/V, in that layer's geometry (global layers' own
n_kv / head_dim; the dense cache's `init_cache` says which), all under the same block tables;
a KV-shared layer keeps no pool and attends to its source layer's (and, read-only, to the
source's new K/V); a sliding layer masks keys `window` or more positions back (its pages stay:
freeing them is not done yet); scores unscaled, the per-layer inputs and the scaled embedding
from `embed`, the soft-capped logits from the model's `logits`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.config import TargetConfig
from dspark_jax.models import transformer as tf
from dspark_jax.models.cache import outputs
from dspark_jax.models.layers import dtype_of
from dspark_jax.models.paged_attention import (
    paged_attention,
    slot_mapping,
    token_map,
    write_pages,
)

__all__ = [
    "PagedKVCache",
    "PagedNewKV",
    "init_paged_cache",
    "paged_forward",
    "paged_forward_jit",
    "paged_forward_kv_jit",
    "write_new_kv",
]


class PagedKVCache(NamedTuple):
    """Per-layer K and V page pools [P, page, n_kv, d]. Lengths and block tables live on the
    host (the allocator) and enter each call as arrays."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]


def init_paged_cache(cfg: TargetConfig, num_pages: int, page_size: int, dtype=None):
    """An all-zero pool of `num_pages` pages of `page_size` positions per layer that computes
    K/V, each in that layer's geometry [P, page, n_kv, d] (the dense `init_cache`'s entries)."""
    dt = dtype_of(cfg.dtype) if dtype is None else dtype
    dense = jax.eval_shape(lambda: tf.init_cache(cfg, 1, 1, dt))  # [1, n_kv, 1, d] per layer
    pools = lambda xs: tuple(
        jnp.zeros((num_pages, page_size, x.shape[1], x.shape[3]), dt) for x in xs
    )
    return PagedKVCache(pools(dense.k), pools(dense.v))


class PagedNewKV(NamedTuple):
    """The K/V a read-only paged forward computed: per layer [T, n_kv, d], and each token's flat
    pool slot [T] (-1: padding, dropped)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    slots: jax.Array


def write_new_kv(cache: PagedKVCache, kv: PagedNewKV) -> PagedKVCache:
    """The pools with `kv` written (what `paged_forward(write=True)` does layer by layer)."""
    kvs = [write_pages(*a, kv.slots) for a in zip(cache.k, cache.v, kv.k, kv.v)]
    return PagedKVCache(tuple(k for k, _ in kvs), tuple(v for _, v in kvs))


def _layer_window(window, layer, i):
    """Layer i's window: the caller's (one for all or a tuple per layer) and the layer's own
    (a Gemma 4 sliding layer's), the narrower when both; None: full attention."""
    w = window[i] if isinstance(window, tuple) else window
    own = layer.window
    return own if w is None else w if own is None else min(w, own)


def paged_forward(
    cfg: TargetConfig,
    params,
    tokens_T: jax.Array,
    cu_q_lens_R1: jax.Array,
    kv_lens_R: jax.Array,
    block_tables_RxB: jax.Array,
    cache: PagedKVCache,
    *,
    compute_logits: bool = True,
    q_per_req: int = 0,
    window: int | tuple[int | None, ...] | None = None,
    softcap: float | None = None,
    impl: str = "xla",
    write: bool = True,
) -> tuple[tf.ForwardOut, PagedKVCache | PagedNewKV]:
    """Returns ForwardOut with [1, T, ...] arrays (logits fp32, features, hidden) and the cache
    with the valid tokens' K/V written. Static: cfg, shapes, compute_logits, q_per_req (0:
    token-major attention; G: request-major, at most G new tokens per request), window (one for
    every layer or a tuple per layer; None: full attention; a Gemma 4 sliding layer always
    keeps its own, the narrower of the two wins), softcap, impl (the attention
    implementation, `paged_attention.register_impl`), write
    (False: the pools are only read, the tokens' K/V attended directly, and the second item is
    their `PagedNewKV` for `write_new_kv`; the same values up to float reassociation). Every
    valid token's position must lie inside its request's table (< B * page)."""
    model = tf.build(cfg, params)
    t = tokens_T.shape[0]
    tm = token_map(cu_q_lens_R1, kv_lens_R, t)
    slots_T = slot_mapping(block_tables_RxB, tm, cache.page_size)
    x, inputs = model.embed(tokens_T[None])  # [1, T, H], Gemma 4: per-layer inputs [1, T, L, P]
    pos_1xT = jnp.maximum(tm.pos, 0)[None]
    feats, out_k, out_v, pools = {}, [], [], {}
    for i, layer in enumerate(model.layers):
        # q [1, T, n, d], k / v [1, K, T, d] (None: a KV-shared layer reads its source's)
        q, k, v = layer.attention_inputs(x, pos_1xT)
        src = model.kv_source(i)
        if src == i:
            k_t, v_t = k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2)  # [T, K, d]
            if write:  # then read: in place (as packed.py)
                kp, vp = write_pages(cache.k[i], cache.v[i], k_t, v_t, slots_T)
                out_k.append(kp)
                out_v.append(vp)
            else:
                kp, vp = cache.k[i], cache.v[i]
                out_k.append(k_t)
                out_v.append(v_t)
            pools[i] = (kp, vp, None if write else (k_t, v_t))
        kp, vp, new_kv = pools[src]
        a = paged_attention(q[0], kp, vp, block_tables_RxB, kv_lens_R, cu_q_lens_R1,
                            q_per_req=q_per_req, window=_layer_window(window, layer, i),
                            softcap=softcap, scale=layer.scale, new_kv=new_kv,
                            impl=impl)  # fmt: skip
        x = layer.finish(x, a[None], None if inputs is None else inputs[:, :, i])
        if i in cfg.target_layer_ids:
            feats[cfg.target_layer_ids.index(i)] = x
    out = outputs(model, x, list(feats.items()), compute_logits)
    if not write:
        return out, PagedNewKV(tuple(out_k), tuple(out_v), slots_T)
    return out, PagedKVCache(tuple(out_k), tuple(out_v))


_STATIC = ("cfg", "compute_logits", "q_per_req", "window", "softcap", "impl", "write")
# the writing forward donates the pools (updated in place); the read-only one must not
paged_forward_jit = jax.jit(paged_forward, static_argnames=_STATIC, donate_argnames=("cache",))
paged_forward_kv_jit = jax.jit(functools.partial(paged_forward, write=False),
                               static_argnames=_STATIC[:-1])  # fmt: skip
