"""Frozen, hashable configuration dataclasses.

Every config here can be a static argument of `jax.jit`. Unknown or conflicting fields are errors:
`replace_checked` and `from_overrides` refuse names the dataclass does not have.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

ARCHITECTURES = ("qwen3", "qwen2", "llama")

_HF_ARCH = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}


class ConfigError(ValueError):
    """A configuration that cannot work; the message says what to change."""


def replace_checked(cfg, **overrides):
    """`dataclasses.replace` that rejects unknown field names with a clear error."""
    names = {f.name for f in dataclasses.fields(cfg)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ConfigError(
            f"{type(cfg).__name__} has no field(s) {unknown}; valid fields: {sorted(names)}"
        )
    return dataclasses.replace(cfg, **overrides)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (`rope_type == "llama3"`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Decoder-only target LM of the Qwen3 / Qwen2 / Llama-3 family.

    `architecture` decides the small differences: qwen3 has per-head q/k RMSNorm and no bias,
    qwen2 has q/k/v bias, llama has neither (and may carry llama3 RoPE scaling).
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

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(
                f"unknown architecture {self.architecture!r}; supported: {ARCHITECTURES}"
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
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TargetConfig:
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["target_layer_ids"] = tuple(d.get("target_layer_ids", ()))
        return cls(**d)

    @classmethod
    def from_hf(
        cls,
        path_or_dict: str | os.PathLike | dict,
        *,
        target_layer_ids: tuple[int, ...] | None = None,
        dtype: str = "float32",
    ) -> TargetConfig:
        """Build from a Hugging Face `config.json` (a directory, the file, or its dict).

        transformers 5 keeps RoPE settings in `rope_parameters`; older files use `rope_theta` and
        `rope_scaling` at the top level. Both are read. Default feature layers follow DFlash's
        rule: 5 layers spread evenly from layer 1 to layer num_layers - 3.
        """
        if isinstance(path_or_dict, dict):
            hf = path_or_dict
        else:
            p = os.fspath(path_or_dict)
            if os.path.isdir(p):
                p = os.path.join(p, "config.json")
            if not os.path.exists(p):
                raise ConfigError(f"no config.json at {p}")
            with open(p) as f:
                hf = json.load(f)
        archs = hf.get("architectures") or []
        arch = None
        for a in archs:
            if a in _HF_ARCH:
                arch = _HF_ARCH[a]
        if arch is None:
            mt = hf.get("model_type")
            arch = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama"}.get(mt)
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; "
                f"supported: {sorted(_HF_ARCH)}"
            )
        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling") or {}
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rtype = rope.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
        scaling = None
        if rtype == "llama3":
            src = rope if "factor" in rope else legacy
            scaling = RopeScaling(
                factor=float(src["factor"]),
                low_freq_factor=float(src["low_freq_factor"]),
                high_freq_factor=float(src["high_freq_factor"]),
                original_max_position_embeddings=int(src["original_max_position_embeddings"]),
            )
        elif rtype not in ("default", None):
            raise ConfigError(f"unsupported rope_type {rtype!r}; supported: default, llama3")
        n_layers = int(hf["num_hidden_layers"])
        n_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = int(hf.get("head_dim") or hidden // n_heads)
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(n_layers)
        if arch == "qwen2" and hf.get("use_sliding_window"):
            raise ConfigError("Qwen2 sliding-window attention is not supported")
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            target_layer_ids=tuple(target_layer_ids),
            dtype=dtype,
        )


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
