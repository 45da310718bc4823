"""Hugging Face Gemma 4 text `config.json` -> `TargetConfig` (architecture "gemma4"): the
transformers 5 `Gemma4TextConfig` fields, with its defaults where a field is absent. Every field
our decoder (`models/gemma4.py`) does not implement is refused here, before any weight is read.
`models.hf_config.config_from_hf` dispatches here. A multimodal checkpoint
(`Gemma4ForConditionalGeneration`) loads its text decoder (`weights_prefix`).
`models.hf_config.gemma4_text_config_dict` writes a `TargetConfig` back as that text config (the
drafter checkpoints of `drafters/hf.py` carry one)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dspark_jax.config import Gemma4Config, TargetConfig, default_target_layer_ids
from dspark_jax.errors import CheckpointError

FULL = "full_attention"
# Gemma 4 and the encoder-free "unified" Gemma 4 (google/gemma-4-12B-it): the same text decoder
_GEMMA4_TEXT_TYPES = ("gemma4_text", "gemma4_unified_text")
_GEMMA4_MULTIMODAL_TYPES = ("gemma4", "gemma4_unified")
_GEMMA4_CAUSAL_LM = ("Gemma4ForCausalLM", "Gemma4UnifiedForCausalLM")
_GEMMA4_MULTIMODAL = ("Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration")
_GEMMA4_OVERRIDES = {"head_dim", "num_key_value_heads"}


def is_gemma4(hf: Mapping[str, Any]) -> bool:
    archs = hf.get("architectures") or []
    return hf.get("model_type") in (*_GEMMA4_TEXT_TYPES, *_GEMMA4_MULTIMODAL_TYPES) or any(
        a in (*_GEMMA4_CAUSAL_LM, *_GEMMA4_MULTIMODAL) for a in archs
    )


def is_multimodal(hf: Mapping[str, Any]) -> bool:
    """A `Gemma4ForConditionalGeneration` / `Gemma4UnifiedForConditionalGeneration` checkpoint
    (the released ones): the text decoder's config is its `text_config`, its weights sit under
    `model.language_model.` (the vision and audio parts are ignored)."""
    archs = hf.get("architectures") or []
    return hf.get("model_type") in _GEMMA4_MULTIMODAL_TYPES or any(
        a in _GEMMA4_MULTIMODAL for a in archs
    )


def weights_prefix(hf: Mapping[str, Any]) -> str:
    """Where the decoder's tensors live: "model." or, multimodal, "model.language_model."."""
    return "model.language_model." if is_gemma4(hf) and is_multimodal(hf) else "model."


def _gemma4_refusals(hf: Mapping[str, Any]) -> None:
    """CheckpointError naming the first field our Gemma 4 decoder does not implement."""
    refuse = {
        "hidden_activation": (
            "gelu_pytorch_tanh",
            hf.get("hidden_activation", "gelu_pytorch_tanh"),
        ),
        "attention_bias": (False, bool(hf.get("attention_bias", False))),
    }
    for field, (ok, got) in refuse.items():
        if got != ok:
            raise CheckpointError(f"unsupported Gemma 4 {field}={got!r}; only {ok!r} is")
    # "vision": image tokens see each other both ways, text stays causal (all we decode)
    bidirectional = hf.get("use_bidirectional_attention")
    if bidirectional not in (None, "vision"):
        raise CheckpointError(
            f"unsupported Gemma 4 use_bidirectional_attention={bidirectional!r}; "
            "only None and 'vision' (causal text) are"
        )
    n, vocab = int(hf["num_hidden_layers"]), int(hf["vocab_size"])
    if int(hf.get("num_kv_shared_layers", 0)) >= n:
        raise CheckpointError(f"unsupported num_kv_shared_layers >= num_hidden_layers={n}")
    if hf.get("hidden_size_per_layer_input", 256):
        vp = int(hf.get("vocab_size_per_layer_input", 262_144))
        if vp != vocab:
            raise CheckpointError(
                f"unsupported vocab_size_per_layer_input={vp} != vocab_size={vocab}"
            )


