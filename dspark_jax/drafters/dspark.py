"""DSpark and DFlash: the block drafter (docs/METHOD.md §2) and DSpark's sequential heads (§3).

Backbone (`BlockDrafter`; DFlash is this module without heads). Context: C = hidden_norm(fc(F))
[B, L, H] from the concatenated target features F [B, L, m·H]; the same C feeds every layer's
keys/values (no input_layernorm on C). A block is γ slots: the anchor token then γ−1 mask tokens
at positions a + k. In every layer the block's queries attend the context's K/V at positions < a
(strictly before the anchor: the anchor's own feature is not visible, its token is) and the
block's own K/V bidirectionally; z = norm(h) after the layers, base logits U = lm_head(z).

Training processes N_a blocks at once (`BlockDrafter.blocks`, anchor-bounded packing, §2.5);
inference keeps a context KV cache (`BlockContext`, §2.9, heads-first like the target's cache)
and runs one block per request. Both are `layers.attend` over (context, own block), so the two
paths are the same computation.

Heads (DSpark): a Markov head and a confidence head on z. Training (`teacher_forced`): previous
tokens are the ground truth, prev[j] = [x_a, x_{a+1}, …, x_{a+γ−1}], all slots in parallel (RNN:
a γ-step scan). Inference (`propose_block`): the backbone runs once per block, then a `lax.scan`
over the γ slots samples left to right — slot 0's previous token is the anchor, slot k's is the
token just drawn at slot k−1 — recording the exact distribution (after the sampling transform)
each token was drawn from (docs/METHOD.md §3.4).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.drafters.common import (
    FrozenParam,
    Proposal,
    draft_keys,
    draft_noise,
    draw_tokens,
    embed,
    lm_logits,
    sampling_probs,
)
from dspark_jax.drafters.heads import ConfidenceHead, MarkovHead
from dspark_jax.models.gemma4 import Gemma4Layer
from dspark_jax.models.layers import Linear, RMSNorm, attend, dtype_of, normal_init, visible
from dspark_jax.models.transformer import DecoderLayer


def draft_layer(cfg: DrafterConfig, i: int, rngs: nnx.Rngs):
    """Draft layer i: the target architecture's decoder layer on `cfg.layer_config` (Gemma 4: a
    `Gemma4Layer`, full attention in the global geometry, sandwich norms and layer scalar)."""
    lc = cfg.layer_config
    return DecoderLayer(lc, rngs=rngs) if lc.gemma is None else Gemma4Layer(lc, i, rngs=rngs)


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
        self.layers = nnx.List([draft_layer(cfg, i, rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(h, lc.rms_norm_eps, dt)
        self.markov_head = MarkovHead(cfg, rngs=rngs) if cfg.markov_rank else None
        self.confidence_head = ConfidenceHead(cfg, rngs=rngs) if cfg.confidence_head else None

    # -- context ---------------------------------------------------------------------------

    def context(self, features_BxTxF):
        """Projected context C = hidden_norm(fc(F)) [B, T, H]."""
        dt = dtype_of(self.cfg.dtype)
        return self.hidden_norm(self.fc(features_BxTxF.astype(dt)))

    def context_kv(self, features_BxTxF, positions_BxT):
        """Per layer (k, v) [B, n_kv, T, d_h] of the projected context at `positions`."""
        c = self.context(features_BxTxF)
        return [layer.self_attn.keys_values(c, positions_BxT) for layer in self.layers]

    # -- blocks ----------------------------------------------------------------------------

    def blocks(self, ctx_kv, ctx_len_BxN, keep_BxN, ids_BxNxG, pos_BxNxG):
        """Normed backbone outputs z [B, N, G, H] for N blocks of G slots.

        ctx_kv: per layer (k, v) [B, n_kv, S, d_h] (training: the sequence's own context;
        inference: the context cache). Block n sees context entries < ctx_len[b, n] (with
        `cfg.context_window` W > 0 only those >= ctx_len[b, n] - W) and itself.
        """
        x = embed(self.embed_tokens[...], ids_BxNxG, self.cfg.embed_scale)
        return self.blocks_from_embeddings(ctx_kv, ctx_len_BxN, keep_BxN, x, pos_BxNxG)

    def blocks_from_embeddings(self, ctx_kv, ctx_len_BxN, keep_BxN, x_BxNxGxH, pos_BxNxG):
        """`blocks` on input embeddings [B, N, G, H] (differentiable inputs, for tests).

        Anchor-bounded block attention (docs/METHOD.md §2.5): query slot g of block n sees context
        entries κ < ctx_len[b, n] and every slot of its own block (bidirectional), nothing
        else; blocks with keep = False see nothing (their rows are 0, with zero gradient). One
        `attend` over two sets: the context (every block reads it) and the block's own slots
        (grouped: block n reads only its own G keys). A context window narrows the context
        set's mask only (as a sliding-window layer's), so training and serving agree."""
        b, n, g = pos_BxNxG.shape
        pos = pos_BxNxG.reshape(b, n * g)
        x = x_BxNxGxH.reshape(b, n * g, -1)
        seq = ctx_kv[0][0].shape[2]
        # context κ <= anchor - 1 (within the last W positions with a window), as a query at
        # the anchor's previous position would see it
        key_pos = jnp.broadcast_to(jnp.arange(seq), (b, seq))
        m_ctx = visible(key_pos, ctx_len_BxN - 1, self.cfg.context_window or None)  # [B, N, S]
        m_ctx = (m_ctx & keep_BxN[:, :, None])[:, :, None, :]  # [B, N, 1, S]
        m_blk = keep_BxN[:, :, None, None]  # [B, N, 1, 1]
        for layer, (kc, vc) in zip(self.layers, ctx_kv):
            q, kb, vb = layer.attention_inputs(x, pos)  # kb, vb [B, n_kv, N·G, d_h]
            kb = kb.reshape(b, kb.shape[1], n, g, -1).transpose(0, 2, 1, 3, 4)  # [B, N, n_kv, G, d]
            vb = vb.reshape(b, vb.shape[1], n, g, -1).transpose(0, 2, 1, 3, 4)
            a = attend(q, [(kc, vc, m_ctx), (kb, vb, m_blk)], scale=layer.scale)
            x = layer.finish(x, a)
        return self.norm(x).reshape(b, n, g, -1)

    def base_logits(self, z):
        """U = lm_head(z) [..., V] fp32 (Gemma 4: soft-capped, before any Markov bias)."""
        return lm_logits(self.lm_head[...], z, self.cfg.logit_softcap)


# ---------------------------------------------------------------------------------------------
# inference context cache (docs/METHOD.md §2.9)


class BlockContext(NamedTuple):
    """The drafter's own context cache: per layer K (k_norm + RoPE at absolute positions) and V
    [B, n_kv, S, d_h] (heads-first, as the target's cache) of the projected target features of committed positions, and `lengths`
    [B] int32 = number of committed positions whose features are cached (= the next anchor's
    position). Entries at or past `lengths` are never read."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array


def init_block_context(cfg: DrafterConfig, batch: int, max_len: int) -> BlockContext:
    nkv, d = cfg.kv_geometry
    shape = (batch, nkv, max_len, d)
    dt = dtype_of(cfg.dtype)
    k = tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers))
    v = tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers))
    return BlockContext(k, v, jnp.zeros((batch,), jnp.int32))


