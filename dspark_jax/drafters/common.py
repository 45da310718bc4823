"""Pieces shared by the three drafters: parameter collections, the proposal type, the frozen
embedding / LM head, per-request draft keys and the draft sampling transform. (The layers and
the attention are the model's: `dspark_jax.models.layers`.)"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.spec import rng as spec_rng
from dspark_jax.spec import sampling as spec_sampling


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


def shift_left(x_BxT: jax.Array, k: int, fill=0) -> jax.Array:
    """x[:, t + k] along the sequence axis (axis 1), `fill` past the end."""
    if k == 0:
        return x_BxT
    pad = jnp.full((x_BxT.shape[0], k, *x_BxT.shape[2:]), fill, x_BxT.dtype)
    return jnp.concatenate([x_BxT[:, k:], pad], axis=1)


def embed(frozen_table_VxH: jax.Array, tokens: jax.Array, scale: float | None = None) -> jax.Array:
    """Rows of the frozen table; `scale` (Gemma 4's scaled embedding, `DrafterConfig.embed_scale`)
    multiplies them, rounded to the table's dtype first as the target's `ScaledEmbed` does."""
    x = jnp.take(frozen_table_VxH, tokens, axis=0)
    return x if scale is None else x * jnp.asarray(scale, frozen_table_VxH.dtype)


def lm_logits(lm_head_HxV: jax.Array, z: jax.Array, cap: float | None = None) -> jax.Array:
    """fp32 logits [..., V] from normed hidden z [..., H]; with `cap` (Gemma 4's final-logit
    soft-cap, `DrafterConfig.logit_softcap`) soft-capped: cap·tanh(logits / cap)."""
    out = jnp.einsum("...h,hv->...v", z, lm_head_HxV, preferred_element_type=jnp.float32)
    return out if cap is None else cap * jnp.tanh(out / cap)


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


def sampling_probs(logits_BxV: jax.Array, sampling, scfg, drawn=None) -> jax.Array:
    """The exact fp32 distribution a draft token is drawn from: the same transform as the
    target's (`spec.sampling.probs_from_logits`; `scfg.greedy` gives the one-hot argmax).
    `sampling=None` outside greedy mode means plain softmax (temperature 1). `drawn`: the tokens
    `draw_tokens` drew from these logits, whose one-hots are the greedy rows' point masses
    (`spec.sampling.probs_of_draws`: no second argmax); not for forced tokens."""
    logits = logits_BxV.astype(jnp.float32)
    if scfg is None:
        scfg = spec_sampling.SamplingConfig()
    if sampling is None and not scfg.greedy:
        return jax.nn.softmax(logits, axis=-1)
    if drawn is not None:
        return spec_sampling.probs_of_draws(logits, drawn, sampling, scfg)
    return spec_sampling.probs_from_logits(logits, sampling, scfg)


def draft_noise(keys: jax.Array, num_classes: int, scfg) -> jax.Array | None:
    """The Gumbel noise of every draft slot at once, [*keys.shape, V] (None in greedy mode), made
    before the drafter's sequential loop (`spec.sampling.gumbel_noise`: the draws equal
    per-step `sample_from_probs` with these keys, bit for bit). Its size is that of the
    proposal's recorded probabilities."""
    if scfg is not None and scfg.greedy:
        return None
    return spec_sampling.gumbel_noise(keys, num_classes)


def draw_tokens(noise_BxV: jax.Array | None, logits_BxV: jax.Array, sampling, scfg) -> jax.Array:
    """One token per row from `sampling_probs(logits_BxV, sampling, scfg)` with this slot's
    `draft_noise`: the Gumbel-max draw `argmax(noise + z)` over the sampling transform's logits z
    (softmax(z) is that distribution exactly), so a sequential loop needs no softmax per slot and
    the recorded probabilities can be computed after it for all slots at once (greedy rows and
    mode: the argmax, first index on ties, as `sampling_probs`' one-hot;
    `spec.sampling.sample_transformed`)."""
    x = logits_BxV.astype(jnp.float32)
    if scfg is not None and scfg.greedy:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    if sampling is not None:
        cfg = scfg or spec_sampling.SamplingConfig()
        return spec_sampling.sample_transformed(noise_BxV, x, sampling, cfg)
    return spec_sampling.sample_with_noise(noise_BxV, x)
