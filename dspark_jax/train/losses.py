"""Drafter losses and training metrics (docs/METHOD.md §4, §5.2). Every term is computed in fp32.

The trainer's contract is one function:

    loss, metrics = loss_fn(cfg, trainable, frozen, batch, rng, weights=None)

  cfg        DrafterConfig — static (hashable; `jax.jit(loss_fn, static_argnums=0)` or
             `functools.partial(loss_fn, cfg)`). It fixes the structure: which terms exist
             (a weight α > 0 in `cfg`), γ, the model.
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
             only at the positions the loss needs (docs/METHOD.md §1.4, §2.8), never stored;
             soft-capped as the draft logits for a Gemma 4 target (`logit_softcap`).
  rng        a jax PRNG key: anchor sampling (DSpark/DFlash; fresh per step — e.g.
             fold_in(key, step)). Eagle3 ignores it.
  weights    `LossWeights` (arrays: α's and per-position weights), or None = `LossWeights.of(cfg)`
             (a TypeError when `cfg` is a `loss_structure(...)`: its weights are stand-ins).
             Traced, not static: other values re-use the compiled loss, and `jax.vmap` maps a
             stack of settings (`LossWeights.stack`). A term switched off in `cfg` (α = 0, e.g.
             DFlash's L1) stays off whatever its weight here — switch it on in `cfg` to sweep it.

Returns `loss` (fp32 scalar) and `metrics`, a flat dict of fp32 arrays. Keys ending in `_num` /
`_den` are additive across batches and devices (sum both, then divide) — use them for held-out
evaluation; the other keys are this batch's ratios:
  loss; ce, l1, bce (each term's weighted mean, 0 when disabled) with ce_num/ce_den, l1_num/
  l1_den, bce_num/bce_den; accept_rate [γ] (per-position mean of 1 − TV over supervised slots,
  accept_num/accept_den [γ]); tau (simulated τ = 1 + Σ_k Π_{i≤k}(1 − TV_i)·mask_i averaged over
  valid blocks, tau_num/tau_den); DSpark with confidence: conf_abs_error, conf_bias (σ(ρ) − c*),
  conf_cumprod_bias (+ _num, shared denominator bce_den); counts n_blocks, n_supervised.
  Eagle3: ce is the TTT soft-label loss (l1 = bce = 0), plus ce_steps [γ] (unweighted step
  losses), acc [γ] (per-step argmax accuracy vs the target's argmax, acc_num), tau_greedy, n_tokens.
  Every kind returns loss, ce, l1, bce, accept_rate, tau (the keys a trainer logs and selects on).

Normalization (docs/METHOD.md §4.3): each term is Σ_batch num / (Σ_batch den + 1e-6) over the B
sequences of this call, i.e. a token-weighted mean per micro-batch; averaging micro-batch losses
with equal weight is the trainer's job. Eagle3 is normalised per sequence as the reference does
(batch 1 per rank, "local_mean" over the sequence's full length T): each sequence's step loss is
Σ_t M·CE / T_b with T_b its real length, and the batch's loss is the mean over its sequences
(rows without real tokens are ignored), so every sequence weighs the same whatever its length.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from dspark_jax.config import DrafterConfig
from dspark_jax.drafters.api import build
from dspark_jax.drafters.common import DrafterParams, lm_logits, shift_left
from dspark_jax.drafters.dspark import teacher_forced
from dspark_jax.drafters.eagle3 import ttt_hidden
from dspark_jax.spec.metrics import block_tau
from dspark_jax.train.anchors import AnchorBlocks, make_blocks, sample_anchors

Batch = dict[str, jax.Array]
EPS = 1e-6


class LossWeights(NamedTuple):
    """The loss's numeric settings as arrays (a pytree: jit arguments, vmappable).

    ce, l1, conf: α_ce, α_l1, α_conf fp32 scalars (docs/METHOD.md §4.2; Eagle3 reads none of them).
    position: [γ] fp32 — DSpark / DFlash: the slot weights w_k = exp(−k/g) (§4.1); Eagle3: the
      TTT step weights decay^k (§5.2).
    A sweep: `LossWeights.stack([LossWeights.of(cfg.replace(loss_decay_gamma=g)) for g in gs])`.
    """

    ce: jax.Array
    l1: jax.Array
    conf: jax.Array
    position: jax.Array

    @classmethod
    def of(cls, cfg: DrafterConfig) -> LossWeights:
        """The settings `cfg` holds (numpy fp32, so they enter a jit as arguments or, closed
        over, as the same constants the loss always used)."""
        f32 = np.float32
        return cls(f32(cfg.ce_alpha), f32(cfg.l1_alpha), f32(cfg.conf_alpha), position_weights(cfg))

    @classmethod
    def stack(cls, settings) -> LossWeights:
        """Settings stacked on a new leading axis, for `jax.vmap(..., in_axes=...)`."""
        return jax.tree.map(lambda *x: jnp.stack(x), *settings)


class LossStructure(DrafterConfig):
    """A `DrafterConfig` whose loss weights are stand-ins (built by `loss_structure`): the static
    structure of a loss whose weights come as an argument. The loss functions refuse it without
    `weights` (its stand-ins are not anyone's configured weights). Unequal to any plain
    `DrafterConfig`, equal to another structure with the same fields."""


def loss_structure(cfg: DrafterConfig) -> LossStructure:
    """`cfg` with its loss weights replaced by fixed stand-ins (1 for a term that is on, 0 for
    one that is off, the default decays): a static key shared by configs that differ only in
    weight values. Pair it with `LossWeights.of(cfg)` — the real values come from there; the
    loss functions raise a TypeError when a structure comes without `weights`."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    on = {k: float(getattr(cfg, k) > 0) for k in ("ce_alpha", "l1_alpha", "conf_alpha")}
    return LossStructure(**{**fields, **on, "loss_decay_gamma": 4.0, "step_loss_decay": 0.8})


def weights_for(cfg: DrafterConfig, weights: LossWeights | None) -> LossWeights:
    """`weights`, or `cfg`'s own (`LossWeights.of(cfg)`) when None — an error for a
    `loss_structure(cfg)`, whose weights are stand-ins: training with them would silently use
    α = 1 for every term that is on."""
    if weights is not None:
        return weights
    if isinstance(cfg, LossStructure):
        raise TypeError(
            "loss_structure(cfg) holds stand-in loss weights (1 for every term that is on), not "
            "the configured ones: pass weights=LossWeights.of(cfg) with the original cfg"
        )
    return LossWeights.of(cfg)


def loss_fn(
    cfg: DrafterConfig,
    trainable,
    frozen,
    batch: Batch,
    rng: jax.Array,
    weights: LossWeights | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The drafter's training loss for `cfg.kind` (see the module docstring for the contract)."""
    _check_batch(cfg, batch)
    weights = weights_for(cfg, weights)
    if np.shape(weights.position) != (cfg.block_size,):
        raise ValueError(
            f"weights.position has shape {np.shape(weights.position)}, expected "
            f"({cfg.block_size},) (one weight per draft slot) — build it with LossWeights.of(cfg)"
        )
    if cfg.kind == "eagle3":
        return eagle3_loss(cfg, trainable, frozen, batch, weights)
    return dspark_loss(cfg, trainable, frozen, batch, rng, weights)


def position_weights(cfg: DrafterConfig) -> np.ndarray:
    """The per-slot weights [γ] fp32 (numpy). DSpark / DFlash: w_k = exp(−k/g), k = 0..γ−1
    (g = cfg.decay_g; docs/METHOD.md §4.1); Eagle3: step_loss_decay^k (§5.2).

    Computed on the host (float64, rounded once): the same on every machine and in every
    program, where XLA's in-graph exp can differ by 1 ulp with the fusion around it. For the
    default g = 4 they are the weights the former in-graph formula gave, bit for bit (tested).
    """
    k = np.arange(cfg.block_size)
    if cfg.kind == "eagle3":
        return np.array([cfg.step_loss_decay**i for i in k], np.float32)
    x = (-k.astype(np.float32) / np.float32(cfg.decay_g)).astype(np.float64)
    return np.exp(x).astype(np.float32)


def _check_batch(cfg: DrafterConfig, batch: Batch) -> None:
    need = ("input_ids", "loss_mask", "target_features", "target_hidden")
    missing = [k for k in need if k not in batch]
    if missing:
        raise KeyError(f"batch lacks {missing}; loss_fn needs {need} (+ optional attention_mask)")
    b, seq = batch["input_ids"].shape
    want = {
        "loss_mask": (b, seq),
        "target_features": (b, seq, cfg.feature_size),
        "target_hidden": (b, seq, cfg.hidden_size),
    }
    if "attention_mask" in batch:
        want["attention_mask"] = (b, seq)
    for k, shape in want.items():
        if tuple(batch[k].shape) != shape:
            raise ValueError(
                f"batch[{k!r}] has shape {tuple(batch[k].shape)}, expected {shape} "
                f"(m={cfg.target.num_feature_layers} feature layers of H={cfg.hidden_size})"
            )


# ---------------------------------------------------------------------------------------------
# DSpark / DFlash (docs/METHOD.md §4)


def ce_and_l1(logits, p_t, ids=None):
    """Per row of fp32 logits [..., V], p_d = softmax(logits), against the target distribution
    p_t [..., V]: CE and L1 = ‖p_d − p_t‖₁ (in [0, 2]), two arrays [...]. CE is −log p_d[id]
    against the token `ids` [...] (DSpark / DFlash), or the soft-label −Σ_v p_t log p_d when
    `ids` is None (Eagle3).

    The same math as autodiff through log_softmax, exp and abs, with the gradient (w.r.t.
    `logits` only; p_t gets none) written as one pass over the vocabulary,
        ∂/∂logits = g_ce·(p_d Σ_v y − y) + g_l1·p_d ⊙ (s − Σ_v p_d s),  s = sign(p_d − p_t),
    y = onehot(id) or p_t; a term whose output carries no gradient (DFlash's L1, Eagle3's
    detached L1) is skipped. Autodiff instead keeps and re-reads several [..., V] intermediates
    (log p_d, p_d, the sign, their products). On the demo's drafters with the training steps' XLA:CPU
    option the micro-step is 1.05x faster for DSpark and unchanged for DFlash and Eagle3
    (docs/MEASUREMENTS.md: drafter_step).
    """
    return _ce_and_l1(logits, p_t, ids)


def _ce_and_l1_values(logits, p_t, ids):
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    l1 = jnp.abs(jnp.exp(logits - lse) - p_t).sum(-1)
    if ids is None:
        ce = (p_t * (lse - logits)).sum(-1)
    else:
        ce = lse[..., 0] - jnp.take_along_axis(logits, ids[..., None], axis=-1)[..., 0]
    return (ce, l1), lse


@jax.custom_vjp
def _ce_and_l1(logits, p_t, ids):
    return _ce_and_l1_values(logits, p_t, ids)[0]


def _ce_and_l1_fwd(logits, p_t, ids):
    # symbolic_zeros=True: the arguments come wrapped (CustomVJPPrimal), the cotangents of
    # outputs that carry no gradient come as SymbolicZero
    logits, p_t, ids = (None if a is None else a.value for a in (logits, p_t, ids))
    out, lse = _ce_and_l1_values(logits, p_t, ids)
    return out, (logits, p_t, ids, lse)


def _ce_and_l1_bwd(res, g):
    logits, p_t, ids, lse = res
    g_ce, g_l1 = (None if isinstance(x, SymbolicZero) else x[..., None] for x in g)
    p_d = jnp.exp(logits - lse)
    d = jnp.zeros_like(logits)
    if g_ce is not None:
        if ids is None:
            d = g_ce * (p_d * p_t.sum(-1, keepdims=True) - p_t)
        else:
            hit = jnp.arange(logits.shape[-1]) == ids[..., None]
            d = g_ce * jnp.where(hit, p_d - 1.0, p_d)
    if g_l1 is not None:
        ps = p_d * jnp.sign(p_d - p_t)
        d = d + g_l1 * (ps - p_d * ps.sum(-1, keepdims=True))
    return d, None, None


_ce_and_l1.defvjp(_ce_and_l1_fwd, _ce_and_l1_bwd, symbolic_zeros=True)


def block_terms(
    cfg: DrafterConfig,
    logits_BxNxGxV: jax.Array,
    conf_BxNxG: jax.Array | None,
    target_logits_BxNxGxV: jax.Array,
    blocks: AnchorBlocks,
    weights: LossWeights | None = None,
) -> dict[str, jax.Array]:
    """Additive loss numerators/denominators and metric sums for a set of blocks (fp32).

    logits: corrected draft logits (teacher-forced); target logits: no gradient; `weights`:
    its `position` weighs the slots (None = `LossWeights.of(cfg)`). The TV-based
    confidence label c* = clip(1 − ½‖p_d − p_t‖₁, 0, 1) is detached; the L1 gradient flows only
    through p_d.
    """
    f32 = jnp.float32
    p_t = jax.nn.softmax(jax.lax.stop_gradient(target_logits_BxNxGxV).astype(f32), axis=-1)
    ce, l1 = ce_and_l1(logits_BxNxGxV.astype(f32), p_t, blocks.target_ids)
    mask = blocks.eval_mask.astype(f32)  # [B, N, γ]
    pos = weights_for(cfg, weights).position
    w = jnp.asarray(pos, f32)[None, None, :] * mask
    acc = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0))  # 1 − TV = c*
    den = w.sum()
    t = {
        "ce_num": (w * ce).sum(),
        "ce_den": den,
        "l1_num": (w * l1).sum(),
        "l1_den": den,
        "accept_num": (acc * mask).sum((0, 1)),
        "accept_den": mask.sum((0, 1)),
        "n_blocks": blocks.keep.astype(f32).sum(),
        "n_supervised": mask.sum(),
    }
    valid_block = (blocks.keep & blocks.eval_mask.any(-1)).astype(f32)
    tau_block = block_tau(acc, mask)
    t["tau_num"] = (tau_block * valid_block).sum()
    t["tau_den"] = valid_block.sum()
    if conf_BxNxG is not None:
        rho = conf_BxNxG.astype(f32)
        bce = jax.nn.softplus(rho) - acc * rho  # BCE-with-logits against the soft label c*
        t["bce_num"] = (w * bce).sum()
        t["bce_den"] = den
        c = jax.lax.stop_gradient(jax.nn.sigmoid(rho))
        t["conf_abs_error_num"] = (w * jnp.abs(c - acc)).sum()
        t["conf_bias_num"] = (w * (c - acc)).sum()
        cum = jnp.cumprod(c * mask, axis=-1) - jnp.cumprod(acc * mask, axis=-1)
        t["conf_cumprod_bias_num"] = (w * cum).sum()
    return t