def extend_block_context(model: BlockDrafter, ctx: BlockContext, features_BxTxF, num_new_B):
    """Write the K/V of features at positions lengths + t (t < num_new[b]); lengths += num_new.

    Rows of `features` past num_new[b] are ignored (their writes are dropped)."""
    b, t, _ = features_BxTxF.shape
    s = ctx.k[0].shape[2]
    offs = jnp.arange(t, dtype=jnp.int32)[None, :]
    pos = ctx.lengths[:, None] + offs  # [B, T]
    write = jnp.where(offs < num_new_B[:, None], pos, s)[:, None, :]  # index s -> dropped
    kv = model.context_kv(features_BxTxF, pos)  # per layer [B, n_kv, T, d_h]
    rows = jnp.arange(b)[:, None, None]
    heads = jnp.arange(ctx.k[0].shape[1])[None, :, None]
    ks, vs = [], []
    for (kn, vn), ck, cv in zip(kv, ctx.k, ctx.v):
        ks.append(ck.at[rows, heads, write].set(kn.astype(ck.dtype), mode="drop"))
        vs.append(cv.at[rows, heads, write].set(vn.astype(cv.dtype), mode="drop"))
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


class BlockOutputs(NamedTuple):
    logits: jax.Array  # [B, N, γ, V] fp32, Markov-corrected draft logits U + B
    conf_logits: jax.Array | None  # [B, N, γ] fp32 confidence logits ρ (None without the head)


