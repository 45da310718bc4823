"""Eagle3 baseline (docs/METHOD.md §5): one decoder layer over fused target features, trained with
the training-time test (TTT) over γ steps, run autoregressively at inference.

Layer (pre-norm residual stream g [.., H]):
  x = [input_layernorm(emb(token)); hidden_norm(g)]  [.., 2H]   (embedding first)
  g = g + o_proj(attn(q, k, v from x));  g = g + mlp(post_attention_layernorm(g))
  logits = lm_head(norm(g))  (own trainable final norm)
Pairing: the target feature at position t goes with the embedding of x_{t+1}, RoPE position t,
and predicts x_{t+2}. Step 0's hidden is fc(F_t); step k's is step k−1's output g.
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
    shift_left,
)
from dspark_jax.models.gemma4 import Gemma4Layer
from dspark_jax.models.layers import (
    MLP,
    Attention,
    Linear,
    RMSNorm,
    attend,
    dtype_of,
    normal_init,
    visible,
)


class Eagle3Layer(nnx.Module):
    scale = None  # attention scores scaled by 1/sqrt(d)

    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs):
        lc = cfg.layer_config
        dt = dtype_of(cfg.dtype)
        h, eps = lc.hidden_size, lc.rms_norm_eps
        self.hidden_norm = RMSNorm(h, eps, dt)
        self.input_layernorm = RMSNorm(h, eps, dt)
        self.self_attn = Attention(lc, rngs=rngs, d_in=2 * h, dtype=dt)  # reads [emb; hidden]
        self.post_attention_layernorm = RMSNorm(h, eps, dt)
        self.mlp = MLP(lc, rngs=rngs)

    def inputs(self, emb, g):
        """[input_layernorm(emb); hidden_norm(g)] [.., 2H]."""
        return jnp.concatenate([self.input_layernorm(emb), self.hidden_norm(g)], -1)

    def finish(self, g, attn_out):
        g = g + self.self_attn.o_proj(attn_out)
        return g + self.mlp(self.post_attention_layernorm(g))


class Eagle3GemmaLayer(Gemma4Layer):
    """The Eagle3 layer for a Gemma 4 target (docs/METHOD.md §2.10, §5.1): a `Gemma4Layer` of the
    drafter's layer config (global geometry, value norm, scale 1, sandwich norms, GELU MLP,
    layer scalar) whose attention reads [input_layernorm(emb); hidden_norm(g)] [.., 2H]."""

    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs):
        lc = cfg.layer_config
        super().__init__(lc, 0, rngs=rngs, d_in=2 * lc.hidden_size)
        self.hidden_norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps, dtype_of(lc.dtype))

    def inputs(self, emb, g):
        return jnp.concatenate([self.input_layernorm(emb), self.hidden_norm(g)], -1)


class Eagle3Drafter(nnx.Module):
    """HF names: embed_tokens, lm_head, fc, layers.0.{hidden_norm, input_layernorm, self_attn.*,
    post_attention_layernorm, mlp.*}, norm."""

    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs):
        dt = dtype_of(cfg.dtype)
        v, h = cfg.vocab_size, cfg.hidden_size
        self.cfg = cfg
        self.embed_tokens = FrozenParam(normal_init(rngs, (v, h), dt), logical=("vocab", "embed"))
        self.lm_head = FrozenParam(normal_init(rngs, (h, v), dt), logical=("embed", "vocab"))
        self.fc = Linear(cfg.feature_size, h, rngs=rngs, dtype=dt, logical=(None, "embed"))
        gemma = cfg.target.gemma is not None
        self.layers = nnx.List([(Eagle3GemmaLayer if gemma else Eagle3Layer)(cfg, rngs=rngs)])
        self.norm = RMSNorm(h, cfg.layer_config.rms_norm_eps, dt)

    def project(self, features):
        return self.fc(features.astype(dtype_of(self.cfg.dtype)))

    def logits(self, g):
        """lm_head(norm(g)) [..., V] fp32 (Gemma 4: soft-capped)."""
        return lm_logits(self.lm_head[...], self.norm(g), self.cfg.logit_softcap)

    def embed(self, tokens):
        """The frozen embedding rows of `tokens` (Gemma 4: scaled)."""
        return embed(self.embed_tokens[...], tokens, self.cfg.embed_scale)


def ttt_hidden(model: Eagle3Drafter, features_BxTxF, input_ids_BxT, valid_len_B):
    """Training-time test (docs/METHOD.md §5.2): per step k = 0..γ−1 the pre-norm output g^{k+1}
    [γ, B, T, H].

    Step k: token x_{t+k+1}, RoPE position t+k, hidden g^k (g^0 = fc(F)). Query t attends the
    step-0 keys at positions ≤ t and its own position's keys of steps 1..k (the diagonal);
    queries and step-0 keys at positions ≥ valid_len − k are masked (such rows output 0). With
    `cfg.context_window` W > 0 query t sees only the step-0 keys at positions > t − W (as at
    inference). Gradients flow through every step, including through the earlier steps' K/V.
    """
    cfg = model.cfg
    layer = model.layers[0]
    attn = layer.self_attn
    b, t = input_ids_BxT.shape
    pos0 = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    window = cfg.context_window or None
    causal = visible(pos0[:1], pos0[:1], window)[0]  # [T(q), T(k)]
    g = model.project(features_BxTxF)
    k0 = v0 = None
    diag_k, diag_v, outs = [], [], []
    for k in range(cfg.block_size):
        x = layer.inputs(model.embed(shift_left(input_ids_BxT, k + 1)), g)
        q, kk, vv = attn.qkv(x, pos0 + k)  # q [B, T, n_q, d], kk/vv [B, n_kv, T, d]
        if k == 0:
            k0, v0 = kk, vv
        else:
            diag_k.append(kk)
            diag_v.append(vv)
        limit = (valid_len_B - k)[:, None]  # [B, 1]
        q_ok = jnp.arange(t)[None, :] < limit  # [B, T]
        m0 = causal[None] & q_ok[:, :, None] & (jnp.arange(t)[None, None, :] < limit[:, :, None])
        sets = [(k0, v0, m0)]
        if diag_k:  # grouped: query t sees its own position's keys of steps 1..k
            kd = jnp.stack(diag_k, axis=3).transpose(0, 2, 1, 3, 4)  # [B, T, n_kv, J, d]
            vd = jnp.stack(diag_v, axis=3).transpose(0, 2, 1, 3, 4)
            sets.append((kd, vd, q_ok[:, :, None, None]))
        g = layer.finish(g, attend(q, sets, scale=layer.scale).astype(x.dtype))
        outs.append(g)
    return jnp.stack(outs)


# ---------------------------------------------------------------------------------------------
# inference (docs/METHOD.md §5.3)


class Eagle3Context(NamedTuple):
    """The draft cache: K (k_norm + RoPE) and V [B, n_kv, S, d_h] (heads-first, as the target's
    cache) of committed positions
    < lengths [B], and g [B, H], the pre-norm output at the last committed position (it
    predicts the first draft token)."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    g: jax.Array


