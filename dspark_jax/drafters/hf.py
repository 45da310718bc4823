"""Released DeepSeek drafter checkpoints (Hugging Face safetensors) <-> our drafter params.

    cfg, params = load_hf_drafter("/ckpt/dspark_qwen3_4b_block7", target=target_cfg)
    save_hf_drafter(cfg, params, "/out/my-drafter")   # the same layout back

config.json is a copy of the target's (Gemma 4: its *text* config) with the drafter's layer count,
every layer full attention, untied, plus the DSpark / Eagle3 fields. Names are the PyTorch module
paths of the reference drafters, without a "model." prefix (docs/METHOD.md §2.1, §2.10, §3, §5.1).
Linear weights are [out, in] there and [in, out] (`kernel`) here, so they are transposed;
embeddings, the Markov table W1, norms and the layer scalar are not:

    embed_tokens.weight [V, H]                      frozen.embed_tokens
    lm_head.weight [V, H]                           frozen.lm_head            [H, V]
    fc.weight [H, m·H]                              fc.kernel
    hidden_norm.weight, norm.weight                 (DSpark/DFlash; Eagle3: layers.0.hidden_norm)
    layers.i.{input_layernorm,post_attention_layernorm}.weight
    layers.i.self_attn.{q,k,v,o}_proj.weight (+ .bias for Qwen2), .{q,k}_norm.weight (Qwen3)
    layers.i.mlp.{gate,up,down}_proj.weight
    Gemma 4 layers (HF `Gemma4TextDecoderLayer`, global geometry): also
      layers.i.{pre,post}_feedforward_layernorm.weight, layers.i.layer_scalar [1], the q/k
      norms, and no v_proj when attention_k_eq_v; norm weights as stored (y = w·x̂)
    markov_head.markov_w1.weight [V, r]             markov_head.markov_w1     [V, r]
    markov_head.markov_w2.weight [V, r]             markov_head.markov_w2.kernel [r, V]
    markov_head.gate_proj.{weight [r, H+r], bias}   (gated head)
    markov_head.joint_proj.{weight [3r, 2r+H], bias}  (RNN head)
    confidence_head.proj.weight [1, H+r], .bias [1]

Every check (config fields, tensor names, shapes, dtypes) runs on config.json and the safetensors
headers before any weight is read; a failure raises `CheckpointError` naming the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from dspark_jax.compat import check_gamma
from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.drafters.api import graphdef, init_params
from dspark_jax.drafters.common import DrafterParams
from dspark_jax.drafters.compat import TargetId, check_fits
from dspark_jax.errors import CheckpointError, ConfigError
from dspark_jax.io import atomic_path, write_text_atomic
from dspark_jax.models.hf import (
    NP_DTYPE,
    SAFETENSORS,
    check_shapes,
    config_from_hf,
    hf_config_dict,
    read_hf_config,
    tensor_headers,
    to_host,
    weight_files,
)
from dspark_jax.models.hf_config import gemma4_text_config_dict
from dspark_jax.models.hf_gemma4 import FULL, is_gemma4
from dspark_jax.sched.sts import STS

_ARCH_PREFIX = {"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama", "gemma4": "Gemma4"}
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def hf_drafter_name(path: tuple) -> tuple[str, bool]:
    """(HF tensor name, transposed?) for one of our flat drafter parameter paths."""
    parts = [str(p) for p in path]
    if parts in (["embed_tokens"], ["markov_head", "markov_w1"]):
        return ".".join(parts) + ".weight", False
    if parts == ["lm_head"]:
        return "lm_head.weight", True
    transpose = parts[-1] == "kernel"
    if transpose:
        parts[-1] = "weight"
    return ".".join(parts), transpose


def expected_drafter_tensors(cfg: DrafterConfig) -> dict[str, tuple[str, tuple, tuple, bool]]:
    """HF name -> (collection "trainable"|"frozen", our path, HF shape, transposed?)."""
    abstract = nnx.eval_shape(lambda: init_params(cfg))
    out = {}
    for coll, state in (("trainable", abstract.trainable), ("frozen", abstract.frozen)):
        for path, var in nnx.to_flat_state(state):
            name, transpose = hf_drafter_name(path)
            shape = tuple(var.get_value().shape)
            out[name] = (coll, path, shape[::-1] if transpose else shape, transpose)
    return out


# ------------------------------------------------------------------------------------------------
# config


def drafter_config_from_hf(
    hf: Mapping[str, Any], target: TargetConfig | None = None, *, dtype: str = "float32", **kw
) -> DrafterConfig:
    """The DrafterConfig of a drafter `config.json` (a copy of the target config, Gemma 4: its
    text config, with the drafter's layer count and the DSpark/Eagle3 fields).

    `target` is the target's config; without it, it is rebuilt from the drafter config using
    `num_target_layers` (Gemma 4: that many full-attention layers, the sliding ones being
    unknown; the draft layers are the same). `kw` overrides training-only fields (loss weights,
    num_anchors, ...).
    """
    hf = dict(hf)
    archs = " ".join(hf.get("architectures") or [])
    if "Eagle3" in archs or "ttt_length" in hf:
        kind = "eagle3"
    elif "DSpark" in archs or "block_size" in hf:
        rank = int(hf.get("markov_rank", 0))
        kind = "dspark" if rank or hf.get("enable_confidence_head") else "dflash"
    else:
        raise CheckpointError(
            f"config.json architectures {archs or None!r} is not a DSpark/DFlash/Eagle3 drafter "
            "(expected e.g. Qwen3DSparkModel or Qwen3Eagle3Model)"
        )
    for need in ("target_layer_ids",):
        if need not in hf:
            raise CheckpointError(f"drafter config.json lacks {need!r}")
    layer_ids = tuple(int(i) for i in hf["target_layer_ids"])
    if _is_gemma4_drafter(hf):
        target = _gemma4_drafter_target(hf, target, layer_ids, dtype)
    elif target is None:
        t = dict(hf, num_hidden_layers=_num_target_layers(hf), tie_word_embeddings=False)
        t["architectures"] = [
            a.replace("DSparkModel", "ForCausalLM").replace("Eagle3Model", "ForCausalLM")
            for a in hf.get("architectures") or []
        ]
        target = config_from_hf(t, dtype=dtype, target_layer_ids=layer_ids)
    try:
        check_fits(target, trained_for=_hf_target_id(hf, layer_ids))
        if hf.get("trained_for"):  # the target an export records (name, vocabulary hash too)
            check_fits(target, trained_for=TargetId.from_json(hf["trained_for"]))
    except ConfigError as e:
        raise CheckpointError(f"drafter config.json: {e}") from e
    fields: dict[str, Any] = dict(num_layers=int(hf["num_hidden_layers"]), dtype=dtype)
    if kind == "eagle3":
        fields.update(
            block_size=int(hf.get("ttt_length", 7)),
            step_loss_decay=float(hf.get("step_loss_decay", 0.8)),
        )
    else:
        rank = int(hf.get("markov_rank", 0))
        conf = bool(hf.get("enable_confidence_head", False))
        fields.update(
            block_size=int(hf.get("block_size", 7)),
            mask_token_id=int(hf["mask_token_id"]),
            num_anchors=int(hf.get("num_anchors", 512)),
            markov_rank=rank,
            confidence_head=conf,
            confidence_with_markov=conf and bool(hf.get("confidence_head_with_markov", False)),
        )
        if rank:
            fields["markov_head_type"] = str(hf.get("markov_head_type", "vanilla")).lower()
    fields["context_window"] = int(hf.get("context_window", 0))  # 0: the whole context
    if "block_size" in kw:  # γ within the block the checkpoint was trained with
        check_gamma(kw["block_size"], fields["block_size"], "block_size")
    fields.update(kw)
    try:
        return getattr(DrafterConfig, kind)(target, **fields)
    except ConfigError as e:
        raise CheckpointError(f"drafter config.json: {e}") from e


def _num_target_layers(hf: Mapping[str, Any]) -> int:
    if "num_target_layers" not in hf:
        raise CheckpointError(
            "drafter config.json has no num_target_layers: pass target=<the target's "
            "TargetConfig> to load_hf_drafter"
        )
    return int(hf["num_target_layers"])


def _is_gemma4_drafter(hf: Mapping[str, Any]) -> bool:
    return is_gemma4(hf) or any(a.startswith("Gemma4") for a in hf.get("architectures") or [])


# what a Gemma 4 drafter's layers copy from the target (`DrafterConfig.layer_config`)
_GEMMA4_LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_heads", "rms_norm_eps")
_GEMMA4_GLOBAL_FIELDS = (
    "global_head_dim",
    "global_kv_heads",
    "k_eq_v",
    "global_rope_theta",
    "global_rope_fraction",
    "global_rope_factor",
    "final_logit_softcapping",
)


def _gemma4_drafter_target(hf, target: TargetConfig | None, layer_ids, dtype) -> TargetConfig:
    """The target of a Gemma 4 drafter config.json (a copy of the target's text config with
    the drafter's layers): `target`, refused if the drafter's layers differ from its global
    layers; without it, one rebuilt from the copy (`num_target_layers` full-attention layers).
    What the draft layers never have (KV sharing, experts, per-layer inputs) is read as off."""
    n = int(hf.get("num_hidden_layers", 0))
    off = dict(num_kv_shared_layers=0, enable_moe_block=False, hidden_size_per_layer_input=0)
    text = dict(hf, model_type="gemma4_text", layer_types=[FULL] * n, **off)
    own = config_from_hf(text, dtype=dtype, target_layer_ids=())
    if target is None:
        nt = _num_target_layers(hf)
        g = dataclasses.replace(own.gemma, layer_types=(FULL,) * nt)
        try:
            return own.replace(num_layers=nt, target_layer_ids=layer_ids, gemma=g)
        except ConfigError as e:
            raise CheckpointError(f"drafter config.json: {e}") from e
    if target.gemma is None:
        raise CheckpointError(
            f"drafter config.json is a Gemma 4 drafter's but the target is {target.architecture}"
            "; pass the Gemma 4 target it was trained for"
        )
    diff = [
        f"{f} {getattr(a, f)} vs {getattr(b, f)}"
        for fields, a, b in (
            (_GEMMA4_LAYER_FIELDS, own, target),
            (_GEMMA4_GLOBAL_FIELDS, own.gemma, target.gemma),
        )
        for f in fields
        if getattr(a, f) != getattr(b, f)
    ]
    if diff:
        raise CheckpointError(
            f"drafter config.json: its Gemma 4 layers differ from the target's global layers "
            f"(drafter vs target: {'; '.join(diff)}); load the drafter of this target"
        )
    return target


def _hf_target_id(hf: Mapping[str, Any], layer_ids) -> TargetId:
    """The target a drafter's config.json says it was trained for (its shapes are the target's)."""

    def num(key):
        return int(hf[key]) if key in hf else None

    return TargetId(
        target_layer_ids=tuple(layer_ids),
        num_layers=num("num_target_layers"),
        hidden_size=num("hidden_size"),
        vocab_size=num("vocab_size"),
        num_heads=num("num_attention_heads"),
        num_kv_heads=num("num_key_value_heads"),
        head_dim=num("head_dim"),
        intermediate_size=num("intermediate_size"),
    )


def hf_drafter_config_dict(cfg: DrafterConfig, dtype: str | None = None) -> dict[str, Any]:
    """The drafter's `config.json` (the target config with the drafter overrides)."""
    if cfg.target.gemma is None:
        d = hf_config_dict(cfg.target, dtype or cfg.dtype)
    else:  # the text config of the drafter's layers: no KV sharing, experts, per-layer inputs
        lc, t, n = cfg.layer_config, cfg.target.gemma, cfg.num_layers
        g = dataclasses.replace(  # the copy keeps two fields the draft layers never read
            lc.gemma,
            layer_types=(FULL,) * n,
            use_double_wide_mlp=t.use_double_wide_mlp,
            vocab_size_per_layer_input=t.vocab_size_per_layer_input,
        )
        own = lc.replace(num_layers=n, target_layer_ids=(), gemma=g)
        d = gemma4_text_config_dict(own, dtype or cfg.dtype)
    d.pop("dspark_target_layer_ids", None)
    prefix = _ARCH_PREFIX[cfg.target.architecture]
    d.update(
        architectures=[prefix + ("Eagle3Model" if cfg.kind == "eagle3" else "DSparkModel")],
        num_target_layers=cfg.target.num_layers,
        num_hidden_layers=cfg.num_layers,
        tie_word_embeddings=False,
        layer_types=["full_attention"] * cfg.num_layers,
        target_layer_ids=list(cfg.target.target_layer_ids),
    )
    if cfg.kind == "eagle3":
        d.update(ttt_length=cfg.block_size, step_loss_decay=cfg.step_loss_decay)
    else:
        d.update(
            block_size=cfg.block_size,
            mask_token_id=cfg.mask_token_id,
            num_anchors=cfg.num_anchors,
            markov_rank=cfg.markov_rank,
            enable_confidence_head=cfg.confidence_head,
        )
        if cfg.markov_rank:
            d["markov_head_type"] = cfg.markov_head_type
        if cfg.confidence_head:
            d["confidence_head_with_markov"] = cfg.confidence_with_markov
    if cfg.context_window:  # an extra key; absent = the whole context (released layout)
        d["context_window"] = cfg.context_window
    return d


# ------------------------------------------------------------------------------------------------
# tensors


def _strip_prefix(headers: dict) -> tuple[dict, str]:
    """Accept checkpoints saved from a wrapper module ("model." on every name)."""
    names = list(headers)
    if names and all(n.startswith("model.") for n in names):
        return {n[len("model.") :]: v for n, v in headers.items()}, "model."
    return headers, ""


def check_drafter_tensors(cfg: DrafterConfig, headers: Mapping, path: str = "<checkpoint>"):
    """CheckpointError unless `headers` (HF name -> (shape, dtype)) hold exactly the tensors
    `cfg` needs, with the right shapes and float dtypes."""
    expected = expected_drafter_tensors(cfg)
    present = {n for n in headers if not n.endswith(_IGNORED_SUFFIXES)}
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected))
    what = f"a {cfg.kind} drafter (r={cfg.markov_rank}, {cfg.num_layers} layers)"
    if missing:
        raise CheckpointError(
            f"missing tensors in {path!r}: {len(missing)} of {len(expected)} expected for {what} "
            f"are absent, e.g. {missing[:6]}; is config.json for this checkpoint?"
        )
    if unexpected:
        raise CheckpointError(
            f"unexpected tensors in {path!r} that {what} does not have: {len(unexpected)}, e.g. "
            f"{unexpected[:6]}; check markov_rank / markov_head_type / enable_confidence_head / "
            "num_hidden_layers in config.json"
        )
    check_shapes({n: shape for n, (_, _, shape, _) in expected.items()}, headers, "the config")
    return expected