def teacher_forced(model: BlockDrafter, z_BxNxGxH, prev_BxNxG) -> BlockOutputs:
    """Corrected logits and confidence logits under teacher-forced previous tokens."""
    logits = model.base_logits(z_BxNxGxH)
    e = None
    if model.markov_head is not None:
        bias, e = model.markov_head.teacher_forced(prev_BxNxG, z_BxNxGxH)
        logits = logits + bias
    conf = None
    if model.confidence_head is not None:
        conf = model.confidence_head(z_BxNxGxH, e)
    return BlockOutputs(logits, conf)


def propose_block(
    model: BlockDrafter,
    ctx: BlockContext,
    anchor_B,
    key,
    seeds_B,
    sampling=None,
    scfg=None,
    forced_BxG=None,
    rounds_B=None,
) -> Proposal:
    """One block per request from the cached context, then sequential sampling.

    `forced_BxG` (tests, scoring): use these tokens instead of sampling; the recorded
    distributions are then exactly the teacher-forced ones of the training path.
    `rounds_B` (serving engine): key the draft noise by the request's round counter too.
    """
    z = single_block(model, ctx, anchor_B)  # [B, γ, H]
    return propose_from_block(model, z, ctx.lengths, anchor_B, key, seeds_B, sampling, scfg,
                              forced_BxG, rounds_B)  # fmt: skip


def propose_from_block(model: BlockDrafter, z, lengths_B, anchor_B, key, seeds_B, sampling=None,
                       scfg=None, forced_BxG=None, rounds_B=None) -> Proposal:  # fmt: skip
    """`propose_block` from the block's backbone output z [B, γ, H] (the dense context's
    `single_block` or the paged one's, `drafters.paged_context`): heads and sampling."""
    cfg = model.cfg
    g = cfg.block_size
    b = anchor_B.shape[0]
    base = model.base_logits(z)  # [B, γ, V]
    positions = lengths_B[:, None] + 1 + jnp.arange(g, dtype=jnp.int32)[None, :]
    keys = draft_keys(key, seeds_B, positions, rounds_B)  # [B, γ]
    # slot-major [γ, B, V], as the scan consumes it
    noise = None if forced_BxG is not None else draft_noise(keys.T, base.shape[-1], scfg)
    head, conf_head = model.markov_head, model.confidence_head
    state0 = head.init_state((b,), z.dtype) if head is not None else jnp.zeros((), z.dtype)
    forced = jnp.zeros((b, g), jnp.int32) if forced_BxG is None else forced_BxG

    # the loop carries only what is sequential (previous token, RNN state) and draws from the
    # corrected logits; the recorded distributions and confidences are computed after it for all
    # γ slots at once, from the same logits and Markov embeddings
    r = head.rank if head is not None else 0

    def body(carry, xs):
        prev, state = carry
        z_k, u_k, noise_k, forced_k = xs
        logits, e = u_k, jnp.zeros((b, r), z.dtype)
        if head is not None:
            state, bias, e = head.step(state, prev, z_k)
            logits = logits + bias
        tok = forced_k if forced_BxG is not None else draw_tokens(noise_k, logits, sampling, scfg)
        return (tok, state), (tok, logits, e)

    xs = (jnp.moveaxis(z, 1, 0), jnp.moveaxis(base, 1, 0), noise, forced.T)
    _, (toks, logits, e) = jax.lax.scan(body, (anchor_B.astype(jnp.int32), state0), xs)
    toks = jnp.moveaxis(toks, 0, 1)  # [B, γ]
    drawn = toks if forced_BxG is None else None  # forced tokens are not the greedy argmax
    probs = sampling_probs(jnp.moveaxis(logits, 0, 1), sampling, scfg, drawn)  # [B, γ, V]
    e = jnp.moveaxis(e, 0, 1) if head is not None else None
    conf_logits = conf_head(z, e) if conf_head is not None else None
    return Proposal(toks, probs, conf_logits)
