"""The target LM's configuration: `TargetConfig` (Qwen3 / Qwen2 / Llama-3, Gemma 4), its
`RopeScaling` and `Gemma4Config` parts, and `default_target_layer_ids`. Re-exported by
`dspark_jax.config`.
"""

from __future__ import annotations

import dataclasses

from dspark_jax.config.base import ConfigMethods
from dspark_jax.errors import ConfigError

ARCHITECTURES = ("qwen3", "qwen2", "llama", "gemma4")
LAYER_TYPES = ("sliding_attention", "full_attention")


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
class TargetConfig(ConfigMethods):
    """Decoder-only target LM of the Qwen3 / Qwen2 / Llama-3 family, or a Gemma 4 text decoder.

    `architecture` decides the small differences: qwen3 has per-head q/k RMSNorm and no bias,
    qwen2 has q/k/v bias, llama has neither (and may carry llama3 RoPE scaling); gemma4 is
    `models/gemma4.py`, its specifics in `gemma`.
    `target_layer_ids` are the decoder layers whose raw outputs (residual stream after the block,
    before the final norm) are concatenated into the drafter's features (docs/METHOD.md §1.4).
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
                    " (the final layer is never a feature layer, docs/METHOD.md §1.4)"
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


def default_target_layer_ids(num_layers: int, m: int = 5) -> tuple[int, ...]:
    """Evenly spaced feature layers from 1 to num_layers-3 (36 layers -> (1, 9, 17, 25, 33))."""
    if num_layers < 3:
        return tuple(range(max(num_layers - 1, 0)))[:m] or (0,)
    lo, hi = 1, num_layers - 3
    m = min(m, hi - lo + 1)
    if m <= 1:
        return (lo,)
    return tuple(int(round(lo + i * (hi - lo) / (m - 1))) for i in range(m))
