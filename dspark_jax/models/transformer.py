"""The target LM: one decoder for Qwen3 (q/k norm), Qwen2 (qkv bias) and Llama 3 (RoPE scaling).

Flax NNX modules hold the parameters; the jit boundary is the pure function `forward`, which
merges a cached graph definition with a parameter `nnx.State`. One forward serves prefill,
one-token decode and multi-token verification:

    forward(cfg, params, tokens_BxT, positions_BxT, cache) -> (ForwardOut, cache)

KV cache contract: the cache has a static shape [B, S] per layer. A token at position p writes
its K/V to cache index p, and a query at position p attends to cache indices <= p. Callers feed
each slot's new tokens at contiguous positions starting at the slot's committed length, so every
index <= p was written either by a committed token or by this same call: entries past a slot's
length are never read before they are overwritten, and rolling back rejected tokens is just a
length update (`KVCache.lengths`). Writes past S are dropped (padding rows may point there).

Parameters store logical axis names as `logical=` metadata; `parallel.py` maps them to mesh axes.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import TargetConfig

_INIT_STD = 0.02


def _dtype(name: str):
    return jnp.bfloat16 if name == "bfloat16" else jnp.float32


def _normal(rngs: nnx.Rngs, shape, dtype, std=_INIT_STD):
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class RMSNorm(nnx.Module):
    """y = w * cast_back(x32 * rsqrt(mean(x32^2) + eps)); statistics in fp32 (HF convention)."""

    def __init__(self, dim: int, eps: float, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype), logical=("norm",))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * y.astype(x.dtype)


class Linear(nnx.Module):
    """x @ kernel (+ bias); kernel stored [in, out] (Hugging Face stores [out, in])."""

    def __init__(self, d_in, d_out, *, rngs, dtype, logical, bias=False):
        self.kernel = nnx.Param(_normal(rngs, (d_in, d_out), dtype), logical=logical)
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype), logical=logical[1:]) if bias else None

    def __call__(self, x):
        y = x @ self.kernel[...]
        if self.bias is not None:
            y = y + self.bias[...]
        return y


def rope_inv_freq(cfg: TargetConfig, head_dim: int | None = None) -> jax.Array:
    """Inverse frequencies [d_h/2], with Llama-3 frequency scaling when configured."""
    d = head_dim or cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    s = cfg.rope_scaling
    if s is None:
        return inv
    low_wl = s.original_max_position_embeddings / s.low_freq_factor
    high_wl = s.original_max_position_embeddings / s.high_freq_factor
    wl = 2 * math.pi / inv
    scaled = jnp.where(wl > low_wl, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wl - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wl >= high_wl) & (wl <= low_wl)
    return jnp.where(medium, smoothed, scaled)


def apply_rope(x_BxTxNxD, positions_BxT, inv_freq):
    """Non-interleaved ("rotate half") RoPE, computed in fp32."""
    freqs = positions_BxT.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(freqs)[:, :, None, :]
    sin = jnp.sin(freqs)[:, :, None, :]
    x = x_BxTxNxD.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxD.dtype)


def attend(q_BxTxNxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, *, kv_heads_first: bool = False):
    """GQA attention in fp32 softmax. Rows with no visible key return 0 (never NaN).

    K/V are [B, S, n_kv, d] or, with `kv_heads_first`, [B, n_kv, S, d] (the KV cache layout:
    the (batch, head) matmul dims lead, so XLA reads the cache without a transposing copy)."""
    b, t, n, d = q_BxTxNxD.shape
    kv = k_BxSxKxD.shape[1] if kv_heads_first else k_BxSxKxD.shape[2]
    q = q_BxTxNxD.reshape(b, t, kv, n // kv, d)
    ks = "bksd" if kv_heads_first else "bskd"
    s = jnp.einsum(f"btkrd,{ks}->bkrts", q, k_BxSxKxD, preferred_element_type=jnp.float32)
    s = s * (1.0 / math.sqrt(d))
    m = mask_BxTxS[:, None, None, :, :]
    s = jnp.where(m, s, -1e30)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(m, p, 0.0)
    o = jnp.einsum(f"bkrts,{ks}->btkrd", p.astype(v_BxSxKxD.dtype), v_BxSxKxD)
    return o.reshape(b, t, n * d)


class Attention(nnx.Module):
    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs):
        dt = _dtype(cfg.dtype)
        h, nq, nkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        b = cfg.qkv_bias
        self.q_proj = Linear(h, nq * d, rngs=rngs, dtype=dt, logical=("embed", "heads"), bias=b)
        self.k_proj = Linear(h, nkv * d, rngs=rngs, dtype=dt, logical=("embed", "kv"), bias=b)
        self.v_proj = Linear(h, nkv * d, rngs=rngs, dtype=dt, logical=("embed", "kv"), bias=b)
        self.o_proj = Linear(nq * d, h, rngs=rngs, dtype=dt, logical=("heads", "embed"))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dt)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dt)
        else:
            self.q_norm = self.k_norm = None
        self.cfg = cfg

    def qkv(self, x_BxTxH, positions_BxT):
        """Projected, normed and rotated q [B,T,nq,d], k and v [B,T,nkv,d]."""
        c = self.cfg
        b, t, _ = x_BxTxH.shape
        q = self.q_proj(x_BxTxH).reshape(b, t, c.num_heads, c.head_dim)
        k = self.k_proj(x_BxTxH).reshape(b, t, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x_BxTxH).reshape(b, t, c.num_kv_heads, c.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv = rope_inv_freq(c)
        return apply_rope(q, positions_BxT, inv), apply_rope(k, positions_BxT, inv), v


class MLP(nnx.Module):
    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs):
        dt = _dtype(cfg.dtype)
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(h, f, rngs=rngs, dtype=dt, logical=("embed", "mlp"))
        self.up_proj = Linear(h, f, rngs=rngs, dtype=dt, logical=("embed", "mlp"))
        self.down_proj = Linear(f, h, rngs=rngs, dtype=dt, logical=("mlp", "embed"))

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs):
        dt = _dtype(cfg.dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x_BxTxH, positions_BxT, kv_cache, key_positions_BxS):
        """kv_cache is (k, v) [B,nkv,S,d] to write into, or None for cache-free full sequence."""
        q, k, v = self.self_attn.qkv(self.input_layernorm(x_BxTxH), positions_BxT)
        mask = key_positions_BxS[:, None, :] <= positions_BxT[:, :, None]
        if kv_cache is None:
            a = attend(q, k, v, mask)
            new_kv = None
        else:
            ck, cv = kv_cache  # [B, n_kv, S, d]
            rows = jnp.arange(ck.shape[0])[:, None, None]
            heads = jnp.arange(ck.shape[1])[None, :, None]
            pos = positions_BxT[:, None, :]
            ck = ck.at[rows, heads, pos].set(k.transpose(0, 2, 1, 3).astype(ck.dtype), mode="drop")
            cv = cv.at[rows, heads, pos].set(v.transpose(0, 2, 1, 3).astype(cv.dtype), mode="drop")
            a = attend(q, ck.astype(q.dtype), cv.astype(q.dtype), mask, kv_heads_first=True)
            new_kv = (ck, cv)
        h = x_BxTxH + self.self_attn.o_proj(a)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, new_kv


class Transformer(nnx.Module):
    """Embedding, decoder layers, final norm, (untied) LM head."""

    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs):
        dt = _dtype(cfg.dtype)
        self.cfg = cfg
        self.embed_tokens = nnx.Param(
            _normal(rngs, (cfg.vocab_size, cfg.hidden_size), dt), logical=("vocab", "embed")
        )
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(
                cfg.hidden_size, cfg.vocab_size, rngs=rngs, dtype=dt, logical=("embed", "vocab")
            )

    def logits(self, hidden_BxTxH):
        """fp32 logits from the final-normed hidden state."""
        if self.lm_head is None:
            w = self.embed_tokens[...]
            return jnp.einsum("bth,vh->btv", hidden_BxTxH, w, preferred_element_type=jnp.float32)
        return jnp.einsum(
            "bth,hv->btv",
            hidden_BxTxH,
            self.lm_head.kernel[...],
            preferred_element_type=jnp.float32,
        )

    def __call__(self, tokens_BxT, positions_BxT, cache: KVCache | None, compute_logits=True):
        cfg = self.cfg
        x = jnp.take(self.embed_tokens[...], tokens_BxT, axis=0)
        if cache is None:
            key_pos = positions_BxT
        else:
            s = cache.max_len
            key_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (tokens_BxT.shape[0], s))
        feats, new_k, new_v = [], [], []
        for i, layer in enumerate(self.layers):
            kv = None if cache is None else (cache.k[i], cache.v[i])
            x, kv = layer(x, positions_BxT, kv, key_pos)
            if kv is not None:
                new_k.append(kv[0])
                new_v.append(kv[1])
            if i in cfg.target_layer_ids:
                feats.append((cfg.target_layer_ids.index(i), x))
        features = jnp.concatenate([f for _, f in sorted(feats, key=lambda t: t[0])], axis=-1)
        hidden = self.norm(x)
        logits = self.logits(hidden) if compute_logits else None
        if cache is not None:
            cache = cache._replace(k=tuple(new_k), v=tuple(new_v))
        return ForwardOut(logits, features, hidden), cache


class ForwardOut(NamedTuple):
    logits: jax.Array | None  # [B, T, V] fp32 (None when compute_logits=False)
    features: jax.Array  # [B, T, m*H] raw outputs of cfg.target_layer_ids, concatenated in order
    hidden: jax.Array  # [B, T, H] final-normed last hidden state


class KVCache(NamedTuple):
    """Per-layer K and V [B, n_kv, S, d_h] and committed lengths [B] (int32)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    def with_lengths(self, lengths) -> KVCache:
        """Commit / roll back: only the length moves, K/V past it are simply never read."""
        return self._replace(lengths=jnp.asarray(lengths, jnp.int32))


