"""The target LM: one decoder for Qwen3 (q/k norm), Qwen2 (qkv bias) and Llama 3 (RoPE scaling);
`build`, `forward`, `init_cache` and `graphdef` dispatch a Gemma 4 config to `models/gemma4.py`.

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

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import TargetConfig
from dspark_jax.models import gemma4
from dspark_jax.models.cache import ForwardOut, KVCache, outputs
from dspark_jax.models.layers import (
    MLP,
    Attention,
    Linear,
    RMSNorm,
    apply_rope,
    attend,
    dtype_of,
    normal_init,
    rope_inv_freq,
)

__all__ = [  # the layers re-exported for the code that reads them from here
    "MLP",
    "Attention",
    "DecoderLayer",
    "ForwardOut",
    "KVCache",
    "Linear",
    "RMSNorm",
    "Transformer",
    "apply_rope",
    "build",
    "embedding_table",
    "model_class",
    "forward",
    "forward_jit",
    "graphdef",
    "init_cache",
    "init_params",
    "param_count",
    "rope_inv_freq",
]


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs):
        dt = dtype_of(cfg.dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.mlp = MLP(cfg, rngs=rngs)

    window = None  # full attention (a Gemma 4 sliding layer: its window)
    scale = None  # attention scores scaled by 1/sqrt(d) (`layers.attend`'s default)

    def attention_inputs(self, x_BxTxH, positions_BxT):
        """Queries [B, T, n_q, d], keys and values [B, n_kv, T, d] of the layer's input (the
        piece the packed and paged forwards compose, as `gemma4.Gemma4Layer`'s)."""
        return self.self_attn.qkv(self.input_layernorm(x_BxTxH), positions_BxT)

    def finish(self, x_BxTxH, a_BxTxF, layer_input=None):
        """The layer's output from its input and its attention's output [B, T, n_q * d]."""
        h = x_BxTxH + self.self_attn.o_proj(a_BxTxF)
        return h + self.mlp(self.post_attention_layernorm(h))

    def __call__(self, x_BxTxH, positions_BxT, kv_cache, key_positions_BxS):
        """kv_cache is (k, v) [B,nkv,S,d] to write into, or None for cache-free full sequence."""
        q, k, v = self.attention_inputs(x_BxTxH, positions_BxT)
        mask = key_positions_BxS[:, None, :] <= positions_BxT[:, :, None]
        if kv_cache is None:
            a = attend(q, [(k, v, mask)])
            new_kv = None
        else:
            ck, cv = kv_cache  # [B, n_kv, S, d]
            rows = jnp.arange(ck.shape[0])[:, None, None]
            heads = jnp.arange(ck.shape[1])[None, :, None]
            pos = positions_BxT[:, None, :]
            ck = ck.at[rows, heads, pos].set(k.astype(ck.dtype), mode="drop")
            cv = cv.at[rows, heads, pos].set(v.astype(cv.dtype), mode="drop")
            a = attend(q, [(ck, cv, mask)])
            new_kv = (ck, cv)
        return self.finish(x_BxTxH, a), new_kv


class Transformer(nnx.Module):
    """Embedding, decoder layers, final norm, (untied) LM head."""

    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs):
        dt = dtype_of(cfg.dtype)
        self.cfg = cfg
        self.embed_tokens = nnx.Param(
            normal_init(rngs, (cfg.vocab_size, cfg.hidden_size), dt), logical=("vocab", "embed")
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

    def embed(self, tokens_BxT):
        """(the embedding [B, T, H], None: no per-layer inputs; Gemma 4's `embed` has them)."""
        return jnp.take(self.embed_tokens[...], tokens_BxT, axis=0), None

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V `layer` attends to: itself (Gemma 4 has KV-shared layers)."""
        return layer

    def __call__(self, tokens_BxT, positions_BxT, cache: KVCache | None, compute_logits=True):
        cfg = self.cfg
        x, _ = self.embed(tokens_BxT)
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
        if cache is not None:
            cache = cache._replace(k=tuple(new_k), v=tuple(new_v))
        return outputs(self, x, feats, compute_logits), cache


def embedding_table(params: nnx.State) -> jax.Array:
    """The target's token embedding table [V, H] from its parameters (Gemma 4's `ScaledEmbed`
    holds it as `weight`; its sqrt(H) scale is applied in `embed`, not stored)."""
    e = params["embed_tokens"]
    return (e if isinstance(e, nnx.Variable) else e["weight"])[...]


def model_class(cfg: TargetConfig):
    """The module class of a target config: `Transformer`, or `gemma4.Gemma4` for Gemma 4."""
    return gemma4.Gemma4 if cfg.architecture == "gemma4" else Transformer


def init_cache(cfg: TargetConfig, batch: int, max_len: int, dtype=None,
               lookahead: int | None = None) -> KVCache:  # fmt: skip
    """Zeros [B, n_kv, max_len, d_h] per layer. `lookahead` (the serving engine's γ + 1): a
    Gemma 4 sliding layer keeps a ring of its window plus that many entries (`gemma4.ring_len`),
    which only `models.packed` reads; other layers and families ignore it."""
    if cfg.architecture == "gemma4":
        return gemma4.init_cache(cfg, batch, max_len, dtype, lookahead)
    dt = dtype_of(cfg.dtype) if dtype is None else dtype
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    z = tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers))
    z2 = tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers))
    return KVCache(z, z2, jnp.zeros((batch,), jnp.int32))


@functools.lru_cache(maxsize=64)
def graphdef(cfg: TargetConfig):
    """The (static) NNX graph definition for a config, without allocating parameters."""
    abstract = nnx.eval_shape(lambda: model_class(cfg)(cfg, rngs=nnx.Rngs(0)))
    return nnx.split(abstract)[0]


def init_params(cfg: TargetConfig, seed: int = 0) -> nnx.State:
    """Random parameters (HF default init: N(0, 0.02) weights, zero biases, unit norms)."""
    return nnx.split(model_class(cfg)(cfg, rngs=nnx.Rngs(seed)))[1]


def build(cfg: TargetConfig, params: nnx.State) -> Transformer | gemma4.Gemma4:
    return nnx.merge(graphdef(cfg), params)


def untie_lm_head(cfg: TargetConfig, params: nnx.State) -> tuple[TargetConfig, nnx.State]:
    """The same model with an untied LM head: (cfg with tie_word_embeddings=False, params with
    `lm_head.kernel` = a materialised [H, V] copy of the embedding table). Identical logits; the
    head's product then reads its weight in [in, out] order, which XLA:CPU's own dot kernels run
    several times faster than the tied table's transposed read at a few rows (the serving engine
    runs a tied target this way on CPU: `engine.engine.untie_applies`). An untied model is
    returned unchanged."""
    if not cfg.tie_word_embeddings:
        return cfg, params
    untied = dataclasses.replace(cfg, tie_word_embeddings=False)
    out = nnx.split(nnx.eval_shape(lambda: model_class(untied)(untied, rngs=nnx.Rngs(0))))[1]
    pure = params.to_pure_dict()
    table = pure["embed_tokens"]
    table = table["weight"] if isinstance(table, dict) else table  # Gemma 4: a ScaledEmbed
    pure["lm_head"] = {"kernel": jnp.transpose(table)}  # a new [H, V] buffer
    nnx.replace_by_pure_dict(out, pure)
    return untied, out


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
