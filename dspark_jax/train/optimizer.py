"""The drafter optimizer: AdamW on fp32 master weights, global-norm clipping, warmup + cosine.

    settings = OptimizerSettings.of(train_cfg)       # the fields the optimizer reads, by name
    tx = make_optimizer(settings, total_steps)      # or make_optimizer(train_cfg, total_steps)

`make_optimizer` and `lr_schedule` read only the attributes named by `OptimizerSettings`, so they
accept a `TrainConfig` or the small frozen `OptimizerSettings` (the static argument of the jitted
update step, `train.steps`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """What the optimizer and its schedule read of a `TrainConfig` (docs/METHOD.md §8)."""

    learning_rate: float
    warmup_ratio: float
    adam_b1: float
    adam_b2: float
    adam_eps: float
    weight_decay: float
    grad_clip_norm: float

    @classmethod
    def of(cls, cfg: Any) -> OptimizerSettings:
        """Every field read by name from `cfg` (no defaults: a missing one is an error)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})


def lr_schedule(cfg, total_steps: int) -> Callable[[jax.Array], jax.Array]:
    """docs/METHOD.md §8: update s (0-indexed) uses lr·(s+1)/W for s < W, lr·½(1+cos(π(s−W)/(S−W)))
    for W ≤ s < S, 0 after; W = int(warmup_ratio·S)."""
    peak, s_total = cfg.learning_rate, int(total_steps)
    warm = int(cfg.warmup_ratio * s_total)

    def schedule(count):
        s = jnp.asarray(count, jnp.float32)
        warm_lr = peak * (s + 1.0) / max(warm, 1)
        frac = jnp.clip((s - warm) / max(s_total - warm, 1), 0.0, 1.0)
        cos_lr = peak * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
        return jnp.where(s < warm, warm_lr, cos_lr)

    return schedule


def make_optimizer(cfg, total_steps: int) -> optax.GradientTransformation:
    """Global-norm clipping (`grad_clip_norm`, 0 = off) then AdamW with the warmup-cosine
    schedule; `cfg` is a `TrainConfig` or an `OptimizerSettings`."""
    adamw = optax.adamw(
        lr_schedule(cfg, total_steps),
        b1=cfg.adam_b1,
        b2=cfg.adam_b2,
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
    )
    if cfg.grad_clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adamw)
    return adamw


__all__ = ["OptimizerSettings", "lr_schedule", "make_optimizer"]