def _blocks_chunked(blocks: AnchorBlocks, chunk: int) -> AnchorBlocks:
    """[B, N, ...] -> [N/chunk, B, chunk, ...] for `lax.map` over anchor chunks."""

    def split(x):
        b, n = x.shape[:2]
        x = x.reshape(b, n // chunk, chunk, *x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    return AnchorBlocks(*(split(x) for x in blocks))


def dspark_loss(cfg, trainable, frozen, batch: Batch, rng, weights=None) -> tuple[jax.Array, dict]:
    """DSpark / DFlash: α_ce·CE + α_l1·L1 + α_conf·BCE, slot-weighted means (docs/METHOD.md §4)."""
    model = build(cfg, DrafterParams(trainable, frozen))
    ids = batch["input_ids"].astype(jnp.int32)
    b, seq = ids.shape
    anchors, keep = sample_anchors(rng, batch["loss_mask"], cfg.num_anchors)
    blocks = make_blocks(ids, batch["loss_mask"], anchors, keep, cfg.block_size, cfg.mask_token_id)
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (b, seq))
    ctx_kv = model.context_kv(batch["target_features"], positions)
    hidden = batch["target_hidden"]
    lm_head = frozen["lm_head"][...]

    def terms(blk: AnchorBlocks):
        z = model.blocks(ctx_kv, blk.anchors, blk.keep, blk.block_ids, blk.positions)
        out = teacher_forced(model, z, blk.prev_ids)
        th = jax.vmap(lambda h, p: h[p])(hidden, blk.target_pos)  # [B, n, γ, H]
        t_logits = lm_logits(lm_head, th.astype(lm_head.dtype), cfg.logit_softcap)
        t_logits = jax.lax.stop_gradient(t_logits)
        return block_terms(cfg, out.logits, out.conf_logits, t_logits, blk, weights)

    if cfg.anchor_chunk and cfg.anchor_chunk < cfg.num_anchors:
        per_chunk = jax.lax.map(jax.checkpoint(terms), _blocks_chunked(blocks, cfg.anchor_chunk))
        t = jax.tree.map(lambda x: x.sum(0), per_chunk)
    else:
        t = terms(blocks)
    return combine_terms(cfg, t, weights)


