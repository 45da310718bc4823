"""Drafter training's configuration: `TrainConfig` (optimizer, batching, memory plan,
evaluation and checkpoint intervals). Re-exported by `dspark_jax.config`.
"""

from __future__ import annotations

import dataclasses

from dspark_jax.config.base import ConfigMethods
from dspark_jax.errors import ConfigError

FEATURE_MODES = ("online", "offline")
MEMORY_CHECKS = ("auto", "estimate", "compiled", "off")


@dataclasses.dataclass(frozen=True)
class TrainConfig(ConfigMethods):
    """Drafter training (docs/METHOD.md §1.5, §4.3, §8). Hashable: a static `jax.jit` argument.

    Optimizer: AdamW(b1, b2, eps, weight_decay) on fp32 master weights of the trainable
    parameters only, global-norm clipping `grad_clip_norm` (0 = off), learning rate warmed up
    linearly over W = int(warmup_ratio * S) updates then cosine to 0 at S (docs/METHOD.md §8):
    update s uses lr·(s+1)/W for s < W, lr·½(1 + cos(π(s−W)/(S−W))) after.
    S = `total_steps`, or `num_epochs * steps_per_epoch` when it is 0.

    Batching: one optimizer step takes `global_batch_size` sequences as micro-batches of
    `micro_batch_size` (over all devices); the gradient is the equal-weight mean of the
    micro-batch losses' gradients, summed in fp32 (docs/METHOD.md §4.3). Sequences are right-padded
    to the smallest of `seq_buckets` that fits the micro-batch; one compilation per bucket.
    `compute_dtype` is the dtype the drafter runs in ("bfloat16", "float32", or "auto": bfloat16
    on GPU/TPU, float32 on CPU); master weights, gradient accumulators and Adam state stay fp32.
    `target_dtype` is the frozen target's storage/compute dtype ("auto" = the compute dtype).
    `anchor_chunk` (DSpark/DFlash) overrides the drafter config's: anchors per rematerialized
    chunk, the bound on the [anchors x γ, vocab] logits (0 = all at once, -1 = keep the
    drafter's). Memory plan (`train.memory`): before the first step the trainer prints per-device
    bytes (params, optimizer, activations, logits) and refuses a plan over 90% of the devices'
    memory (`device_memory_gib`, 0 = ask the devices; CPU reports none). `memory_check`: "auto"
    (estimate, plus XLA's compiled memory analysis on accelerators), "estimate", "compiled"
    (also on CPU) or "off".

    `feature_mode`: "online" runs the frozen target inside the train step; "offline" reads a
    feature cache (`train.features`). `empty_sequences`: "skip" leaves sequences without a
    supervised token out of the stream, "error" refuses the dataset.
    Intervals are in optimizer steps (0 = never); `best_metric` ("sim_tau" or "tau") picks the
    best checkpoint on held-out data, higher is better.
    """

    learning_rate: float = 6e-4
    warmup_ratio: float = 0.04
    num_epochs: int = 10
    total_steps: int = 0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0
    global_batch_size: int = 512
    micro_batch_size: int = 8
    seq_buckets: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    data_seed: int = 42
    seed: int = 42
    compute_dtype: str = "auto"
    target_dtype: str = "auto"
    anchor_chunk: int = -1
    memory_check: str = "auto"
    device_memory_gib: float = 0.0
    feature_mode: str = "online"
    empty_sequences: str = "skip"
    eval_interval: int = 500
    eval_batch_size: int = 8
    max_eval_batches: int = 0
    best_metric: str = "sim_tau"
    checkpoint_interval: int = 3000
    keep_checkpoints: int = 2
    async_checkpoint: bool = True
    log_interval: int = 10
    progress_bar: bool = True
    pad_id: int = 0

    # Fields that do not change the loss trajectory: may differ between a run and its resume.
    RESUMABLE_CHANGES = (
        "eval_interval",
        "eval_batch_size",
        "max_eval_batches",
        "checkpoint_interval",
        "keep_checkpoints",
        "async_checkpoint",
        "log_interval",
        "progress_bar",
        "memory_check",
        "device_memory_gib",
    )

    def __post_init__(self):
        if not isinstance(self.seq_buckets, tuple):
            object.__setattr__(self, "seq_buckets", tuple(self.seq_buckets))
        for name in ("compute_dtype", "target_dtype"):
            if getattr(self, name) not in ("auto", "float32", "bfloat16"):
                raise ConfigError(
                    f"{name} must be 'auto', 'float32' or 'bfloat16', got {getattr(self, name)!r}"
                )
        if self.memory_check not in MEMORY_CHECKS:
            raise ConfigError(
                f"memory_check must be one of {MEMORY_CHECKS}, got {self.memory_check!r}"
            )
        if self.anchor_chunk < -1 or self.device_memory_gib < 0:
            raise ConfigError(
                f"anchor_chunk={self.anchor_chunk} must be >= -1 (-1 = the drafter's) and "
                f"device_memory_gib={self.device_memory_gib} >= 0 (0 = ask the devices)"
            )
        if self.feature_mode not in FEATURE_MODES:
            raise ConfigError(
                f"feature_mode must be one of {FEATURE_MODES}, got {self.feature_mode!r}"
            )
        if self.empty_sequences not in ("skip", "error"):
            raise ConfigError(
                f"empty_sequences must be 'skip' or 'error', got {self.empty_sequences!r}"
            )
        if self.best_metric not in ("sim_tau", "tau"):
            raise ConfigError(f"best_metric must be 'sim_tau' or 'tau', got {self.best_metric!r}")
        if self.micro_batch_size < 1 or self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} must be a positive multiple of "
                f"micro_batch_size={self.micro_batch_size}"
            )
        if not self.seq_buckets or min(self.seq_buckets) < 1:
            raise ConfigError(f"seq_buckets={self.seq_buckets} must be non-empty positive lengths")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        if self.total_steps < 0 or self.num_epochs < 0:
            raise ConfigError("total_steps and num_epochs must be >= 0")
        if self.total_steps == 0 and self.num_epochs == 0:
            raise ConfigError("set total_steps > 0 or num_epochs > 0")
        for name in ("eval_interval", "checkpoint_interval", "log_interval", "max_eval_batches"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0 (0 = never/all)")
        if self.keep_checkpoints < 1 or self.eval_batch_size < 1:
            raise ConfigError("keep_checkpoints and eval_batch_size must be >= 1")

    @property
    def accum_steps(self) -> int:
        return self.global_batch_size // self.micro_batch_size
