"""Pieces shared by the three drafters: parameter collections, the proposal type, attention
over (context prefix + own block), per-request draft keys and the draft sampling transform."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.models.transformer import apply_rope, rope_inv_freq
from dspark_jax.spec import rng as spec_rng
from dspark_jax.spec import sampling as spec_sampling

_NEG = -1e30


class FrozenParam(nnx.Variable):
    """A frozen copy of a target tensor (embedding, LM head). Not an `nnx.Param`, so
    `nnx.split(model, nnx.Param, FrozenParam)` keeps it out of the trainable state."""


class DrafterParams(NamedTuple):
    trainable: nnx.State  # nnx.Param leaves (what the optimizer updates)
    frozen: nnx.State  # FrozenParam leaves: embed_tokens [V, H], lm_head [H, V]


class Proposal(NamedTuple):
    tokens: jax.Array  # [B, γ] int32 draft tokens
    probs: jax.Array  # [B, γ, V] fp32, the exact distribution each token was drawn from
    conf_logits: jax.Array | None  # [B, γ] fp32 confidence logits ρ (DSpark only)


def dtype_of(name: str):
    return jnp.bfloat16 if name == "bfloat16" else jnp.float32


def normal_init(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def embed(frozen_table_VxH: jax.Array, tokens: jax.Array) -> jax.Array:
    return jnp.take(frozen_table_VxH, tokens, axis=0)


def lm_logits(lm_head_HxV: jax.Array, z: jax.Array) -> jax.Array:
    """fp32 logits [..., V] from normed hidden z [..., H]."""
    return jnp.einsum("...h,hv->...v", z, lm_head_HxV, preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------------------------
# attention pieces on the target's own Attention module (q/k/v/o projections, q/k norms)


def project_q(attn, x_BxTxI, positions_BxT):
    """Queries [B, T, n_q, d_h]: projection, q_norm (Qwen3), RoPE at `positions`."""
    c = attn.cfg
    b, t, _ = x_BxTxI.shape
    q = attn.q_proj(x_BxTxI).reshape(b, t, c.num_heads, c.head_dim)
    if attn.q_norm is not None:
        q = attn.q_norm(q)
    return apply_rope(q, positions_BxT, rope_inv_freq(c))


def project_kv(attn, x_BxTxI, positions_BxT):
    """Keys (k_norm + RoPE) and values [B, T, n_kv, d_h]."""
    c = attn.cfg
    b, t, _ = x_BxTxI.shape
    k = attn.k_proj(x_BxTxI).reshape(b, t, c.num_kv_heads, c.head_dim)
    v = attn.v_proj(x_BxTxI).reshape(b, t, c.num_kv_heads, c.head_dim)
    if attn.k_norm is not None:
        k = attn.k_norm(k)
    return apply_rope(k, positions_BxT, rope_inv_freq(c)), v


def joint_softmax(scores, masks):
    """One softmax over several score sets along their last axes (a log-sum-exp merge).

    scores: fp32 arrays [..., S_i]; masks: bools broadcastable to them. Masked entries get
    probability 0; a row with no visible entry gets all zeros, with finite (zero) gradients.
    """
    scores = [jnp.where(m, s, _NEG) for s, m in zip(scores, masks)]
    mx = jnp.max(scores[0], axis=-1, keepdims=True, initial=_NEG)
    for s in scores[1:]:
        mx = jnp.maximum(mx, jnp.max(s, axis=-1, keepdims=True, initial=_NEG))
    mx = jax.lax.stop_gradient(mx)
    es = [jnp.where(m, jnp.exp(s - mx), 0.0) for s, m in zip(scores, masks)]
    den = sum(e.sum(-1, keepdims=True) for e in es)
    inv = jnp.where(den > 0, 1.0 / jnp.where(den > 0, den, 1.0), 0.0)
    return [e * inv for e in es]


def block_attend(q_BxNxGxQxD, k_ctx_BxLxKxD, v_ctx_BxLxKxD, ctx_len_BxN, k_blk, v_blk, keep_BxN):
    """Anchor-bounded block attention (REFERENCE §2.5), the efficient form.

    Query slot g of block n sees context entries κ < ctx_len[b, n] and every slot of its own
    block (bidirectional) — nothing else; blocks with keep = False see nothing. The two score
    sets share one softmax (log-sum-exp merge). A row with no visible key returns 0 and has a
    zero, finite gradient (no NaN, unlike a plain masked softmax).

    Shapes: q [B, N, G, n_q, d]; context k/v [B, L, n_kv, d]; block k/v [B, N, G, n_kv, d];
    ctx_len [B, N] int; keep [B, N] bool. Returns [B, N, G, n_q * d] in q's dtype.
    """
    b, n, g, nq, d = q_BxNxGxQxD.shape
    nkv = k_ctx_BxLxKxD.shape[2]
    seq = k_ctx_BxLxKxD.shape[1]
    q = q_BxNxGxQxD.reshape(b, n, g, nkv, nq // nkv, d)
    scale = 1.0 / math.sqrt(d)
    f32 = jnp.float32
    s_ctx = jnp.einsum("bngkrd,blkd->bngkrl", q, k_ctx_BxLxKxD, preferred_element_type=f32)
    s_blk = jnp.einsum("bngkrd,bnhkd->bngkrh", q, k_blk, preferred_element_type=f32)
    s_ctx, s_blk = s_ctx * scale, s_blk * scale
    m_ctx = (jnp.arange(seq)[None, None, :] < ctx_len_BxN[:, :, None]) & keep_BxN[:, :, None]
    m_ctx = m_ctx[:, :, None, None, None, :]  # [B, N, 1, 1, 1, L]
    m_blk = keep_BxN[:, :, None, None, None, None]  # [B, N, 1, 1, 1, 1]
    p_ctx, p_blk = joint_softmax([s_ctx, s_blk], [m_ctx, m_blk])
    vd = v_ctx_BxLxKxD.dtype
    o = jnp.einsum("bngkrl,blkd->bngkrd", p_ctx.astype(vd), v_ctx_BxLxKxD)
    o = o + jnp.einsum("bngkrh,bnhkd->bngkrd", p_blk.astype(vd), v_blk)
    return o.reshape(b, n, g, nq * d).astype(q_BxNxGxQxD.dtype)


# ---------------------------------------------------------------------------------------------
# keys and the draft sampling transform


def draft_keys(
    key: jax.Array, seeds_B: jax.Array, positions_BxG: jax.Array, rounds_B=None
) -> jax.Array:
    """Per-(request, position) keys [B, G] of the DRAFT stream (`spec.rng`): independent of
    batch composition and padding, and disjoint from the target's and the acceptance draws.
    With `rounds_B` (the serving engine's per-request round counter) the DRAFT_ROUND stream is
    used instead, so a re-drafted position never reuses an earlier round's noise."""
    if rounds_B is not None:
        return spec_rng.round_position_keys(key, seeds_B, rounds_B, positions_BxG)
    return spec_rng.position_keys(key, spec_rng.DRAFT, seeds_B, positions_BxG)


def sampling_probs(logits_BxV: jax.Array, sampling, scfg) -> jax.Array:
    """The exact fp32 distribution a draft token is drawn from: the same transform as the
    target's (`spec.sampling.probs_from_logits`; `scfg.greedy` gives the one-hot argmax).
    `sampling=None` outside greedy mode means plain softmax (temperature 1)."""
    logits = logits_BxV.astype(jnp.float32)
    if scfg is None:
        scfg = spec_sampling.SamplingConfig()
    if sampling is None and not scfg.greedy:
        return jax.nn.softmax(logits, axis=-1)
    return spec_sampling.probs_from_logits(logits, sampling, scfg)


def draw_tokens(keys_B: jax.Array, probs_BxV: jax.Array, scfg) -> jax.Array:
    """One token per row from `probs` (greedy mode: the argmax, no randomness)."""
    if scfg is not None and scfg.greedy:
        return jnp.argmax(probs_BxV, axis=-1).astype(jnp.int32)
    return spec_sampling.sample_from_probs(keys_B, probs_BxV)
