"""Drafter losses and training metrics (REFERENCE §4, §5.2). Every term is computed in fp32.

The trainer's contract is one function:

    loss, metrics = loss_fn(cfg, trainable, frozen, batch, rng)

  cfg        DrafterConfig — static (hashable; `jax.jit(loss_fn, static_argnums=0)` or
             `functools.partial(loss_fn, cfg)`).
  trainable  nnx.State of nnx.Param — differentiate w.r.t. this (`jax.value_and_grad(loss_fn,
             argnums=1, has_aux=True)`).
  frozen     nnx.State of FrozenParam — embed_tokens [V, H], lm_head [H, V]; no gradient.
  batch      dict of arrays (all [B, L, ...], right-padded; padding has loss_mask 0):
               input_ids       [B, L]      int32
               loss_mask       [B, L]      any numeric / bool, > 0.5 = supervised
               target_features [B, L, m*H] raw outputs of target_layer_ids (bf16 or fp32)
               target_hidden   [B, L, H]   the target's final-normed last hidden state
               attention_mask  [B, L]      optional, 1 = real token (Eagle3 valid length;
                                           default: all ones)
             Target logits are recomputed inside from `target_hidden` with the frozen lm_head,
             only at the positions the loss needs (REFERENCE §1.4, §2.8), never stored.
  rng        a jax PRNG key: anchor sampling (DSpark/DFlash; fresh per step — e.g.
             fold_in(key, step)). Eagle3 ignores it.

Returns `loss` (fp32 scalar) and `metrics`, a flat dict of fp32 arrays. Keys ending in `_num` /
`_den` are additive across batches and devices (sum both, then divide) — use them for held-out
evaluation; the other keys are this batch's ratios:
  loss; ce, l1, bce (each term's weighted mean, 0 when disabled) with ce_num/ce_den, l1_num/
  l1_den, bce_num/bce_den; accept_rate [γ] (per-position mean of 1 − TV over supervised slots,
  accept_num/accept_den [γ]); tau (simulated τ = 1 + Σ_k Π_{i≤k}(1 − TV_i)·mask_i averaged over
  valid blocks, tau_num/tau_den); DSpark with confidence: conf_abs_error, conf_bias (σ(ρ) − c*),
  conf_cumprod_bias (+ _num, shared denominator bce_den); counts n_blocks, n_supervised.
  Eagle3: ce is the TTT soft-label loss, plus acc [γ] (per-step argmax accuracy).

Normalization (REFERENCE §4.3): each term is Σ_batch num / (Σ_batch den + 1e-6) over the B
sequences of this call, i.e. a token-weighted mean per micro-batch; averaging micro-batch losses
with equal weight is the trainer's job. Eagle3 divides by the number of real tokens in the batch
(= B·T unpadded, the reference "local_mean").
"""

from __future__ import annotations

import jax

from dspark_jax.config import DrafterConfig

Batch = dict[str, jax.Array]


def loss_fn(
    cfg: DrafterConfig,
    trainable,
    frozen,
    batch: Batch,
    rng: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The drafter's training loss for `cfg.kind` (see the module docstring for the contract)."""
    raise NotImplementedError


def position_weights(cfg: DrafterConfig) -> jax.Array:
    """w_k = exp(−k / g), k = 0..γ−1 [γ] fp32 (g = cfg.decay_g; REFERENCE §4.1)."""
    raise NotImplementedError
