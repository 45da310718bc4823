"""The DFlash backbone shared by DSpark and DFlash (REFERENCE §2).

Context: C = hidden_norm(fc(F)) [B, L, H] from the concatenated target features F [B, L, m·H];
the same C feeds every layer's keys/values (no input_layernorm on C). A block is γ slots:
the anchor token then γ−1 mask tokens at positions a + k. In every layer the block's queries
attend the context's K/V at positions < a (strictly before the anchor: the anchor's own feature
is not visible, its token is) and the block's own K/V bidirectionally; z = norm(h) after the
layers, base logits U = lm_head(z).

Training processes N_a blocks at once (`BlockDrafter.blocks`, anchor-bounded packing, §2.5);
inference keeps a context KV cache (`BlockContext`, §2.9) and runs one block per request.
Both use `common.block_attend`, so the two paths are the same computation.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.drafters.common import (
    FrozenParam,
    block_attend,
    dtype_of,
    embed,
    lm_logits,
    normal_init,
    project_kv,
    project_q,
)
from dspark_jax.drafters.heads import ConfidenceHead, MarkovHead
from dspark_jax.models.transformer import DecoderLayer, Linear, RMSNorm


class BlockDrafter(nnx.Module):
    """DSpark / DFlash drafter parameters (HF names: embed_tokens, lm_head, fc, hidden_norm,
    layers.i.*, norm, markov_head.*, confidence_head.proj)."""

    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs):
        dt = dtype_of(cfg.dtype)
        lc = cfg.layer_config
        v, h = cfg.vocab_size, cfg.hidden_size
        self.cfg = cfg
        self.embed_tokens = FrozenParam(normal_init(rngs, (v, h), dt), logical=("vocab", "embed"))
        self.lm_head = FrozenParam(normal_init(rngs, (h, v), dt), logical=("embed", "vocab"))
        self.fc = Linear(cfg.feature_size, h, rngs=rngs, dtype=dt, logical=(None, "embed"))
        self.hidden_norm = RMSNorm(h, lc.rms_norm_eps, dt)
        self.layers = nnx.List([DecoderLayer(lc, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(h, lc.rms_norm_eps, dt)
        self.markov_head = MarkovHead(cfg, rngs=rngs) if cfg.markov_rank else None
        self.confidence_head = ConfidenceHead(cfg, rngs=rngs) if cfg.confidence_head else None

    # -- context ---------------------------------------------------------------------------

    def context(self, features_BxTxF):
        """Projected context C = hidden_norm(fc(F)) [B, T, H]."""
        dt = dtype_of(self.cfg.dtype)
        return self.hidden_norm(self.fc(features_BxTxF.astype(dt)))

    def context_kv(self, features_BxTxF, positions_BxT):
        """Per layer (k, v) [B, T, n_kv, d_h] of the projected context at `positions`."""
        c = self.context(features_BxTxF)
        return [project_kv(layer.self_attn, c, positions_BxT) for layer in self.layers]

    # -- blocks ----------------------------------------------------------------------------

    def blocks(self, ctx_kv, ctx_len_BxN, keep_BxN, ids_BxNxG, pos_BxNxG):
        """Normed backbone outputs z [B, N, G, H] for N blocks of G slots.

        ctx_kv: per layer (k, v) [B, S, n_kv, d_h] (training: the sequence's own context;
        inference: the context cache). Block n sees context entries < ctx_len[b, n] and itself.
        """
        x = embed(self.embed_tokens[...], ids_BxNxG)
        return self.blocks_from_embeddings(ctx_kv, ctx_len_BxN, keep_BxN, x, pos_BxNxG)

    def blocks_from_embeddings(self, ctx_kv, ctx_len_BxN, keep_BxN, x_BxNxGxH, pos_BxNxG):
        """`blocks` on input embeddings [B, N, G, H] (differentiable inputs, for tests)."""
        b, n, g = pos_BxNxG.shape
        pos = pos_BxNxG.reshape(b, n * g)
        x = x_BxNxGxH.reshape(b, n * g, -1)
        for layer, (kc, vc) in zip(self.layers, ctx_kv):
            attn = layer.self_attn
            u = layer.input_layernorm(x)
            q = project_q(attn, u, pos)  # [B, N·G, n_q, d_h]
            kb, vb = project_kv(attn, u, pos)  # [B, N·G, n_kv, d_h]
            q = q.reshape(b, n, g, *q.shape[2:])
            kb = kb.reshape(b, n, g, *kb.shape[2:])
            vb = vb.reshape(b, n, g, *vb.shape[2:])
            kc, vc = kc.astype(q.dtype), vc.astype(q.dtype)
            a = block_attend(
                q, kc, vc, ctx_len_BxN, kb.astype(q.dtype), vb.astype(q.dtype), keep_BxN
            )
            x = x + attn.o_proj(a.reshape(b, n * g, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x).reshape(b, n, g, -1)

    def base_logits(self, z):
        """U = lm_head(z) [..., V] fp32."""
        return lm_logits(self.lm_head[...], z)


# ---------------------------------------------------------------------------------------------
# inference context cache (REFERENCE §2.9)


class BlockContext(NamedTuple):
    """The drafter's own context cache: per layer K (k_norm + RoPE at absolute positions) and V
    [B, S, n_kv, d_h] of the projected target features of committed positions, and `lengths`
    [B] int32 = number of committed positions whose features are cached (= the next anchor's
    position). Entries at or past `lengths` are never read."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array


