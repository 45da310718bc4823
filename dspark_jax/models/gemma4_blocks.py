"""The parts of a Gemma 4 model that other targets lack: the scaled embedding, the mixture of
experts beside the MLP, and the per-layer inputs. Composed by `models/gemma4.py`; parameter
names follow transformers' so `models/hf.py` maps them by path.

Shapes are written as suffixes: B batch, T tokens, N = B·T, H hidden, E experts, I expert
width, L layers, P per-layer input width, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import TargetConfig
from dspark_jax.models.layers import (
    ACTIVATIONS,
    Linear,
    RMSNorm,
    dtype_of,
    normal_init,
    rms_normalize,
)

GELU = ACTIVATIONS["gelu_tanh"]


class ScaledEmbed(nnx.Module):
    """An embedding table [V, D] whose rows are multiplied by `scale` (rounded to the table's
    dtype first, as transformers does: sqrt(3072) is 55.5 in bf16)."""

    def __init__(self, vocab: int, dim: int, scale: float, *, rngs, dtype, logical):
        self.weight = nnx.Param(normal_init(rngs, (vocab, dim), dtype), logical=logical)
        self.scale = scale

    def __call__(self, tokens_BxT):
        w = self.weight[...]
        return jnp.take(w, tokens_BxT, axis=0) * jnp.asarray(self.scale, w.dtype)


class Router(nnx.Module):
    """Per token: the top-k experts and their weights (softmax over all experts, renormalised
    over the chosen k, times a learned per-expert scale)."""

    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs):
        dt, h, e = dtype_of(cfg.dtype), cfg.hidden_size, cfg.gemma.num_experts
        self.proj = Linear(h, e, rngs=rngs, dtype=dt, logical=("embed", None))
        self.scale = nnx.Param(jnp.ones((h,), dt), logical=("norm",))
        self.per_expert_scale = nnx.Param(jnp.ones((e,), dt), logical=(None,))
        self.eps, self.k = cfg.rms_norm_eps, cfg.gemma.top_k_experts

    def __call__(self, x_NxH):
        """Dense routing weights [N, E] (zero off the top k), fp32."""
        h = x_NxH.shape[-1]
        r = rms_normalize(x_NxH, self.eps) * self.scale[...] * (h**-0.5)
        probs_NxE = jax.nn.softmax(self.proj(r).astype(jnp.float32), axis=-1)
        top_NxK, idx_NxK = jax.lax.top_k(probs_NxE, self.k)
        top_NxK = top_NxK / top_NxK.sum(-1, keepdims=True)
        top_NxK = top_NxK * self.per_expert_scale[...].astype(jnp.float32)[idx_NxK]
        onehot_NxKxE = jax.nn.one_hot(idx_NxK, probs_NxE.shape[-1], dtype=jnp.float32)
        return jnp.einsum("nk,nke->ne", top_NxK, onehot_NxKxE)


class Experts(nnx.Module):
    """E gated GELU MLPs stored as transformers stores them: gate_up_proj [E, 2I, H] (gate rows
    first), down_proj [E, H, I].

    Every expert runs on every token and the routing weights (zero off the top k) mix them: exact
    and simple, E/k times the FLOPs of a routed dispatch (a grouped `ragged_dot` is the fast
    path for real checkpoints; see the issue)."""

    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs):
        dt, h, g = dtype_of(cfg.dtype), cfg.hidden_size, cfg.gemma
        e, i = g.num_experts, g.moe_intermediate_size
        self.gate_up_proj = nnx.Param(
            normal_init(rngs, (e, 2 * i, h), dt), logical=(None, "mlp", "embed")
        )
        self.down_proj = nnx.Param(normal_init(rngs, (e, h, i), dt), logical=(None, "embed", "mlp"))

    def __call__(self, x_NxH, weights_NxE):
        i = self.down_proj.shape[-1]
        gu_NxEx2I = jnp.einsum("nh,eih->nei", x_NxH, self.gate_up_proj[...])
        a_NxExI = GELU(gu_NxEx2I[..., :i]) * gu_NxEx2I[..., i:]
        y_NxExH = jnp.einsum("nei,ehi->neh", a_NxExI, self.down_proj[...])
        return jnp.einsum("neh,ne->nh", y_NxExH, weights_NxE.astype(y_NxExH.dtype))


def per_layer_inputs(embed: ScaledEmbed, projection: Linear, norm: RMSNorm, tokens_BxT, x_BxTxH):
    """The per-layer inputs [B, T, L, P]: a token embedding of width L·P (scaled by sqrt(P))
    plus a projection of the (scaled) main embedding `x` times 1/sqrt(H), RMS-normed per layer;
    the sum times 1/sqrt(2)."""
    b, t = tokens_BxT.shape
    p = norm.weight.shape[0]
    shape = (b, t, embed.weight.shape[1] // p, p)
    tok_BxTxLxP = embed(tokens_BxT).reshape(shape)
    proj = projection(x_BxTxH) * (x_BxTxH.shape[-1] ** -0.5)
    return (norm(proj.reshape(shape)) + tok_BxTxLxP) * (2.0**-0.5)
