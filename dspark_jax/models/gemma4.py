"""The Gemma 4 text decoder, composed from `models/layers.py` (the one attention) and
`models/gemma4_blocks.py`; `transformer.build` / `forward` dispatch here for architecture
"gemma4", so the forward and KV cache contracts are `transformer.py`'s.

Per layer (`cfg.gemma`): sliding-window layers attend to keys less than `sliding_window`
positions back, global ("full_attention") layers to every earlier key with their own head size,
K/V heads, RoPE (partial / proportional) and K = V option. Attention scores are not scaled
(q/k RMS norms set the temperature) and values are RMS-normed without a scale. Around attention
and the MLP: sandwich norms (pre and post); beside the MLP an optional mixture of experts; after
them an optional per-layer input; the layer's output times a learned scalar. The embedding is
scaled by sqrt(H), the logits soft-capped, the head tied or not.

KV cache: the dense cache of `transformer.py` with one entry per layer that computes K/V (the
KV-shared last layers read their source layer's entry, `Gemma4Config.kv_source`); here sliding
layers keep the whole context and see their window by masking. The serving engine's slot state
gives each sliding layer a ring of `sliding_window + γ + 1` entries instead (`ring_len`,
`init_cache(lookahead=γ + 1)`), which its packed forwards read and write (`models/packed.py`).

Each layer exposes `attention_inputs` (norm, q and its own k / v) and `finish` (everything after
attention), the model `embed` and `kv_source`, as `transformer.py`'s do: `__call__` and the
serving engine's packed forward (`models/packed.py`, slot layout) and paged forward
(`models/paged.py`, paged layout) compose the same layer code around their own cache step.

Shapes are written as suffixes: B batch, T tokens, S cache length, H hidden, L layers,
P per-layer input width.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import TargetConfig
from dspark_jax.models.cache import KVCache, outputs
from dspark_jax.models.gemma4_blocks import GELU, Experts, Router, ScaledEmbed, per_layer_inputs
from dspark_jax.models.layers import (
    MLP,
    Attention,
    AttentionShape,
    Linear,
    RMSNorm,
    attend,
    dtype_of,
    visible,
)

SLIDING = "sliding_attention"


def attention_shape(cfg: TargetConfig, layer: int) -> AttentionShape:
    g = cfg.gemma
    if g.layer_types[layer] == SLIDING:
        d, nkv, rope, k_eq_v = cfg.head_dim, cfg.num_kv_heads, (cfg.rope_theta, 1.0, 1.0), False
    else:
        rope = (g.global_rope_theta, g.global_rope_fraction, g.global_rope_factor)
        d, nkv, k_eq_v = g.global_head_dim, g.global_kv_heads, g.k_eq_v
    return AttentionShape(d, nkv, rope, k_eq_v=k_eq_v, has_kv=g.kv_source(layer) == layer)


class Gemma4Layer(nnx.Module):
    """`d_in`: the width the attention projections read (default H; the Eagle3 drafter's layer
    reads its 2H-wide [embedding; hidden] input)."""

    def __init__(self, cfg: TargetConfig, layer: int, *, rngs: nnx.Rngs, d_in=None):
        g, dt, h, eps = cfg.gemma, dtype_of(cfg.dtype), cfg.hidden_size, cfg.rms_norm_eps
        shape = attention_shape(cfg, layer)
        self.self_attn = Attention(cfg, rngs=rngs, shape=shape, d_in=d_in)
        wide = g.use_double_wide_mlp and not shape.has_kv
        width = cfg.intermediate_size * (2 if wide else 1)
        self.mlp = MLP(cfg, rngs=rngs, width=width, act="gelu_tanh")
        self.input_layernorm = RMSNorm(h, eps, dt)
        self.post_attention_layernorm = RMSNorm(h, eps, dt)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, dt)
        self.post_feedforward_layernorm = RMSNorm(h, eps, dt)
        self.layer_scalar = nnx.Param(jnp.ones((1,), dt), logical=(None,))
        if g.num_experts:  # beside the MLP, each with its own post-norm, then both summed
            self.router = Router(cfg, rngs=rngs)
            self.experts = Experts(cfg, rngs=rngs)
            self.pre_feedforward_layernorm_2 = RMSNorm(h, eps, dt)
            self.post_feedforward_layernorm_1 = RMSNorm(h, eps, dt)
            self.post_feedforward_layernorm_2 = RMSNorm(h, eps, dt)
        else:
            self.router = self.experts = None
        p = g.hidden_size_per_layer_input
        if p:
            self.per_layer_input_gate = Linear(h, p, rngs=rngs, dtype=dt, logical=("embed", None))
            self.per_layer_projection = Linear(p, h, rngs=rngs, dtype=dt, logical=(None, "embed"))
            self.post_per_layer_input_norm = RMSNorm(h, eps, dt)
        self.window = g.sliding_window if g.layer_types[layer] == SLIDING else None

    scale = 1.0  # attention scores unscaled: the q/k norms set the temperature

    def attention_inputs(self, x_BxTxH, positions_BxT):
        """Queries [B, T, n_q, d] and this layer's keys / values [B, n_kv, T, d] of the input
        (None, None for a KV-shared layer: it reads its source layer's)."""
        h = self.input_layernorm(x_BxTxH)
        q = self.self_attn.queries(h, positions_BxT)
        if self.self_attn.k_proj is None:
            return q, None, None
        return q, *self.self_attn.keys_values(h, positions_BxT)

    def finish(self, x_BxTxH, a_BxTxF, layer_input_BxTxP=None):
        """The layer's output from its input and its attention's output `a` [B, T, n_q * d]:
        o_proj, sandwich norms, MLP (and experts), per-layer input, the layer scalar."""
        x = x_BxTxH + self.post_attention_layernorm(self.self_attn.o_proj(a_BxTxF))
        f = self.mlp(self.pre_feedforward_layernorm(x))
        if self.experts is not None:
            x_NxH = x.reshape(-1, x.shape[-1])
            moe = self.experts(self.pre_feedforward_layernorm_2(x_NxH), self.router(x_NxH))
            moe = self.post_feedforward_layernorm_2(moe.reshape(x.shape))
            f = self.post_feedforward_layernorm_1(f) + moe
        x = x + self.post_feedforward_layernorm(f)
        if layer_input_BxTxP is not None:
            g = GELU(self.per_layer_input_gate(x)) * layer_input_BxTxP
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar[...]

    def __call__(self, x_BxTxH, positions_BxT, key_pos_BxS, kv, layer_input_BxTxP=None):
        """`kv`: this layer's cache entry (k, v) [B, n_kv, S, d] to write into, None for a
        cache-free pass, or for a KV-shared layer the source layer's full (k, v) to read.
        Returns (output, the (k, v) this layer attended to)."""
        q, k, v = self.attention_inputs(x_BxTxH, positions_BxT)
        if k is not None:
            if kv is not None:
                ck, cv = kv
                rows = jnp.arange(ck.shape[0])[:, None, None]
                heads = jnp.arange(ck.shape[1])[None, :, None]
                pos = positions_BxT[:, None, :]
                k = ck.at[rows, heads, pos].set(k.astype(ck.dtype), mode="drop")
                v = cv.at[rows, heads, pos].set(v.astype(cv.dtype), mode="drop")
            kv = (k, v)
        mask = visible(key_pos_BxS, positions_BxT, self.window)
        a = attend(q, [(kv[0], kv[1], mask)], scale=self.scale)
        return self.finish(x_BxTxH, a, layer_input_BxTxP), kv


class Gemma4(nnx.Module):
    """Scaled embedding, Gemma 4 layers, final norm, (tied or untied) soft-capped LM head; the
    per-layer inputs' model-level tables when `hidden_size_per_layer_input` > 0."""

    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs):
        dt, h, g = dtype_of(cfg.dtype), cfg.hidden_size, cfg.gemma
        self.cfg = cfg
        self.embed_tokens = ScaledEmbed(
            cfg.vocab_size, h, h**0.5, rngs=rngs, dtype=dt, logical=("vocab", "embed")
        )
        self.layers = nnx.List([Gemma4Layer(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dt)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(
                h, cfg.vocab_size, rngs=rngs, dtype=dt, logical=("embed", "vocab")
            )
        p = g.hidden_size_per_layer_input
        if p:
            lp = cfg.num_layers * p
            self.embed_tokens_per_layer = ScaledEmbed(
                g.vocab_size_per_layer_input,
                lp,
                p**0.5,
                rngs=rngs,
                dtype=dt,
                logical=("vocab", None),
            )
            self.per_layer_model_projection = Linear(
                h, lp, rngs=rngs, dtype=dt, logical=("embed", None)
            )
            self.per_layer_projection_norm = RMSNorm(p, cfg.rms_norm_eps, dt)

    def logits(self, hidden_BxTxH):
        """fp32 logits from the final-normed hidden state, soft-capped: c·tanh(logits / c)."""
        if self.lm_head is None:
            w = self.embed_tokens.weight[...]
            out = jnp.einsum("bth,vh->btv", hidden_BxTxH, w, preferred_element_type=jnp.float32)
        else:
            w = self.lm_head.kernel[...]
            out = jnp.einsum("bth,hv->btv", hidden_BxTxH, w, preferred_element_type=jnp.float32)
        cap = self.cfg.gemma.final_logit_softcapping
        return out if cap is None else cap * jnp.tanh(out / cap)

    def embed(self, tokens_BxT):
        """(the scaled embedding [B, T, H], the per-layer inputs [B, T, L, P] or None)."""
        x = self.embed_tokens(tokens_BxT)
        if not self.cfg.gemma.hidden_size_per_layer_input:
            return x, None
        args = (self.embed_tokens_per_layer, self.per_layer_model_projection)
        return x, per_layer_inputs(*args, self.per_layer_projection_norm, tokens_BxT, x)

    def kv_source(self, layer: int) -> int:
        return self.cfg.gemma.kv_source(layer)

    def __call__(self, tokens_BxT, positions_BxT, cache: KVCache | None, compute_logits=True):
        cfg, g = self.cfg, self.cfg.gemma
        x, inputs = self.embed(tokens_BxT)
        if cache is None:
            key_pos = positions_BxT
        elif any(k.shape[2] != cache.max_len for k in cache.k):
            raise ValueError("a cache with sliding-layer rings is read by models.packed only")
        else:
            s = cache.max_len
            key_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (tokens_BxT.shape[0], s))
        feats, kvs = [], []
        for i, layer in enumerate(self.layers):
            src = g.kv_source(i)
            if src != i:
                kv = kvs[src]
            else:
                kv = None if cache is None else (cache.k[i], cache.v[i])
            li = None if inputs is None else inputs[:, :, i]
            x, kv = layer(x, positions_BxT, key_pos, kv, li)
            if src == i:
                kvs.append(kv)
            if i in cfg.target_layer_ids:
                feats.append((cfg.target_layer_ids.index(i), x))
        if cache is not None:
            cache = cache._replace(k=tuple(k for k, _ in kvs), v=tuple(v for _, v in kvs))
        return outputs(self, x, feats, compute_logits), cache


def ring_len(cfg: TargetConfig, max_len: int, lookahead: int | None) -> int:
    """Entries of a sliding layer's cache: `sliding_window + lookahead` (a ring: the window of
    the oldest query plus the tokens one call writes per slot, so a call never overwrites a key
    it or a later call still reads; the serving engine's lookahead is γ + 1), or `max_len`
    (dense) when that is no longer, when `lookahead` is None, or when no global layer computes
    K/V (an all-sliding model's cache length would be the ring's)."""
    g = cfg.gemma
    n = cfg.num_layers - g.num_kv_shared_layers
    has_global = any(g.layer_types[i] != SLIDING for i in range(n))
    if lookahead is None or not has_global:
        return max_len
    return min(max_len, g.sliding_window + lookahead)


def init_cache(cfg: TargetConfig, batch: int, max_len: int, dtype=None,
               lookahead: int | None = None) -> KVCache:  # fmt: skip
    """Zeros for each layer that computes K/V, in that layer's geometry [B, n_kv, S, d]: S =
    max_len, a sliding layer's `ring_len(cfg, max_len, lookahead)`."""
    dt = dtype_of(cfg.dtype) if dtype is None else dtype
    g = cfg.gemma
    ring = ring_len(cfg, max_len, lookahead)
    k, v = [], []
    for i in range(cfg.num_layers - g.num_kv_shared_layers):
        s = attention_shape(cfg, i)
        n = ring if g.layer_types[i] == SLIDING else max_len
        k.append(jnp.zeros((batch, s.num_kv_heads, n, s.head_dim), dt))
        v.append(jnp.zeros((batch, s.num_kv_heads, n, s.head_dim), dt))
    return KVCache(tuple(k), tuple(v), jnp.zeros((batch,), jnp.int32))
