"""DSpark = DFlash backbone + sequential Markov head + confidence head (DFlash: no heads).

Training (`teacher_forced`): previous tokens are the ground truth, prev[j] = [x_a, x_{a+1}, …,
x_{a+γ−1}], all slots in parallel (RNN: a γ-step scan). Inference (`propose_block`): the backbone
runs once per block, then a `lax.scan` over the γ slots samples left to right — slot 0's
previous token is the anchor, slot k's is the token just drawn at slot k−1 — recording the exact
distribution (after the sampling transform) each token was drawn from (REFERENCE §3.4).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.drafters.common import Proposal, draft_keys, draw_tokens, sampling_probs
from dspark_jax.drafters.dflash import BlockContext, BlockDrafter, single_block


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
    cfg = model.cfg
    g = cfg.block_size
    b = anchor_B.shape[0]
    z = single_block(model, ctx, anchor_B)  # [B, γ, H]
    base = model.base_logits(z)  # [B, γ, V]
    positions = ctx.lengths[:, None] + 1 + jnp.arange(g, dtype=jnp.int32)[None, :]
    keys = draft_keys(key, seeds_B, positions, rounds_B)  # [B, γ]
    head, conf_head = model.markov_head, model.confidence_head
    state0 = head.init_state((b,), z.dtype) if head is not None else jnp.zeros((), z.dtype)
    forced = jnp.zeros((b, g), jnp.int32) if forced_BxG is None else forced_BxG

    def body(carry, xs):
        prev, state = carry
        z_k, u_k, key_k, forced_k = xs
        e = None
        logits = u_k
        if head is not None:
            state, bias, e = head.step(state, prev, z_k)
            logits = logits + bias
        conf = conf_head(z_k, e) if conf_head is not None else jnp.zeros((b,), jnp.float32)
        probs = sampling_probs(logits, sampling, scfg)
        tok = forced_k if forced_BxG is not None else draw_tokens(key_k, probs, scfg)
        return (tok, state), (tok, probs, conf)

    xs = (jnp.moveaxis(z, 1, 0), jnp.moveaxis(base, 1, 0), jnp.moveaxis(keys, 1, 0), forced.T)
    _, (toks, probs, conf) = jax.lax.scan(body, (anchor_B.astype(jnp.int32), state0), xs)
    conf_logits = jnp.moveaxis(conf, 0, 1) if conf_head is not None else None
    return Proposal(jnp.moveaxis(toks, 0, 1), jnp.moveaxis(probs, 0, 1), conf_logits)
