"""Frozen, hashable configuration dataclasses.

Every config here can be a static argument of `jax.jit`. Unknown or conflicting fields are errors:
`replace_checked` and `from_overrides` refuse names the dataclass does not have.

One file (~470 lines) on purpose: the config classes share the JSON/override helpers above
them and are read together (TargetConfig → DrafterConfig → TrainConfig); the pipeline's sections
are in `dspark_jax.pipeline_config`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from dspark_jax.errors import ConfigError

ARCHITECTURES = ("qwen3", "qwen2", "llama", "gemma4")
LAYER_TYPES = ("sliding_attention", "full_attention")


def replace_checked(cfg, **overrides):
    """`dataclasses.replace` that rejects unknown field names with a clear error."""
    names = {f.name for f in dataclasses.fields(cfg)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ConfigError(
            f"{type(cfg).__name__} has no field(s) {unknown}; valid fields: {sorted(names)}"
        )
    return dataclasses.replace(cfg, **overrides)


def to_json(cfg) -> dict[str, Any]:
    """A (nested) config dataclass as a JSON-able dict (tuples become lists when dumped)."""
    return dataclasses.asdict(cfg)


def from_json(cls, d: dict[str, Any]):
    """The one JSON reader of every config dataclass: rebuilds `cls` (nested dataclasses, tuples,
    optional fields) from `to_json` output; missing fields take their defaults, unknown ones are
    a ConfigError."""
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue
        v, typ = d[f.name], hints[f.name]
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        base = args[0] if typing.get_origin(typ) in (typing.Union, types.UnionType) else typ
        if dataclasses.is_dataclass(base) and isinstance(v, dict):
            v = from_json(base, v)
        elif typing.get_origin(base) is tuple and isinstance(v, list):
            v = tuple(v)
        kw[f.name] = v
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ConfigError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    return cls(**kw)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (`rope_type == "llama3"`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class Gemma4Config:
    """What a Gemma 4 text decoder adds to `TargetConfig` (whose head_dim / num_kv_heads /
    rope_theta are the sliding layers'). `models/gemma4.py` reads it.

    layer_types: per layer, "sliding_attention" (keys within `sliding_window` positions back) or
      "full_attention" (global: `global_head_dim`, `global_kv_heads`, K = V when `k_eq_v`,
      RoPE with `global_rope_theta` on the first `global_rope_fraction` of each head, frequencies
      divided by `global_rope_factor`: transformers' "proportional" RoPE; 1.0 and 1.0 = default).
    num_kv_shared_layers: the last n layers compute no K/V; each reads the K/V of the last
      earlier layer of its type. hidden_size_per_layer_input: width of the per-layer inputs
      (0 = none). num_experts > 0: a mixture-of-experts block beside each layer's MLP.
    """

    layer_types: tuple[str, ...] = ("sliding_attention",) * 3 + ("full_attention",)
    sliding_window: int = 512
    global_head_dim: int = 32
    global_kv_heads: int = 2
    k_eq_v: bool = False
    global_rope_theta: float = 1e6
    global_rope_fraction: float = 0.25
    global_rope_factor: float = 1.0
    final_logit_softcapping: float | None = None
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0

    def __post_init__(self):
        if not isinstance(self.layer_types, tuple):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(f"unknown layer_types {bad}; supported: {LAYER_TYPES}")
        if self.sliding_window < 1:
            raise ConfigError(f"sliding_window={self.sliding_window} must be >= 1")
        if self.num_experts and not 0 < self.top_k_experts <= self.num_experts:
            raise ConfigError(
                f"top_k_experts={self.top_k_experts} must lie in [1, {self.num_experts}]"
            )
        n, s = len(self.layer_types), self.num_kv_shared_layers
        if not 0 <= s < n or set(self.layer_types[n - s :]) - set(self.layer_types[: n - s]):
            raise ConfigError(
                f"num_kv_shared_layers={s}: every shared layer needs an earlier layer of its "
                f"type among the first {n - s} to read K/V from"
            )

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V `layer` attends to (itself unless it is KV-shared)."""
        first_shared = len(self.layer_types) - self.num_kv_shared_layers
        if layer < first_shared:
            return layer
        kind = self.layer_types[layer]
        return max(i for i in range(first_shared) if self.layer_types[i] == kind)


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Decoder-only target LM of the Qwen3 / Qwen2 / Llama-3 family, or a Gemma 4 text decoder.

    `architecture` decides the small differences: qwen3 has per-head q/k RMSNorm and no bias,
    qwen2 has q/k/v bias, llama has neither (and may carry llama3 RoPE scaling); gemma4 is
    `models/gemma4.py`, its specifics in `gemma`.
    `target_layer_ids` are the decoder layers whose raw outputs (residual stream after the block,
    before the final norm) are concatenated into the drafter's features (REFERENCE §1.4).
    """

    architecture: str = "qwen3"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 4096
    target_layer_ids: tuple[int, ...] = (0, 1, 2)
    dtype: str = "float32"  # compute / parameter dtype: float32 or bfloat16
    gemma: Gemma4Config | None = None  # the Gemma 4 specifics (architecture "gemma4" only)

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(
                f"unknown architecture {self.architecture!r}; supported: {ARCHITECTURES}"
            )
        if (self.architecture == "gemma4") != (self.gemma is not None):
            raise ConfigError("TargetConfig.gemma is set exactly when architecture='gemma4'")
        if self.gemma is not None and len(self.gemma.layer_types) != self.num_layers:
            raise ConfigError(
                f"gemma.layer_types has {len(self.gemma.layer_types)} entries for "
                f"num_layers={self.num_layers}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if not isinstance(self.target_layer_ids, tuple):
            object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        for i in self.target_layer_ids:
            if not 0 <= i < self.num_layers - 1:
                raise ConfigError(
                    f"target_layer_ids {self.target_layer_ids} must lie in [0, {self.num_layers - 2}]"
                    " (the final layer is never a feature layer, REFERENCE §1.4)"
                )

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "qwen3"

    @property
    def qkv_bias(self) -> bool:
        return self.architecture == "qwen2"

    @property
    def num_feature_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def feature_size(self) -> int:
        return self.num_feature_layers * self.hidden_size

    def replace(self, **kw) -> TargetConfig:
        return replace_checked(self, **kw)

    def to_json(self) -> dict[str, Any]:
        return to_json(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TargetConfig:
        return from_json(cls, d)


def default_target_layer_ids(num_layers: int, m: int = 5) -> tuple[int, ...]:
    """Evenly spaced feature layers from 1 to num_layers-3 (36 layers -> (1, 9, 17, 25, 33))."""
    if num_layers < 3:
        return tuple(range(max(num_layers - 1, 0)))[:m] or (0,)
    lo, hi = 1, num_layers - 3
    m = min(m, hi - lo + 1)
    if m <= 1:
        return (lo,)
    return tuple(int(round(lo + i * (hi - lo) / (m - 1))) for i in range(m))


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape over (data, fsdp, tensor). -1 in `data` means: all remaining devices."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1


DRAFTER_KINDS = ("dspark", "dflash", "eagle3")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A drafter for one target: DSpark, DFlash (modified, γ inputs -> γ predictions) or Eagle3.

    The drafter copies the target's per-layer shapes (hidden size, heads, head dim, FFN width,
    architecture, RoPE) from `target`, overriding the layer count; it reads the target features
    of `target.target_layer_ids` (m = len of those). Embedding and LM head are frozen copies of the
    target's (REFERENCE §0, §2.1). A Gemma 4 target gives Gemma layers in its global geometry
    (`layer_config`, REFERENCE §2.10), the scaled embedding and its soft-capped logits.
    Hashable: a static `jax.jit` argument.

    Fields (REFERENCE §0, §2–5, §8):
      kind: "dspark" | "dflash" | "eagle3".
      num_layers: drafter decoder layers (5 for DSpark/DFlash; Eagle3 requires 1).
      block_size: γ, draft tokens per proposal (Eagle3: TTT horizon and proposal length).
      num_anchors: N_a anchor blocks per training sequence (DSpark/DFlash).
      mask_token_id: token id of the γ-1 mask slots; must be a row of the target embedding.
      markov_rank: r of the sequential head; 0 = no head (DFlash).
      markov_head_type: "vanilla" | "gated" | "rnn" (REFERENCE §3.1–3.3).
      confidence_head: add the confidence head σ(w·[z; W1[x_prev]] + b) (REFERENCE §3.5).
      confidence_with_markov: the confidence input includes the Markov embedding W1[x_prev].
      ce_alpha, l1_alpha, conf_alpha: loss weights α (REFERENCE §4.2); l1 is the full L1 (=2·TV).
      loss_decay_gamma: position weights exp(-k/g), k = 0..γ-1 (code default g = 4). None selects
        the paper's variant exp(-(k-1)/γ) (1-indexed), i.e. g = block_size.
      step_loss_decay: Eagle3 TTT step weight base (0.8^k).
      anchor_chunk: 0 = all N_a blocks at once; otherwise blocks are processed (and the loss
        reduced) in rematerialized chunks of this many anchors to bound activation memory.
        Must divide num_anchors.
      dtype: parameter / activation dtype ("float32" or "bfloat16"); losses are always fp32.
      seed: default RNG seed (42 for DSpark/DFlash, 0 for Eagle3 in the reference).
      context_window: 0 = the whole context; W > 0 = a DSpark/DFlash block anchored at position
        a sees only the context positions a - W .. a - 1 (the last W committed positions), an
        Eagle3 position t only the positions t - W + 1 .. t; in training and at serving time
        alike (`drafters.api.narrow_context_window` narrows it for serving, never widens it).
    """

    target: TargetConfig
    kind: str = "dspark"
    num_layers: int = 5
    block_size: int = 7
    num_anchors: int = 512
    mask_token_id: int = -1
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    confidence_head: bool = True
    confidence_with_markov: bool = True
    ce_alpha: float = 0.1
    l1_alpha: float = 0.9
    conf_alpha: float = 1.0
    loss_decay_gamma: float | None = 4.0
    step_loss_decay: float = 0.8
    anchor_chunk: int = 0
    dtype: str = "float32"
    seed: int = 42
    context_window: int = 0

    def __post_init__(self):
        if not isinstance(self.target, TargetConfig):
            raise ConfigError("DrafterConfig.target must be the target's TargetConfig")
        if self.kind not in DRAFTER_KINDS:
            raise ConfigError(f"unknown drafter kind {self.kind!r}; supported: {DRAFTER_KINDS}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.num_layers < 1 or self.block_size < 1:
            raise ConfigError(
                f"num_layers={self.num_layers} and block_size={self.block_size} must be >= 1"
            )
        if not (isinstance(self.context_window, int) and self.context_window >= 0):
            raise ConfigError(
                f"context_window={self.context_window!r} must be an integer >= 0 (0 = the whole "
                "context)"
            )
        v = self.target.vocab_size
        if self.kind == "eagle3":
            if self.num_layers != 1:
                raise ConfigError(
                    f"Eagle3 has exactly one decoder layer (its inference extends the cache "
                    f"without a causal mask, REFERENCE §9.15); got num_layers={self.num_layers}"
                )
            if self.markov_rank or self.confidence_head:
                raise ConfigError(
                    "Eagle3 has no Markov or confidence head: set markov_rank=0, "
                    "confidence_head=False (or use DrafterConfig.eagle3(target))"
                )
        else:
            if not 0 <= self.mask_token_id < v:
                raise ConfigError(
                    f"mask_token_id={self.mask_token_id} is not a row of the target embedding "
                    f"(vocab_size={v}); pass the target's mask token (Qwen3: 151669)"
                )
            if self.num_anchors < 1:
                raise ConfigError(f"num_anchors={self.num_anchors} must be >= 1")
            if self.anchor_chunk < 0 or (
                self.anchor_chunk and self.num_anchors % self.anchor_chunk
            ):
                raise ConfigError(
                    f"anchor_chunk={self.anchor_chunk} must be 0 or divide "
                    f"num_anchors={self.num_anchors}"
                )
        if self.markov_rank < 0:
            raise ConfigError(f"markov_rank={self.markov_rank} must be >= 0 (0 = no head)")
        if self.markov_rank and self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(
                f"unknown markov_head_type {self.markov_head_type!r}; "
                f"supported: {MARKOV_HEAD_TYPES}"
            )
        if self.confidence_head and self.confidence_with_markov and not self.markov_rank:
            raise ConfigError(
                "confidence_with_markov=True needs a Markov head (markov_rank > 0); "
                "set confidence_with_markov=False or markov_rank > 0"
            )
        if self.loss_decay_gamma is not None and self.loss_decay_gamma <= 0:
            raise ConfigError(
                f"loss_decay_gamma={self.loss_decay_gamma} must be > 0 (None = paper variant)"
            )

    @property
    def decay_g(self) -> float:
        """The g of the position weights exp(-k/g) (paper variant: g = block_size)."""
        return float(self.block_size if self.loss_decay_gamma is None else self.loss_decay_gamma)

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def feature_size(self) -> int:
        return self.target.feature_size

    @property
    def layer_config(self) -> TargetConfig:
        """The target config with the drafter's dtype: per-layer shapes of every draft layer.

        Gemma 4 target (REFERENCE §0, §2.10): its text config with every layer full attention
        (the global layers' head size, K/V heads, K = V and RoPE), no KV-shared layers, no
        mixture of experts, no per-layer inputs, untied; at least as many layers as the drafter
        has (the target's feature layers stay valid)."""
        t = self.target.replace(dtype=self.dtype)
        if t.gemma is None:
            return t
        n = max(t.num_layers, self.num_layers)
        off = dict(num_kv_shared_layers=0, use_double_wide_mlp=False, num_experts=0)
        off.update(top_k_experts=0, moe_intermediate_size=0, hidden_size_per_layer_input=0)
        g = dataclasses.replace(
            t.gemma, layer_types=("full_attention",) * n, vocab_size_per_layer_input=0, **off
        )
        return t.replace(num_layers=n, tie_word_embeddings=False, gemma=g)

    @property
    def kv_geometry(self) -> tuple[int, int]:
        """(K/V heads, head size) of every draft layer (Gemma 4: the global layers')."""
        g = self.target.gemma
        if g is None:
            return self.target.num_kv_heads, self.target.head_dim
        return g.global_kv_heads, g.global_head_dim

    @property
    def logit_softcap(self) -> float | None:
        """The target's final-logit soft-cap c (Gemma 4; None: none): c·tanh(logits / c) on the
        draft logits and on the target logits the losses recompute (REFERENCE §1.4, §2.10)."""
        g = self.target.gemma
        return None if g is None else g.final_logit_softcapping

    @property
    def embed_scale(self) -> float | None:
        """The factor of the scaled embedding (Gemma 4: sqrt(H); None: unscaled)."""
        return None if self.target.gemma is None else self.hidden_size**0.5

    def replace(self, **kw) -> DrafterConfig:
        return replace_checked(self, **kw)

    @classmethod
    def dspark(cls, target: TargetConfig, **kw) -> DrafterConfig:
        """DSpark preset: 5 layers, γ=7, vanilla Markov r=256, confidence with Markov,
        α = (0.1, 0.9, 1.0), g = 4 (REFERENCE §8)."""
        return cls(target=target, kind="dspark", **kw)

    @classmethod
    def dflash(cls, target: TargetConfig, **kw) -> DrafterConfig:
        """Modified DFlash preset: same backbone, no heads, CE only."""
        base = dict(
            markov_rank=0,
            confidence_head=False,
            confidence_with_markov=False,
            ce_alpha=1.0,
            l1_alpha=0.0,
            conf_alpha=0.0,
        )
        base.update(kw)
        return cls(target=target, kind="dflash", **base)

    @classmethod
    def eagle3(cls, target: TargetConfig, **kw) -> DrafterConfig:
        """Eagle3 preset: 1 layer, TTT 7, step decay 0.8, soft-label CE, seed 0."""
        base = dict(
            num_layers=1,
            markov_rank=0,
            confidence_head=False,
            confidence_with_markov=False,
            ce_alpha=1.0,
            l1_alpha=0.0,
            conf_alpha=0.0,
            seed=0,
        )
        base.update(kw)
        return cls(target=target, kind="eagle3", **base)


FEATURE_MODES = ("online", "offline")
MEMORY_CHECKS = ("auto", "estimate", "compiled", "off")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Drafter training (REFERENCE §1.5, §4.3, §8). Hashable: a static `jax.jit` argument.

    Optimizer: AdamW(b1, b2, eps, weight_decay) on fp32 master weights of the trainable
    parameters only, global-norm clipping `grad_clip_norm` (0 = off), learning rate warmed up
    linearly over W = int(warmup_ratio * S) updates then cosine to 0 at S (REFERENCE §8):
    update s uses lr·(s+1)/W for s < W, lr·½(1 + cos(π(s−W)/(S−W))) after.
    S = `total_steps`, or `num_epochs * steps_per_epoch` when it is 0.

    Batching: one optimizer step takes `global_batch_size` sequences as micro-batches of
    `micro_batch_size` (over all devices); the gradient is the equal-weight mean of the
    micro-batch losses' gradients, accumulated in fp32 (REFERENCE §4.3). Sequences are right-padded
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

    def replace(self, **kw) -> TrainConfig:
        return replace_checked(self, **kw)

    def to_json(self) -> dict[str, Any]:
        return to_json(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrainConfig:
        return from_json(cls, d)
