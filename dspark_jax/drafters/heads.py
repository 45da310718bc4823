"""DSpark's sequential heads (docs/METHOD.md §3): Markov bias B_k added to the backbone logits U_k,
and the confidence head ρ_k.

Every head reads, per draft slot k, the previous token x_{k-1} (slot 0: the anchor) and the
normed backbone output z_k [H]:
  vanilla  e = W1[x_{k-1}] [r];  B = W2 e
  gated    g = σ(gate_proj([z; e]));  B = W2 (g ⊙ e)
  rnn      ζ = [s_k; e; z];  (g̃, c̃, õ) = split(joint_proj(ζ));  s_{k+1} = σ(g̃) s_k + (1 − σ(g̃))
           tanh(c̃);  B = W2 tanh(õ)   (s_0 = 0 per block; B uses the old state via ζ)
  confidence  ρ = proj([z; e]) + b  (or proj(z) without the Markov input), fp32 out; its
           gradient flows into the backbone and W1 (no stop-gradient, docs/METHOD.md §3.5).
`markov_w1` is an embedding table [V, r]; `markov_w2` a Linear r -> V (kernel [r, V], the
transpose of the Hugging Face weight [V, r]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.models.layers import Linear, dtype_of, normal_init


class MarkovHead(nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs):
        dt = dtype_of(cfg.dtype)
        v, r, h = cfg.vocab_size, cfg.markov_rank, cfg.hidden_size
        self.kind = cfg.markov_head_type
        self.rank = r
        self.markov_w1 = nnx.Param(normal_init(rngs, (v, r), dt), logical=("vocab", None))
        self.markov_w2 = Linear(r, v, rngs=rngs, dtype=dt, logical=(None, "vocab"))
        gated, rnn = self.kind == "gated", self.kind == "rnn"
        lg = (None, None)
        self.gate_proj = (
            Linear(h + r, r, rngs=rngs, dtype=dt, logical=lg, bias=True) if gated else None
        )
        self.joint_proj = (
            Linear(2 * r + h, 3 * r, rngs=rngs, dtype=dt, logical=lg, bias=True) if rnn else None
        )

    def embed(self, tokens):
        """W1[tokens] [..., r]."""
        return jnp.take(self.markov_w1[...], tokens, axis=0)

    def _project(self, x):
        return jnp.einsum(
            "...r,rv->...v", x, self.markov_w2.kernel[...], preferred_element_type=jnp.float32
        )

    def init_state(self, batch_shape, dtype):
        """RNN state s_0 = 0 [..., r]; a dummy scalar for the memoryless heads."""
        if self.kind == "rnn":
            return jnp.zeros((*batch_shape, self.rank), dtype)
        return jnp.zeros((), dtype)

    def step(self, state, prev_tokens, z):
        """One slot: (new_state, bias [..., V] fp32, e = W1[prev] [..., r]).

        Shapes: prev_tokens [...], z [..., H], state [..., r] (rnn) or a scalar (ignored).
        """
        e = self.embed(prev_tokens).astype(z.dtype)
        if self.kind == "vanilla":
            return state, self._project(e), e
        if self.kind == "gated":
            gate = jax.nn.sigmoid(self.gate_proj(jnp.concatenate([z, e], -1)))
            return state, self._project(gate.astype(e.dtype) * e), e
        zeta = jnp.concatenate([state.astype(z.dtype), e, z], -1)
        g_raw, c_raw, o_raw = jnp.split(self.joint_proj(zeta), 3, axis=-1)
        gate = jax.nn.sigmoid(g_raw)
        new_state = gate * state + (1.0 - gate) * jnp.tanh(c_raw)
        return new_state.astype(state.dtype), self._project(jnp.tanh(o_raw)), e

    def teacher_forced(self, prev_BxNxG, z_BxNxGxH):
        """Biases [B, N, G, V] fp32 and embeddings [B, N, G, r] under teacher-forced previous
        tokens: one parallel step for vanilla/gated, a G-step `lax.scan` for the RNN."""
        if self.kind != "rnn":
            _, bias, e = self.step(None, prev_BxNxG, z_BxNxGxH)
            return bias, e
        s0 = self.init_state(prev_BxNxG.shape[:-1], z_BxNxGxH.dtype)

        def body(s, xs):
            prev, z = xs
            s, bias, e = self.step(s, prev, z)
            return s, (bias, e)

        xs = (jnp.moveaxis(prev_BxNxG, -1, 0), jnp.moveaxis(z_BxNxGxH, -2, 0))
        _, (bias, e) = jax.lax.scan(body, s0, xs)
        return jnp.moveaxis(bias, 0, -2), jnp.moveaxis(e, 0, -2)


class ConfidenceHead(nnx.Module):
    """ρ = proj([z; W1[x_prev]]) with bias (docs/METHOD.md §3.5); proj(z) without Markov input."""

    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs):
        dt = dtype_of(cfg.dtype)
        d_in = cfg.hidden_size + (cfg.markov_rank if cfg.confidence_with_markov else 0)
        self.with_markov = cfg.confidence_with_markov
        self.proj = Linear(d_in, 1, rngs=rngs, dtype=dt, logical=(None, None), bias=True)

    def __call__(self, z, e=None):
        """Confidence logits [...] fp32 from z [..., H] (and e [..., r] when with_markov)."""
        x = jnp.concatenate([z, e.astype(z.dtype)], -1) if self.with_markov else z
        return self.proj(x)[..., 0].astype(jnp.float32)