def combine_terms(
    cfg: DrafterConfig, t: dict, weights: LossWeights | None = None
) -> tuple[jax.Array, dict]:
    """(loss, metrics) from summed `block_terms` (sum them over micro-batches or devices first
    to get one weighted mean over all of them). The terms `cfg` switches on (α > 0) are
    weighted by `weights` (None = `LossWeights.of(cfg)`)."""
    a = weights_for(cfg, weights)
    zero = jnp.zeros((), jnp.float32)
    ce = t["ce_num"] / (t["ce_den"] + EPS)
    l1 = t["l1_num"] / (t["l1_den"] + EPS)
    bce = t["bce_num"] / (t["bce_den"] + EPS) if "bce_num" in t else zero
    loss = a.ce * ce
    if cfg.l1_alpha > 0:
        loss = loss + a.l1 * l1
    if "bce_num" in t and cfg.conf_alpha > 0:
        loss = loss + a.conf * bce
    m = {k: jax.lax.stop_gradient(v) for k, v in t.items()}
    m.update(
        loss=jax.lax.stop_gradient(loss),
        ce=jax.lax.stop_gradient(ce),
        l1=jax.lax.stop_gradient(l1),
        bce=jax.lax.stop_gradient(bce),
        accept_rate=m["accept_num"] / jnp.maximum(m["accept_den"], 1.0),
        tau=m["tau_num"] / jnp.maximum(m["tau_den"], 1.0),
    )
    if "bce_num" in t:
        for k in ("conf_abs_error", "conf_bias", "conf_cumprod_bias"):
            m[k] = m[k + "_num"] / (m["bce_den"] + EPS)
    return loss, m


