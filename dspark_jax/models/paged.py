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
are read back with the prefix (one key set, the `one_set` form of `packed.py`). Rejected K/V are
not erased: the next call's `kv_lens` say what is visible, and the next tokens overwrite them.

Shapes: T, R, B (pages per request bucket), P and page are static (one program per (T, R, B));
the values of tokens, cu_q_lens, kv_lens and block_tables are per call. This composes
`transformer.py`'s modules (same parameters, norms, RoPE, MLP, head) and swaps only the cache
step of each layer, so it equals `transformer.forward` on a dense cache up to float
reassociation.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.config import TargetConfig
from dspark_jax.models import transformer as tf
from dspark_jax.models.layers import dtype_of
from dspark_jax.models.paged_attention import (
    paged_attention,
    slot_mapping,
    token_map,
    write_pages,
)

__all__ = ["PagedKVCache", "init_paged_cache", "paged_forward", "paged_forward_jit"]


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
    """An all-zero pool of `num_pages` pages of `page_size` positions per layer."""
    dt = dtype_of(cfg.dtype) if dtype is None else dtype
    shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    k = tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers))
    v = tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers))
    return PagedKVCache(k, v)


def _layer_window(window, i):
    return window[i] if isinstance(window, tuple) else window


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
    fused: bool = False,
) -> tuple[tf.ForwardOut, PagedKVCache]:
    """Returns ForwardOut with [1, T, ...] arrays (logits fp32, features, hidden) and the cache
    with the valid tokens' K/V written. Static: cfg, shapes, compute_logits, q_per_req (0:
    token-major attention; G: request-major, at most G new tokens per request), window (one for
    every layer or a tuple per layer; None: full attention), softcap, impl (the attention
    implementation, `paged_attention.register_impl`), fused (`layers.Attention.qkv`). Every
    valid token's position must lie inside its request's table (< B * page)."""
    model = tf.build(cfg, params)
    t = tokens_T.shape[0]
    tm = token_map(cu_q_lens_R1, kv_lens_R, t)
    slots_T = slot_mapping(block_tables_RxB, tm, cache.page_size)
    x = jnp.take(model.embed_tokens[...], tokens_T, axis=0)[None]  # [1, T, H]
    pos_1xT = jnp.maximum(tm.pos, 0)[None]
    feats, out_k, out_v = {}, [], []
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        # q [1, T, n, d], k / v [1, K, T, d]
        q, k, v = attn.qkv(layer.input_layernorm(x), pos_1xT, fused=fused)
        kp, vp = write_pages(
            cache.k[i], cache.v[i], k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2), slots_T
        )
        a = paged_attention(q[0], kp, vp, block_tables_RxB, kv_lens_R, cu_q_lens_R1,
                            q_per_req=q_per_req, window=_layer_window(window, i),
                            softcap=softcap, impl=impl)  # fmt: skip
        x = x + attn.o_proj(a[None])
        x = x + layer.mlp(layer.post_attention_layernorm(x), fused=fused)
        out_k.append(kp)
        out_v.append(vp)
        if i in cfg.target_layer_ids:
            feats[cfg.target_layer_ids.index(i)] = x
    features = jnp.concatenate([feats[j] for j in sorted(feats)], axis=-1)
    hidden = model.norm(x)
    logits = model.logits(hidden) if compute_logits else None
    return tf.ForwardOut(logits, features, hidden), PagedKVCache(tuple(out_k), tuple(out_v))


paged_forward_jit = jax.jit(
    paged_forward,
    static_argnames=("cfg", "compute_logits", "q_per_req", "window", "softcap", "impl", "fused"),
    donate_argnames=("cache",),
)