def init_cache(cfg: TargetConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    dt = _dtype(cfg.dtype) if dtype is None else dtype
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    z = tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers))
    z2 = tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers))
    return KVCache(z, z2, jnp.zeros((batch,), jnp.int32))


@functools.lru_cache(maxsize=64)
def graphdef(cfg: TargetConfig):
    """The (static) NNX graph definition for a config, without allocating parameters."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return nnx.split(abstract)[0]


def init_params(cfg: TargetConfig, seed: int = 0) -> nnx.State:
    """Random parameters (HF default init: N(0, 0.02) weights, zero biases, unit norms)."""
    return nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)))[1]


def build(cfg: TargetConfig, params: nnx.State) -> Transformer:
    return nnx.merge(graphdef(cfg), params)


def forward(
    cfg: TargetConfig,
    params: nnx.State,
    tokens_BxT: jax.Array,
    positions_BxT: jax.Array,
    cache: KVCache | None = None,
    *,
    compute_logits: bool = True,
) -> tuple[ForwardOut, KVCache | None]:
    """Pure forward. Static: cfg, compute_logits, shapes. Arrays: params, tokens, positions, cache.

    With `cache=None` the call is a causal full-sequence pass over its own tokens (masking by
    positions, so right padding is harmless). With a cache, K/V are written at `positions` and
    each query sees cache indices <= its position (see the module docstring for the contract).
    The cache's `lengths` are not changed here: commit with `cache.with_lengths(...)`.
    """
    return build(cfg, params)(tokens_BxT, positions_BxT, cache, compute_logits)


forward_jit = jax.jit(
    forward, static_argnames=("cfg", "compute_logits"), donate_argnames=("cache",)
)


def param_count(params: nnx.State) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
