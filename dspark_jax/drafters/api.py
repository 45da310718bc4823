"""The drafter interface, dispatched on the static `DrafterConfig.kind` (see the package doc)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.drafters.common import DrafterParams, FrozenParam, Proposal
from dspark_jax.drafters.dspark import (
    BlockContext,
    BlockDrafter,
    extend_block_context,
    init_block_context,
    propose_block,
)
from dspark_jax.drafters.eagle3 import (
    Eagle3Context,
    Eagle3Drafter,
    extend_eagle3_context,
    init_eagle3_context,
    propose_eagle3,
)
from dspark_jax.drafters.paged_context import PagedContext, paged_extend, paged_propose
from dspark_jax.errors import ConfigError
from dspark_jax.models.transformer import embedding_table
from dspark_jax.spec.sampling import SamplingConfig, SamplingParams


def _module_cls(cfg: DrafterConfig):
    return Eagle3Drafter if cfg.kind == "eagle3" else BlockDrafter


@functools.lru_cache(maxsize=64)
def graphdef(cfg: DrafterConfig):
    """The static NNX graph definition for `cfg` (no parameters allocated)."""
    abstract = nnx.eval_shape(lambda: _module_cls(cfg)(cfg, rngs=nnx.Rngs(0)))
    return nnx.split(abstract, nnx.Param, FrozenParam)[0]


def init_params(
    cfg: DrafterConfig, seed: int | None = None, target_params: nnx.State | None = None
) -> DrafterParams:
    """Random trainable parameters (HF init: N(0, 0.02) weights, zero biases, unit norms).

    With `target_params` (the target's `nnx.State`), `frozen` holds copies of the target's
    embedding and LM head (`frozen_from_target`); otherwise they are random (tests only).
    """
    seed = cfg.seed if seed is None else seed
    module = _module_cls(cfg)(cfg, rngs=nnx.Rngs(seed))
    _, trainable, frozen = nnx.split(module, nnx.Param, FrozenParam)
    if target_params is not None:
        frozen = frozen_from_target(cfg, target_params)
    return DrafterParams(trainable, frozen)


def frozen_from_target(cfg: DrafterConfig, target_params: nnx.State) -> nnx.State:
    """The drafter's frozen state from the target's parameters: embed_tokens [V, H] and lm_head
    [H, V] (the target's untied head, or its embedding transposed when tied)."""
    tcfg = cfg.target
    emb = jnp.asarray(embedding_table(target_params))
    if emb.shape != (tcfg.vocab_size, tcfg.hidden_size):
        raise ConfigError(
            f"target embedding has shape {emb.shape}, the drafter expects "
            f"{(tcfg.vocab_size, tcfg.hidden_size)}: the drafter config must copy its target's"
        )
    if tcfg.tie_word_embeddings or "lm_head" not in target_params:
        head = emb.T
    else:
        head = jnp.asarray(target_params["lm_head"]["kernel"][...])
    dt = jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32
    _, _, frozen = nnx.split(
        nnx.eval_shape(lambda: _module_cls(cfg)(cfg, rngs=nnx.Rngs(0))), nnx.Param, FrozenParam
    )
    frozen["embed_tokens"] = frozen["embed_tokens"].replace(emb.astype(dt))
    frozen["lm_head"] = frozen["lm_head"].replace(head.astype(dt))
    return frozen


def share_target_tables(params: DrafterParams, target_params: nnx.State) -> DrafterParams:
    """`params` with its frozen embedding / LM head replaced by the target's own arrays where
    they are bitwise equal (the target's embedding, and its LM head kernel when it has one:
    untied, or `transformer.untie_lm_head`'s copy). The values are unchanged; a program given
    both param trees then reads one buffer per table, so the drafter's LM head product after the
    verify forward finds the target's head in cache (docs/MEASUREMENTS.md: engine_head), and the
    tables are held once. Other leaves, and tables that differ (a drafter of another dtype or
    vocabulary), are kept as they are."""
    tables = [embedding_table(target_params)]
    if "lm_head" in target_params:
        tables.append(target_params["lm_head"]["kernel"][...])

    def shared(x):
        for t in tables:
            if t.shape == x.shape and t.dtype == x.dtype and bool(jnp.array_equal(t, x)):
                return t
        return x

    return params._replace(frozen=jax.tree.map(shared, params.frozen))


def narrow_context_window(cfg: DrafterConfig, window: int | None) -> DrafterConfig:
    """`cfg` serving with context window `window` (None: as trained). It may narrow the window the
    drafter was trained with (0 = the whole context), never widen it: a drafter trained on W
    positions is refused more (ConfigError naming the limit)."""
    if window is None or window == cfg.context_window:
        return cfg
    if not (isinstance(window, int) and window >= 1):
        raise ConfigError(f"context window {window!r} must be an integer >= 1 (None: as trained)")
    if cfg.context_window and window > cfg.context_window:
        raise ConfigError(
            f"context window {window} is wider than the {cfg.context_window} positions the "
            f"{cfg.kind} drafter was trained with; use a window <= {cfg.context_window}"
        )
    return cfg.replace(context_window=window)


def build(cfg: DrafterConfig, params: DrafterParams):
    """The NNX module for `params` (inside jit: a pure merge)."""
    return nnx.merge(graphdef(cfg), params.trainable, params.frozen)


def init_context(cfg: DrafterConfig, batch: int, max_len: int) -> BlockContext | Eagle3Context:
    """An empty drafter context (own KV cache of `max_len` positions) for `batch` requests."""
    if cfg.kind == "eagle3":
        return init_eagle3_context(cfg, batch, max_len)
    return init_block_context(cfg, batch, max_len)


def extend_context(
    cfg: DrafterConfig, params: DrafterParams, ctx, features_BxTxF, next_tokens_BxT, num_new_B
):
    """Append the target features of committed positions ctx.lengths + t, t < num_new[b].

    `ctx`: a dense context (`init_context`) or a `paged_context.PagedContext` with its rows'
    block tables (its K/V written straight into their pages).
    Static: cfg and shapes. Arrays: params, ctx, features [B, T, m·H], next_tokens [B, T]
    (the committed token following each featured position; read by Eagle3 only), num_new [B].
    """
    model = build(cfg, params)
    num_new_B = jnp.asarray(num_new_B, jnp.int32)
    if isinstance(ctx, PagedContext):
        return paged_extend(model, ctx, features_BxTxF, next_tokens_BxT, num_new_B)
    if cfg.kind == "eagle3":
        return extend_eagle3_context(model, ctx, features_BxTxF, next_tokens_BxT, num_new_B)
    return extend_block_context(model, ctx, features_BxTxF, num_new_B)


def prefill_context(
    cfg: DrafterConfig,
    params: DrafterParams,
    features_BxTxF,
    next_tokens_BxT,
    lengths_B,
    max_len: int,
):
    """`extend_context` on an empty context: prompt features at positions 0..lengths[b]−1,
    next_tokens = prompt[1:] followed by the first sampled token."""
    ctx = init_context(cfg, features_BxTxF.shape[0], max_len)
    return extend_context(cfg, params, ctx, features_BxTxF, next_tokens_BxT, lengths_B)


def propose(
    cfg: DrafterConfig,
    params: DrafterParams,
    ctx,
    anchor_B,
    key,
    seeds_B,
    sampling: SamplingParams | None = None,
    scfg: SamplingConfig | None = None,
    rounds_B=None,
) -> Proposal:
    """Draft γ tokens per request (see the package doc for keys and positions).

    Static: cfg, scfg (`spec.sampling.SamplingConfig`; None = plain sampling, greedy=True =
    argmax). Arrays: params, ctx (dense or paged with its tables, as `extend_context`'s),
    anchor [B] (the token at position ctx.lengths; Eagle3 already
    consumed it in `extend_context`), key (the engine's root key; draws use the DRAFT stream of
    `spec.rng`), seeds [B], sampling (per-row `SamplingParams`; None = temperature 1),
    rounds [B] (optional per-request round counter: draft noise keyed by (seed, round, position),
    the `spec.rng.DRAFT_ROUND` stream; the serving engine always passes it).
    """
    model = build(cfg, params)
    if isinstance(ctx, PagedContext):
        anchor_B = jnp.asarray(anchor_B, jnp.int32)
        return paged_propose(model, ctx, anchor_B, key, seeds_B, sampling, scfg, rounds_B)
    if cfg.kind == "eagle3":
        return propose_eagle3(model, ctx, key, seeds_B, sampling, scfg, rounds_B=rounds_B)
    anchor_B = jnp.asarray(anchor_B, jnp.int32)
    return propose_block(model, ctx, anchor_B, key, seeds_B, sampling, scfg, rounds_B=rounds_B)


propose_jit = jax.jit(propose, static_argnames=("cfg", "scfg"))
extend_context_jit = jax.jit(extend_context, static_argnames=("cfg",), donate_argnames=("ctx",))
