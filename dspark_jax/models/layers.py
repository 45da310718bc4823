"""The model's building blocks, shared by the target (`transformer.py`, `packed.py`) and the three
drafters: RMSNorm, Linear, RoPE, the attention projections (`Attention`), the MLP, and the one
attention function `attend`.

Layout (one per tensor kind): activations and queries are [B, T, n, d] (what a projection gives);
keys and values, whether a KV cache (target or drafter context) or a call's own, are heads-first
[B, n_kv, S, d], so the (batch, head) matmul dimensions lead and XLA reads a cache without a
transposing copy.

`attend(q, kv_sets)` is GQA attention over one or more key/value sets merged by log-sum-exp: one
softmax over the concatenation of the sets, without concatenating them. The target attends to
its cache (one set); a DSpark/DFlash block to the drafter's context and to its own block (two);
Eagle3 to its context and to its draft buffer or its training-time-test diagonal (two). A set's
keys are either seen by every query ([B, n_kv, S, d]) or grouped ([B, U, n_kv, S, d]: the T
queries form U consecutive groups of T / U and group u sees only its own S keys: a DSpark block
sees its own slots, an Eagle3 TTT query its own position's earlier steps, a packed verify token
its own slot's cache).

Gemma 4 composes the same pieces with per-layer options whose defaults are today's behaviour:
`Attention(shape=AttentionShape(...))` (its own head size / K/V heads, partial RoPE, K = V,
value norm, no K/V for KV-shared layers), `attend(scale=...)`, `MLP(width=..., act=...)`; its
sliding window is a mask.

Parameters store logical axis names as `logical=` metadata; `parallel.py` maps them to mesh axes.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import TargetConfig

INIT_STD = 0.02
_NEG = -1e30  # the score of a masked key (finite: a fully masked row stays NaN-free)


def dtype_of(name: str):
    return jnp.bfloat16 if name == "bfloat16" else jnp.float32


def normal_init(rngs: nnx.Rngs, shape, dtype, std=INIT_STD):
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def rms_normalize(x, eps: float):
    """cast_back(x32 * rsqrt(mean(x32^2) + eps)) over the last axis: RMSNorm without a scale."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """y = w * cast_back(x32 * rsqrt(mean(x32^2) + eps)); statistics in fp32 (HF convention)."""

    def __init__(self, dim: int, eps: float, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype), logical=("norm",))
        self.eps = eps

    def __call__(self, x):
        return self.weight[...] * rms_normalize(x, self.eps)


class Linear(nnx.Module):
    """x @ kernel (+ bias); kernel stored [in, out] (Hugging Face stores [out, in])."""

    def __init__(self, d_in, d_out, *, rngs, dtype, logical, bias=False):
        self.kernel = nnx.Param(normal_init(rngs, (d_in, d_out), dtype), logical=logical)
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


def partial_inv_freq(theta: float, head_dim: int, fraction: float, factor: float) -> jax.Array:
    """Inverse frequencies [d_h/2] rotating only the first `fraction` of each head's pairs (the
    exponent's denominator stays d_h; the rest get frequency 0, i.e. pass unrotated), all divided
    by `factor` (transformers' "proportional" RoPE; fraction = factor = 1 is the default RoPE)."""
    n_rot = int(fraction * head_dim // 2)
    inv = 1.0 / (theta ** (jnp.arange(0, 2 * n_rot, 2, dtype=jnp.float32) / head_dim))
    inv = jnp.concatenate([inv, jnp.zeros((head_dim // 2 - n_rot,), jnp.float32)])
    return inv / factor


def apply_rope(x_BxTxNxD, positions_BxT, inv_freq):
    """Non-interleaved ("rotate half") RoPE, computed in fp32.

    [x1, x2] -> [x1·cos − x2·sin, x2·cos + x1·sin], written as x·[cos, cos] + roll(x)·[−sin, sin]
    (the same products and sums; XLA may round a fused multiply-add differently, ~1 ulp): one
    elementwise pass instead of a split and a concatenate, which on CPU cost a tenth of a
    training step, backward included (docs/MEASUREMENTS.md: target_step)."""
    freqs = positions_BxT.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(freqs)[:, :, None, :]
    sin = jnp.sin(freqs)[:, :, None, :]
    cos2 = jnp.concatenate([cos, cos], axis=-1)
    sin2 = jnp.concatenate([-sin, sin], axis=-1)
    x = x_BxTxNxD.astype(jnp.float32)
    out = x * cos2 + jnp.roll(x, x.shape[-1] // 2, axis=-1) * sin2
    return out.astype(x_BxTxNxD.dtype)


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """One layer's attention where it is not `cfg`'s (Gemma 4 layers): its head size and K/V
    heads, its RoPE (`partial_inv_freq` arguments), q/k norms, a scale-free value norm, K = V
    (no v projection: V is the k projection before k_norm and RoPE), and whether the layer has
    K/V projections at all (a KV-shared layer attends to another layer's K/V)."""

    head_dim: int
    num_kv_heads: int
    rope: tuple[float, float, float]  # (theta, rotated fraction, frequency divisor)
    qk_norm: bool = True
    v_norm: bool = True
    k_eq_v: bool = False
    has_kv: bool = True


class Attention(nnx.Module):
    """The q/k/v/o projections of one attention layer (+ Qwen3's q/k norms, Qwen2's qkv bias).

    `d_in` is the width the projections read (default the hidden size; Eagle3 reads its 2H-wide
    [embedding; hidden] input). `dtype` defaults to `cfg.dtype`. `shape` (default: `cfg`'s
    geometry, RoPE and norms) overrides them for one layer (`AttentionShape`)."""

    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs, d_in=None, dtype=None, shape=None):
        dt = dtype_of(cfg.dtype) if dtype is None else dtype
        nq = cfg.num_heads
        nkv = cfg.num_kv_heads if shape is None else shape.num_kv_heads
        d = cfg.head_dim if shape is None else shape.head_dim
        h = cfg.hidden_size
        d_in = h if d_in is None else d_in
        b = cfg.qkv_bias
        has_kv = shape is None or shape.has_kv
        has_v = has_kv and (shape is None or not shape.k_eq_v)
        self.q_proj = Linear(d_in, nq * d, rngs=rngs, dtype=dt, logical=("embed", "heads"), bias=b)
        self.k_proj = (
            Linear(d_in, nkv * d, rngs=rngs, dtype=dt, logical=("embed", "kv"), bias=b)
            if has_kv
            else None
        )
        self.v_proj = (
            Linear(d_in, nkv * d, rngs=rngs, dtype=dt, logical=("embed", "kv"), bias=b)
            if has_v
            else None
        )
        self.o_proj = Linear(nq * d, h, rngs=rngs, dtype=dt, logical=("heads", "embed"))
        if cfg.qk_norm if shape is None else shape.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dt)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dt) if has_kv else None
        else:
            self.q_norm = self.k_norm = None
        self.cfg = cfg
        self.shape = shape
        self.head_dim, self.num_kv_heads = d, nkv

    def inv_freq(self) -> jax.Array:
        if self.shape is None:
            return rope_inv_freq(self.cfg)
        return partial_inv_freq(self.shape.rope[0], self.head_dim, *self.shape.rope[1:])

    def queries(self, x_BxTxI, positions_BxT):
        """Queries [B, T, n_q, d]: projection, q_norm (Qwen3), RoPE at `positions`."""
        return self._finish_q(self.q_proj(x_BxTxI), positions_BxT)

    def keys_values(self, x_BxTxI, positions_BxT):
        """Keys (k_norm, RoPE at `positions`) and values, heads-first [B, n_kv, T, d]."""
        k = self.k_proj(x_BxTxI)
        v = k if self.v_proj is None else self.v_proj(x_BxTxI)
        return self._finish_kv(k, v, positions_BxT)

    def qkv(self, x_BxTxI, positions_BxT):
        """`queries` [B, T, n_q, d] and `keys_values` [B, n_kv, T, d] of the same input (three
        products: one concatenated product made the engine's verify 10% slower on XLA:CPU,
        docs/MEASUREMENTS.md: engine_head)."""
        return self.queries(x_BxTxI, positions_BxT), *self.keys_values(x_BxTxI, positions_BxT)

    def _finish_q(self, q_BxTxF, positions_BxT):
        b, t, _ = q_BxTxF.shape
        q = q_BxTxF.reshape(b, t, self.cfg.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, positions_BxT, self.inv_freq())

    def _finish_kv(self, k_BxTxF, v_BxTxF, positions_BxT):
        b, t, _ = k_BxTxF.shape
        k = k_BxTxF.reshape(b, t, self.num_kv_heads, self.head_dim)
        v = v_BxTxF.reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.shape is not None and self.shape.v_norm:
            v = rms_normalize(v, self.cfg.rms_norm_eps)
        k = apply_rope(k, positions_BxT, self.inv_freq())
        # a non-finite K/V entry is stored as 0: masked attention weights are exact zeros, and
        # 0 x NaN would spread one faulty row into every row (and later request) that shares
        # the product; the faulty row's own query and output stay non-finite (the engine's
        # `device.finite_rows` ends it). The identity on finite values.
        k, v = (jnp.where(jnp.isfinite(x), x, 0) for x in (k, v))
        return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class MLP(nnx.Module):
    """Gated MLP down(act(gate(x)) * up(x)); `act` names an `ACTIVATIONS` entry (SwiGLU by
    default, GeGLU with tanh-approximated GELU for Gemma), `width` defaults to
    `cfg.intermediate_size`."""

    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs, dtype=None, width=None, act="silu"):
        dt = dtype_of(cfg.dtype) if dtype is None else dtype
        h, f = cfg.hidden_size, cfg.intermediate_size if width is None else width
        self.gate_proj = Linear(h, f, rngs=rngs, dtype=dt, logical=("embed", "mlp"))
        self.up_proj = Linear(h, f, rngs=rngs, dtype=dt, logical=("embed", "mlp"))
        self.down_proj = Linear(f, h, rngs=rngs, dtype=dt, logical=("mlp", "embed"))
        self.act = act

    def __call__(self, x):
        return self.down_proj(ACTIVATIONS[self.act](self.gate_proj(x)) * self.up_proj(x))


def joint_softmax(scores, masks):
    """One softmax over several score sets along their last axes (a log-sum-exp merge).

    scores: fp32 arrays [..., S_i]; masks: bools broadcastable to them. Masked entries get
    probability 0; a row with no visible entry gets all zeros, with finite (zero) gradients.
    With one set this is `jax.nn.softmax` of the masked scores, bit for bit.

    The gradient is the softmax's own, dS_i = P_i·(dP_i − Σ_j Σ P_j·dP_j) (a custom VJP, as
    `jax.nn.softmax` has): differentiating through the masks, the max and the division instead
    cost a seventh of a training step on CPU (docs/MEASUREMENTS.md: target_step).
    """
    return _joint_softmax(list(scores), list(masks))


def _joint_softmax_fwd(scores, masks):
    scores = [jnp.where(m, s, _NEG) for s, m in zip(scores, masks)]
    mx = jnp.max(scores[0], axis=-1, keepdims=True, initial=_NEG)
    for s in scores[1:]:
        mx = jnp.maximum(mx, jnp.max(s, axis=-1, keepdims=True, initial=_NEG))
    es = [jnp.where(m, jnp.exp(s - mx), 0.0) for s, m in zip(scores, masks)]
    den = sum(e.sum(-1, keepdims=True) for e in es)
    den = jnp.where(den > 0, den, 1.0)
    probs = [e / den for e in es]
    return probs, (probs, masks)


def _joint_softmax_bwd(res, d_probs):
    probs, masks = res
    inner = sum((g * p).sum(-1, keepdims=True) for g, p in zip(d_probs, probs))
    return [p * (g - inner) for g, p in zip(d_probs, probs)], [None] * len(masks)


@jax.custom_vjp
def _joint_softmax(scores, masks):
    return _joint_softmax_fwd(scores, masks)[0]


_joint_softmax.defvjp(_joint_softmax_fwd, _joint_softmax_bwd)


def _few_queries_scores(q, k):
    """Scores [b, u, tq, nkv, r, S] of queries q [b, u, tq, nkv, r, d] against shared keys
    k [b, nkv, S, d], computed as k·qᵀ: the keys stay in their cache layout and the small
    [S, queries] product is transposed instead. `jnp.einsum` makes q the left operand, and XLA:CPU
    then copies the whole key cache to [d, S] on every call: in batch-32 decoding that copy cost
    a third of the step (decode and verification have fewer query rows than d)."""
    b, u, tq, nkv, r, d = q.shape
    qm = q.transpose(0, 3, 1, 2, 4, 5).reshape(b, nkv, u * tq * r, d)
    dims = (((3,), (3,)), ((0, 1), (0, 1)))
    s = jax.lax.dot_general(k, qm, dims, preferred_element_type=jnp.float32)  # [b, nkv, S, M]
    return s.reshape(b, nkv, -1, u, tq, r).transpose(0, 3, 4, 1, 5, 2)


def _few_queries_values(p, v):
    """Σ_s p·v [b, u, tq, nkv, r, d] for probabilities p [b, u, tq, nkv, r, S] and shared values
    v [b, nkv, S, d], as one [queries, S] x [S, d] product per key head (see above)."""
    b, u, tq, nkv, r, s = p.shape
    pm = p.transpose(0, 3, 1, 2, 4, 5).reshape(b, nkv, u * tq * r, s)
    o = jax.lax.dot_general(pm, v, (((3,), (2,)), ((0, 1), (0, 1))))  # [b, nkv, M, d]
    return o.reshape(b, nkv, u, tq, r, -1).transpose(0, 2, 3, 1, 4, 5)


def visible(key_pos_BxS, pos_BxT, window: int | None):
    """[B, T, S]: key at or before the query and, with a `window` (Gemma 4's sliding layers, a
    drafter's context window; None: none), less than `window` positions back."""
    k, q = key_pos_BxS[:, None, :], pos_BxT[:, :, None]
    return (k <= q) if window is None else (k <= q) & (k > q - window)


def attend(q_BxTxNxD, kv_sets, *, scale: float | None = None, softcap: float | None = None):
    """GQA attention of queries [B, T, n_q, d] over one or more (k, v, mask) sets, one softmax
    (fp32) across all of them, scores scaled by `scale` (default 1/sqrt(d); Gemma 4: 1, its
    q/k norms set the temperature). Returns [B, T, n_q * d] in q's dtype.

    `softcap` (static; None: off): Gemma-style logit soft-capping of the scaled scores,
    s -> softcap * tanh(s / softcap), before the mask and the softmax.

    Each set is heads-first keys and values with a boolean mask (True = visible), either
      * k, v [B, n_kv, S, d], mask broadcastable to [B, T, S] — every query sees these keys, or
      * k, v [B, U, n_kv, S, d], mask broadcastable to [B, U, T / U, S] — grouped: the T queries
        form U consecutive groups and group u sees only its own S keys.
    Grouped sets of one call share U. A query with no visible key returns 0, and its gradient
    is zero and finite (never NaN).
    """
    b, t, n, d = q_BxTxNxD.shape
    dt = q_BxTxNxD.dtype
    groups = {k.shape[1] for k, _, _ in kv_sets if k.ndim == 5}
    if len(groups) > 1:
        raise ValueError(f"attend: grouped key/value sets must share U, got {sorted(groups)}")
    u = groups.pop() if groups else 1
    nkv = kv_sets[0][0].shape[-3]
    q = q_BxTxNxD.reshape(b, u, t // u, nkv, n // nkv, d)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores, masks = [], []
    few = t * (n // nkv) < d  # few queries per key head: keys-first layouts (_few_queries)
    for k, _, mask in kv_sets:
        if k.ndim == 4 and few:
            s = _few_queries_scores(q, k.astype(dt))
        else:
            spec = "buksd" if k.ndim == 5 else "bksd"
            s = jnp.einsum(
                f"buqkrd,{spec}->buqkrs", q, k.astype(dt), preferred_element_type=jnp.float32
            )
        s = s * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        scores.append(s)
        if mask.ndim == 3:  # [B, T or 1, S] -> [B, U or 1, T/U or 1, S]
            mb, mt, ms = mask.shape
            mask = mask[:, None] if mt == 1 else mask.reshape(mb, u, mt // u, ms)
        masks.append(mask[:, :, :, None, None, :])
    probs = joint_softmax(scores, masks)
    o = None
    for (k, v, _), p in zip(kv_sets, probs):
        if k.ndim == 4 and few:
            ov = _few_queries_values(p.astype(dt), v.astype(dt))
        else:
            spec = "buksd" if k.ndim == 5 else "bksd"
            ov = jnp.einsum(f"buqkrs,{spec}->buqkrd", p.astype(dt), v.astype(dt))
        o = ov if o is None else o + ov
    return o.reshape(b, t, n * d)