def load_hf_drafter(
    path: str | os.PathLike,
    target: TargetConfig | None = None,
    cfg: DrafterConfig | None = None,
    *,
    dtype: str = "float32",
    **overrides,
) -> tuple[DrafterConfig, DrafterParams]:
    """Load a drafter checkpoint directory (config.json + model.safetensors or shards).

    `cfg` given: its shapes are checked against the tensors (config.json is not needed).
    Otherwise the config comes from config.json and `target` (see `drafter_config_from_hf`);
    `overrides` set training-only fields. Returns (cfg, DrafterParams) with the frozen
    embedding / head from the checkpoint.
    """
    path = os.fspath(path)
    if dtype not in NP_DTYPE:
        raise CheckpointError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if cfg is None:
        cfg = drafter_config_from_hf(read_hf_config(path), target, dtype=dtype, **overrides)
    elif target is not None and target != cfg.target:
        raise CheckpointError("cfg.target differs from the target passed; pass one of them")
    files = weight_files(path)
    headers, prefix = _strip_prefix(tensor_headers(files))
    expected = check_drafter_tensors(cfg, headers, path)
    np_dtype = NP_DTYPE[cfg.dtype]
    flat: dict[str, list] = {"trainable": [], "frozen": []}
    abstract = nnx.eval_shape(lambda: init_params(cfg))
    absvars = {
        coll: dict(nnx.to_flat_state(getattr(abstract, coll))) for coll in ("trainable", "frozen")
    }
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, "numpy")) for f in set(files.values())}
        for name, (coll, p, _, transpose) in expected.items():
            a = np.asarray(handles[files[prefix + name]].get_tensor(prefix + name))
            a = np.ascontiguousarray(a.T if transpose else a).astype(np_dtype)
            flat[coll].append((p, absvars[coll][p].replace(jnp.asarray(a))))
    params = DrafterParams(
        nnx.from_flat_state(flat["trainable"]), nnx.from_flat_state(flat["frozen"])
    )
    graphdef(cfg)  # the structure must merge; raises early if it does not
    return cfg, params