def _gemma4_rope(hf: Mapping[str, Any]) -> tuple[float, tuple[float, float, float]]:
    """(sliding layers' theta, global layers' (theta, rotated fraction, divisor))."""
    rope = hf.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {
            "rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6
        },
    }  # fmt: skip
    sliding, full = rope.get("sliding_attention") or {}, rope.get("full_attention") or {}
    if sliding.get("rope_type", "default") != "default":
        raise CheckpointError(
            f"unsupported rope_parameters.sliding_attention.rope_type {sliding['rope_type']!r}; "
            "only 'default' is"
        )
    ftype = full.get("rope_type", "default")
    if ftype not in ("default", "proportional"):
        raise CheckpointError(
            f"unsupported rope_parameters.full_attention.rope_type {ftype!r}; "
            "supported: default, proportional"
        )
    fraction = float(full.get("partial_rotary_factor", 1.0)) if ftype == "proportional" else 1.0
    factor = float(full.get("factor", 1.0)) if ftype == "proportional" else 1.0
    theta = float(sliding.get("rope_theta", 10_000.0))
    return theta, (float(full.get("rope_theta", 10_000.0)), fraction, factor)


def _gemma4_global_geometry(hf, layer_types, head_dim: int, kv_heads: int) -> tuple[int, int]:
    """(head_dim, K/V heads) of the global layers: `per_layer_config` (transformers 5.25 writes
    it) or `global_head_dim` / `num_global_key_value_heads` (the released configs)."""
    per_layer = hf.get("per_layer_config")
    if per_layer is None:
        n_kv = hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v") else None
        return int(hf.get("global_head_dim", 512)), int(n_kv or kv_heads)
    found = set()
    for key, over in per_layer.items():
        i = int(key)
        extra = sorted(set(over) - _GEMMA4_OVERRIDES)
        if extra or not 0 <= i < len(layer_types) or layer_types[i] != "full_attention":
            raise CheckpointError(
                f"unsupported per_layer_config[{key!r}] {over}: only head_dim and "
                "num_key_value_heads of full_attention layers may differ per layer"
            )
        found.add(
            (int(over.get("head_dim", head_dim)), int(over.get("num_key_value_heads", kv_heads)))
        )
    n_full = sum(t == "full_attention" for t in layer_types)
    if len(found) > 1 or (found and len(per_layer) != n_full):
        raise CheckpointError(
            f"unsupported per_layer_config: full_attention layers of differing shapes {per_layer}"
        )
    return found.pop() if found else (head_dim, kv_heads)


def gemma4_config(hf: dict[str, Any], target_layer_ids, dtype: str) -> TargetConfig:
    if is_multimodal(hf):
        if not isinstance(hf.get("text_config"), Mapping):
            raise CheckpointError("multimodal Gemma 4 config.json lacks its text_config")
        tied = hf.get("tie_word_embeddings", True)  # the wrapper's head ties or not
        hf = {**hf["text_config"], "tie_word_embeddings": tied}
    if hf.get("model_type") == "gemma4_unified_text":  # no per-layer inputs: the field is left out
        hf = {"hidden_size_per_layer_input": 0, **hf}
    _gemma4_refusals(hf)
    n_layers, n_heads, hidden = (
        int(hf[k]) for k in ("num_hidden_layers", "num_attention_heads", "hidden_size")
    )
    head_dim = int(hf.get("head_dim", 256))
    kv_heads = int(hf.get("num_key_value_heads", 4))
    layer_types = tuple(hf.get("layer_types") or ())
    if len(layer_types) != n_layers:
        raise CheckpointError(f"layer_types must list all {n_layers} layers, got {layer_types}")
    theta, (g_theta, g_fraction, g_factor) = _gemma4_rope(hf)
    g_dim, g_kv = _gemma4_global_geometry(hf, layer_types, head_dim, kv_heads)
    moe = bool(hf.get("enable_moe_block", False))
    gemma = Gemma4Config(
        layer_types=layer_types,
        sliding_window=int(hf.get("sliding_window", 512)),
        global_head_dim=g_dim,
        global_kv_heads=g_kv,
        k_eq_v=bool(hf.get("attention_k_eq_v", False)),
        global_rope_theta=g_theta,
        global_rope_fraction=g_fraction,
        global_rope_factor=g_factor,
        final_logit_softcapping=hf.get("final_logit_softcapping"),
        num_kv_shared_layers=int(hf.get("num_kv_shared_layers", 0)),
        use_double_wide_mlp=bool(hf.get("use_double_wide_mlp", False)),
        hidden_size_per_layer_input=int(hf.get("hidden_size_per_layer_input", 256) or 0),
        vocab_size_per_layer_input=int(hf.get("vocab_size_per_layer_input", 262_144)),
        num_experts=int(hf["num_experts"]) if moe else 0,
        top_k_experts=int(hf["top_k_experts"]) if moe else 0,
        moe_intermediate_size=int(hf["moe_intermediate_size"]) if moe else 0,
    )
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(n_layers)
    return TargetConfig(
        architecture="gemma4",
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 131_072)),
        target_layer_ids=tuple(target_layer_ids),
        dtype=dtype,
        gemma=gemma,
    )