def init_eagle3_context(cfg: DrafterConfig, batch: int, max_len: int) -> Eagle3Context:
    lc = cfg.layer_config
    dt = dtype_of(cfg.dtype)
    nkv, d = cfg.kv_geometry
    shape = (batch, nkv, max_len, d)
    return Eagle3Context(
        jnp.zeros(shape, dt),
        jnp.zeros(shape, dt),
        jnp.zeros((batch,), jnp.int32),
        jnp.zeros((batch, lc.hidden_size), dt),
    )


def extend_eagle3_context(
    model: Eagle3Drafter, ctx: Eagle3Context, features_BxTxF, next_tokens_BxT, num_new_B
):
    """Append committed positions lengths + t (t < num_new[b]): feature t paired with
    next_tokens[:, t] (the committed token at the following position), causal over the cache.
    g becomes the output at the last new position (unchanged where num_new = 0)."""
    layer = model.layers[0]
    attn = layer.self_attn
    b, t, _ = features_BxTxF.shape
    s = ctx.k.shape[2]
    offs = jnp.arange(t, dtype=jnp.int32)[None, :]
    pos = ctx.lengths[:, None] + offs
    valid = offs < num_new_B[:, None]
    write = jnp.where(valid, pos, s)[:, None, :]  # [B, 1, T]; index s -> dropped
    g_in = model.project(features_BxTxF)
    x = layer.inputs(model.embed(next_tokens_BxT), g_in)
    q, kk, vv = attn.qkv(x, pos)  # kk/vv [B, n_kv, T, d]
    rows = jnp.arange(b)[:, None, None]
    heads = jnp.arange(kk.shape[1])[None, :, None]
    ck = ctx.k.at[rows, heads, write].set(kk.astype(ctx.k.dtype), mode="drop")
    cv = ctx.v.at[rows, heads, write].set(vv.astype(ctx.v.dtype), mode="drop")
    key_pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    cache_mask = visible(key_pos, pos, model.cfg.context_window or None)  # [B, T, S]
    a = attend(q, [(ck, cv, cache_mask)], scale=layer.scale)
    g_out = layer.finish(g_in, a.astype(g_in.dtype))
    g = last_output(g_out, num_new_B, ctx.g)
    return Eagle3Context(ck, cv, ctx.lengths + num_new_B.astype(jnp.int32), g)