def load_hf_drafter_extras(path: str | os.PathLike):
    """`(STS | None, TargetId | None)`: the calibration temperatures and the target a drafter
    checkpoint's config.json records (`save_hf_drafter(..., sts=, trained_for=)`); None for
    what it does not record (e.g. a released checkpoint)."""
    hf = read_hf_config(os.fspath(path))
    sts = trained_for = None
    if hf.get("confidence_temperatures"):
        try:
            sts = STS.from_dict(hf)
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{path}/config.json: confidence_temperatures: {e}") from None
    if hf.get("trained_for"):
        trained_for = TargetId.from_json(hf["trained_for"])
    return sts, trained_for


def save_hf_drafter(
    cfg: DrafterConfig,
    params: DrafterParams,
    out_dir: str | os.PathLike,
    *,
    dtype=None,
    sts=None,
    trained_for: TargetId | Mapping[str, Any] | None = None,
) -> str:
    """Write config.json + model.safetensors in the released layout (frozen tensors included,
    as the reference's `save_pretrained`). Atomic per file; process 0 writes. Returns out_dir.

    `sts` (an `STS`) adds its `confidence_temperatures` to config.json and `trained_for` (a
    `TargetId` or its JSON) the target the drafter was trained for (name, layer ids, vocabulary
    hash, shapes); both are extra keys, the released layout's keys are unchanged."""
    out_dir = os.fspath(out_dir)
    dtype = dtype or cfg.dtype
    if dtype not in NP_DTYPE:
        raise CheckpointError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    tensors = {}
    for state in params:
        for p, var in nnx.to_flat_state(state):
            name, transpose = hf_drafter_name(p)
            a = to_host(var.get_value())
            tensors[name] = np.ascontiguousarray(a.T if transpose else a).astype(NP_DTYPE[dtype])
    check_drafter_tensors(cfg, {n: (t.shape, "F32") for n, t in tensors.items()}, "<params>")
    if jax.process_index() != 0:
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    with atomic_path(os.path.join(out_dir, SAFETENSORS)) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})
    d = hf_drafter_config_dict(cfg, dtype)
    if sts is not None:
        d.update(sts.to_dict())
    if trained_for is not None:
        tid = trained_for if isinstance(trained_for, TargetId) else TargetId.from_json(trained_for)
        d["trained_for"] = tid.to_json()
    text = json.dumps(d, indent=2) + "\n"
    write_text_atomic(os.path.join(out_dir, "config.json"), text)
    return out_dir


__all__ = [
    "CheckpointError",
    "check_drafter_tensors",
    "drafter_config_from_hf",
    "expected_drafter_tensors",
    "hf_drafter_config_dict",
    "hf_drafter_name",
    "load_hf_drafter",
    "load_hf_drafter_extras",
    "save_hf_drafter",
]