# ---------------------------------------------------------------------------------------------
# Eagle3 (docs/METHOD.md §5.2)


def eagle3_loss(cfg, trainable, frozen, batch: Batch, weights=None) -> tuple[jax.Array, dict]:
    """TTT soft-label CE: Σ_k w_k mean_b [Σ_t M^k_bt·CE(P^k_bt, q^k_bt) / T_b], T_b the real
    length of sequence b (docs/METHOD.md §5.2: per-sequence "local_mean", sequences weigh equally).

    P^k_t = softmax(lm_head(target_hidden[t+k+1])), uniform past the end (never supervised);
    M^0 = loss_mask with each row's last real token cleared, M^k_t = M^0_{t+k}; w_k =
    `weights.position[k]` (default step_loss_decay^k = 0.8^k).
    """
    step_w = weights_for(cfg, weights).position
    f32 = jnp.float32
    model = build(cfg, DrafterParams(trainable, frozen))
    ids = batch["input_ids"].astype(jnp.int32)
    b, seq = ids.shape
    am = batch.get("attention_mask")
    am = jnp.ones((b, seq), f32) if am is None else (am > 0.5).astype(f32)
    valid_len = am.sum(1).astype(jnp.int32)
    lm = (batch["loss_mask"] > 0.5).astype(f32) * am
    lm = jnp.where(jnp.arange(seq)[None, :] == (valid_len - 1)[:, None], 0.0, lm)
    lm_head = frozen["lm_head"][...]
    t_logits = jax.lax.stop_gradient(
        lm_logits(lm_head, batch["target_hidden"].astype(lm_head.dtype), cfg.logit_softcap)
    )  # [B, L, V]
    g_steps = ttt_hidden(model, batch["target_features"], ids, valid_len)  # [γ, B, L, H]
    denom = am.sum()
    row_len = am.sum(1)  # [B] real tokens per sequence
    n_rows = jnp.maximum((row_len > 0).astype(f32).sum(), 1.0)
    inv_len = jnp.where(row_len > 0, 1.0 / jnp.maximum(row_len, 1.0), 0.0)  # [B]
    total = jnp.zeros((), f32)
    acc_num, tv_num, mden, ce_k, match, accs = [], [], [], [], [], []
    # one softmax and one argmax of the target, shifted per step (past the end: the uniform
    # distribution and argmax 0, what zero logits give, bit for bit)
    p_all = jax.nn.softmax(t_logits, axis=-1)
    top_all = jnp.argmax(t_logits, -1)
    uniform = 1.0 / jnp.asarray(t_logits.shape[-1], f32)
    for k in range(cfg.block_size):
        logits = model.logits(g_steps[k]).astype(f32)
        p_t = shift_left(p_all, k + 1, fill=uniform)
        mk = shift_left(lm, k)
        ce, l1 = ce_and_l1(logits, p_t)  # soft-label CE; L1 only for the (detached) metric
        step = ((mk * ce).sum(1) * inv_len).sum() / n_rows
        total = total + step_w[k] * step
        ce_k.append(step)
        acc = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0))
        hit = (jnp.argmax(logits, -1) == shift_left(top_all, k + 1)).astype(f32)
        accs.append(acc * mk)
        match.append(hit * mk)
        tv_num.append((acc * mk).sum())
        acc_num.append((hit * mk).sum())
        mden.append(mk.sum())
    accs, match = jnp.stack(accs, -1), jnp.stack(match, -1)  # [B, L, γ]
    valid0 = lm
    tau, tau_g = block_tau(accs), block_tau(match)
    accept_num, accept_den = jnp.stack(tv_num), jnp.stack(mden)
    m = {
        "loss": total,
        "ce": total,
        "l1": jnp.zeros((), f32),
        "bce": jnp.zeros((), f32),
        "ce_steps": jnp.stack(ce_k),
        "accept_num": accept_num,
        "accept_den": accept_den,
        "accept_rate": accept_num / jnp.maximum(accept_den, 1.0),
        "acc_num": jnp.stack(acc_num),
        "acc": jnp.stack(acc_num) / jnp.maximum(accept_den, 1.0),
        "tau_num": (tau * valid0).sum(),
        "tau_greedy_num": (tau_g * valid0).sum(),
        "tau_den": valid0.sum(),
        "n_supervised": lm.sum(),
        "n_tokens": denom,
    }
    m["tau"] = m["tau_num"] / jnp.maximum(m["tau_den"], 1.0)
    m["tau_greedy"] = m["tau_greedy_num"] / jnp.maximum(m["tau_den"], 1.0)
    m = {k: jax.lax.stop_gradient(v) for k, v in m.items()}
    return total, m


simulated_tau = block_tau  # τ per block [B] (docs/METHOD.md §4.5), owned by spec.metrics


__all__ = [
    "EPS",
    "LossStructure",
    "LossWeights",
    "block_terms",
    "ce_and_l1",
    "combine_terms",
    "dspark_loss",
    "eagle3_loss",
    "loss_fn",
    "loss_structure",
    "position_weights",
    "simulated_tau",
    "weights_for",
]
