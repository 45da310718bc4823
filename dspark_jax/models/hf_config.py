"""Hugging Face `config.json` <-> `TargetConfig`: the one place that translates HF config fields
(architecture, rope scaling, tied embeddings, our feature-layer key) in either direction.
`models.hf` reads and writes the weights around it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from dspark_jax.config import RopeScaling, TargetConfig, default_target_layer_ids
from dspark_jax.errors import CheckpointError, ConfigError
from dspark_jax.models.hf_gemma4 import FULL, gemma4_config, is_gemma4

_HF_CLASS = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
_HF_ARCH = {v: k for k, v in _HF_CLASS.items()}
_LAYER_IDS_KEY = "dspark_target_layer_ids"


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed `config.json` of a checkpoint directory (CheckpointError if absent/invalid)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path!r} does not exist")
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        raise CheckpointError(
            f"missing file: no config.json in {path!r}; a Hugging Face checkpoint directory needs "
            "config.json next to its safetensors"
        )
    try:
        with open(f) as fh:
            return json.load(fh)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f} is not valid JSON: {e}") from e


def config_from_hf(
    hf: Mapping[str, Any],
    *,
    dtype: str = "float32",
    target_layer_ids: tuple[int, ...] | None = None,
) -> TargetConfig:
    """The `TargetConfig` of a Hugging Face `config.json` dict (the project's only HF config
    reader), refusing features our decoder does not implement (CheckpointError naming them).

    transformers 5 keeps RoPE settings in `rope_parameters`; older files use `rope_theta` and
    `rope_scaling` at the top level. Both are read. Feature layers: `target_layer_ids`, else the
    ones `save_target_hf` recorded, else DFlash's rule (`config.default_target_layer_ids`).
    """
    hf = dict(hf)
    if target_layer_ids is None and hf.get(_LAYER_IDS_KEY) is not None:
        target_layer_ids = tuple(hf[_LAYER_IDS_KEY])
    if is_gemma4(hf):
        try:
            return gemma4_config(hf, target_layer_ids, dtype)
        except ConfigError as e:
            raise CheckpointError(str(e)) from e
        except KeyError as e:
            raise CheckpointError(f"config.json lacks required field {e.args[0]!r}") from e
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU MLP) is")
    if hf.get("mlp_bias"):
        raise CheckpointError("unsupported mlp_bias=true; our MLP has no biases")
    mt = hf.get("model_type")
    archs = hf.get("architectures") or []
    if hf.get("attention_bias") and mt != "qwen2" and "Qwen2ForCausalLM" not in archs:
        raise CheckpointError(
            f"unsupported attention_bias=true for {archs or mt}; only Qwen2 has q/k/v biases"
        )
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or []):
        raise CheckpointError(
            f"sliding-window attention layers are supported for Gemma 4 only, not {archs or mt}"
        )
    try:
        return _target_config(hf, target_layer_ids, dtype)
    except ConfigError as e:  # TargetConfig's own checks
        raise CheckpointError(str(e)) from e
    except KeyError as e:
        raise CheckpointError(f"config.json lacks required field {e.args[0]!r}") from e


def _target_config(hf: dict[str, Any], target_layer_ids, dtype: str) -> TargetConfig:
    arch = None
    for a in hf.get("architectures") or []:
        arch = _HF_ARCH.get(a, arch)
    if arch is None:
        arch = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama"}.get(hf.get("model_type"))
    if arch is None:
        raise CheckpointError(
            f"unsupported architecture {hf.get('architectures') or hf.get('model_type')!r}; "
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
        raise CheckpointError(f"unsupported rope_type {rtype!r}; supported: default, llama3")
    n_layers = int(hf["num_hidden_layers"])
    n_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(n_layers)
    return TargetConfig(
        architecture=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=int(hf.get("head_dim") or hidden // n_heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        target_layer_ids=tuple(target_layer_ids),
        dtype=dtype,
    )


def base_config_dict(
    cfg: TargetConfig,
    hf_class: str,
    model_type: str,
    rope: dict[str, Any],
    *,
    activation: tuple[str, str],
    attention_bias: bool,
    **geometry: Any,
) -> dict[str, Any]:
    """The `config.json` keys every text config we write shares (`hf_config_dict`'s and
    `gemma4_text_config_dict`'s), in their written order: class, model type and geometry (with
    `geometry`'s own keys after `head_dim`), the activation as `(key, name)` (its key differs
    by model), norm, rope, positions, tying and attention; the callers add theirs after."""
    act_key, act = activation
    return {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        **geometry,
        act_key: act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": attention_bias,
        "attention_dropout": 0.0,
    }


def hf_config_dict(cfg: TargetConfig, dtype: str | None = None) -> dict[str, Any]:
    """The Hugging Face `config.json` for `cfg` (transformers 5 layout, `rope_parameters`)."""
    if cfg.architecture not in _HF_CLASS:
        raise CheckpointError(f"saving a {cfg.architecture} target as HF is not supported yet")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope.update(
            rope_type="llama3",
            factor=s.factor,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings,
        )
    d = base_config_dict(
        cfg,
        _HF_CLASS[cfg.architecture],
        cfg.architecture,
        rope,
        activation=("hidden_act", "silu"),
        attention_bias=cfg.qkv_bias,
    )
    d.update({"dtype": dtype or cfg.dtype, _LAYER_IDS_KEY: list(cfg.target_layer_ids)})
    if cfg.architecture == "llama":
        d["mlp_bias"] = False
    else:
        d["use_sliding_window"] = False
    return d


def gemma4_text_config_dict(cfg: TargetConfig, dtype: str | None = None) -> dict[str, Any]:
    """The HF `Gemma4TextConfig` fields of `cfg` (the inverse of `gemma4_config`): the global
    layers' geometry as `global_head_dim` / `num_global_key_value_heads` (the released
    configs' keys), or as `per_layer_config` where K/V heads differ without K = V."""
    g = cfg.gemma
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": g.global_rope_theta}
    if (g.global_rope_fraction, g.global_rope_factor) != (1.0, 1.0):
        full.update(rope_type="proportional", partial_rotary_factor=g.global_rope_fraction)
        if g.global_rope_factor != 1.0:
            full["factor"] = g.global_rope_factor
    moe = g.num_experts > 0
    sliding = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    d: dict[str, Any] = {
        **base_config_dict(
            cfg,
            "Gemma4ForCausalLM",
            "gemma4_text",
            {"sliding_attention": sliding, "full_attention": full},
            activation=("hidden_activation", "gelu_pytorch_tanh"),
            attention_bias=False,
            global_head_dim=g.global_head_dim,
            num_global_key_value_heads=g.global_kv_heads if g.k_eq_v else None,
            attention_k_eq_v=g.k_eq_v,
        ),
        "sliding_window": g.sliding_window,
        "layer_types": list(g.layer_types),
        "final_logit_softcapping": g.final_logit_softcapping,
        "num_kv_shared_layers": g.num_kv_shared_layers,
        "use_double_wide_mlp": g.use_double_wide_mlp,
        "hidden_size_per_layer_input": g.hidden_size_per_layer_input,
        "vocab_size_per_layer_input": g.vocab_size_per_layer_input,
        "enable_moe_block": moe,
        "num_experts": g.num_experts if moe else None,
        "top_k_experts": g.top_k_experts if moe else None,
        "moe_intermediate_size": g.moe_intermediate_size if moe else None,
        "dtype": dtype or cfg.dtype,
    }
    if not g.k_eq_v and g.global_kv_heads != cfg.num_kv_heads:
        over = {"head_dim": g.global_head_dim, "num_key_value_heads": g.global_kv_heads}
        d["per_layer_config"] = {str(i): over for i, t in enumerate(g.layer_types) if t == FULL}
    return d