def init_block_context(cfg: DrafterConfig, batch: int, max_len: int) -> BlockContext:
    lc = cfg.layer_config
    shape = (batch, max_len, lc.num_kv_heads, lc.head_dim)
    dt = dtype_of(cfg.dtype)
    k = tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers))
    v = tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers))
    return BlockContext(k, v, jnp.zeros((batch,), jnp.int32))


def extend_block_context(model: BlockDrafter, ctx: BlockContext, features_BxTxF, num_new_B):
    """Write the K/V of features at positions lengths + t (t < num_new[b]); lengths += num_new.

    Rows of `features` past num_new[b] are ignored (their writes are dropped)."""
    b, t, _ = features_BxTxF.shape
    s = ctx.k[0].shape[1]
    offs = jnp.arange(t, dtype=jnp.int32)[None, :]
    pos = ctx.lengths[:, None] + offs  # [B, T]
    write = jnp.where(offs < num_new_B[:, None], pos, s)  # index s -> dropped
    kv = model.context_kv(features_BxTxF, pos)
    rows = jnp.arange(b)[:, None]
    ks, vs = [], []
    for (kn, vn), ck, cv in zip(kv, ctx.k, ctx.v):
        ks.append(ck.at[rows, write].set(kn.astype(ck.dtype), mode="drop"))
        vs.append(cv.at[rows, write].set(vn.astype(cv.dtype), mode="drop"))
    return BlockContext(tuple(ks), tuple(vs), ctx.lengths + num_new_B.astype(jnp.int32))


def single_block(model: BlockDrafter, ctx: BlockContext, anchor_B):
    """z [B, γ, H] of one block per request: anchor + mask tokens at positions lengths + k,
    seeing the cached context < lengths and the block itself (the training mask with N = 1)."""
    cfg = model.cfg
    g = cfg.block_size
    b = anchor_B.shape[0]
    ids = jnp.full((b, 1, g), cfg.mask_token_id, jnp.int32).at[:, 0, 0].set(anchor_B)
    pos = ctx.lengths[:, None, None] + jnp.arange(g, dtype=jnp.int32)[None, None, :]
    keep = jnp.ones((b, 1), bool)
    z = model.blocks(list(zip(ctx.k, ctx.v)), ctx.lengths[:, None], keep, ids, pos)
    return z[:, 0]