def last_output(g_out_BxTxH, num_new_B, g_B):
    """The new g [B, H]: the output at each row's last new position (g where num_new = 0)."""
    last = jnp.clip(num_new_B - 1, 0, g_out_BxTxH.shape[1] - 1)
    g_last = jnp.take_along_axis(g_out_BxTxH, last[:, None, None], axis=1)[:, 0]
    return jnp.where((num_new_B > 0)[:, None], g_last.astype(g_B.dtype), g_B)


def propose_eagle3(
    model: Eagle3Drafter,
    ctx: Eagle3Context,
    key,
    seeds_B,
    sampling=None,
    scfg=None,
    forced_BxG=None,
    rounds_B=None,
) -> Proposal:
    """γ autoregressive draft steps from ctx.g (the anchor was paired with the last committed
    feature by `extend_eagle3_context`). Draft step j ≥ 1 runs (g, token_{j−1}) at position
    lengths + j − 1 with its K/V in a private buffer: the context cache is never written."""
    cfg = model.cfg
    layer = model.layers[0]
    attn = layer.self_attn
    gam = cfg.block_size
    b = ctx.lengths.shape[0]
    s = ctx.k.shape[2]
    start = ctx.lengths
    positions = start[:, None] + 1 + jnp.arange(gam, dtype=jnp.int32)[None]
    keys = draft_keys(key, seeds_B, positions, rounds_B)
    vocab = model.lm_head[...].shape[-1]
    noise = None if forced_BxG is not None else draft_noise(keys.T, vocab, scfg)  # [γ, B, V]
    first, rest = (None, None) if noise is None else (noise[0], noise[1:])
    forced = jnp.zeros((b, gam), jnp.int32) if forced_BxG is None else forced_BxG
    # the committed positions <= start - 1 (the last one's feature is the anchor's), windowed
    # as the training steps' keys of that query
    key_pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    cache_mask = visible(key_pos, start[:, None] - 1, cfg.context_window or None)  # [B, 1, S]
    nb = max(gam - 1, 1)
    buf_k = jnp.zeros((b, attn.num_kv_heads, nb, attn.head_dim), ctx.k.dtype)
    buf_v = jnp.zeros_like(buf_k)

    # each step draws from its logits; the recorded distributions are computed after the loop
    # for all γ steps at once, from the same logits
    def step_draw(g, noise_k, forced_k):
        logits = model.logits(g).astype(jnp.float32)
        tok = forced_k if forced_BxG is not None else draw_tokens(noise_k, logits, sampling, scfg)
        return tok, logits

    tok0, l0 = step_draw(ctx.g, first, forced[:, 0])

    def body(carry, xs):
        g, tok, bk, bv = carry
        j, noise_k, forced_k = xs  # j = 1..γ−1
        pos = (start + j - 1)[:, None]
        x = layer.inputs(model.embed(tok[:, None]), g[:, None])
        q, kk, vv = attn.qkv(x, pos)  # kk/vv [B, n_kv, 1, d]
        bk = jax.lax.dynamic_update_slice_in_dim(bk, kk.astype(bk.dtype), j - 1, axis=2)
        bv = jax.lax.dynamic_update_slice_in_dim(bv, vv.astype(bv.dtype), j - 1, axis=2)
        buf_mask = jnp.broadcast_to(jnp.arange(nb)[None, None, :] < j, (b, 1, nb))
        a = attend(q, [(ctx.k, ctx.v, cache_mask), (bk, bv, buf_mask)], scale=layer.scale)
        g = layer.finish(g[:, None], a.astype(g.dtype))[:, 0]
        tok, logits = step_draw(g, noise_k, forced_k)
        return (g, tok, bk, bv), (tok, logits)

    js = jnp.arange(1, gam, dtype=jnp.int32)
    xs = (js, rest, forced[:, 1:].T)
    _, (toks, logits) = jax.lax.scan(body, (ctx.g, tok0, buf_k, buf_v), xs)
    tokens = jnp.concatenate([tok0[:, None], jnp.moveaxis(toks, 0, 1)], axis=1)
    logits = jnp.concatenate([l0[:, None], jnp.moveaxis(logits, 0, 1)], axis=1)  # [B, γ, V]
    drawn = tokens if forced_BxG is None else None  # forced tokens are not the greedy argmax
    probs = sampling_probs(logits, sampling, scfg, drawn)
    return Proposal(tokens, probs, None)
