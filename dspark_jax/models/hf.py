"""Hugging Face checkpoints: load Qwen3 / Qwen2 / Llama safetensors into our params, save ours back.

One file (~520 lines) on purpose: the config translation, the name map, the header checks and
the load / save paths are one contract with the released format and change together.

    cfg, params = load_target("/ckpt/Qwen3-4B", dtype="bfloat16", mesh=mesh)
    tok = load_tokenizer("/ckpt/Qwen3-4B", cfg)
    save_target_hf(cfg, params, "/out/my-target")  # transformers can load it too

Name mapping (HF stores Linear weights [out, in]; our kernels are [in, out], so kernels are
transposed on the way in and out; embeddings and norms are not):

    model.embed_tokens.weight                         embed_tokens              [V, H]
    model.layers.N.self_attn.{q,k,v,o}_proj.weight    layers.N.self_attn.*.kernel
    model.layers.N.self_attn.{q,k,v}_proj.bias        layers.N.self_attn.*.bias   (qwen2)
    model.layers.N.self_attn.{q,k}_norm.weight        layers.N.self_attn.*.weight (qwen3)
    model.layers.N.mlp.{gate,up,down}_proj.weight     layers.N.mlp.*.kernel
    model.layers.N.{input,post_attention}_layernorm.weight
    model.norm.weight                                 norm.weight
    lm_head.weight                                    lm_head.kernel   (absent when tied)

Every check (files, architecture, tensor names, shapes, dtypes) runs on the config and the
safetensors headers before a single weight is read; a failure raises `CheckpointError` naming
the problem and the fix. torch is never imported; transformers only for the tokenizer.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from dspark_jax.config import RopeScaling, TargetConfig, default_target_layer_ids
from dspark_jax.errors import CheckpointError, ConfigError
from dspark_jax.io import atomic_path, write_text_atomic
from dspark_jax.models.transformer import Transformer

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Buffers some older checkpoints carry; recomputed by us, never loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
NP_DTYPE = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
_HF_CLASS = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
_HF_ARCH = {v: k for k, v in _HF_CLASS.items()}
_LAYER_IDS_KEY = "dspark_target_layer_ids"


# ------------------------------------------------------------------------------------------------
# names and expected shapes


def hf_name(path: tuple) -> tuple[str, bool]:
    """(Hugging Face tensor name, transposed?) for one of our flat parameter paths."""
    parts = [str(p) for p in path]
    if parts == ["embed_tokens"]:
        return "model.embed_tokens.weight", False
    transpose = parts[-1] == "kernel"
    if transpose:
        parts[-1] = "weight"
    if parts[0] == "lm_head":
        return "lm_head.weight", transpose
    return "model." + ".".join(parts), transpose


def _abstract_state(cfg: TargetConfig) -> nnx.State:
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[1]


def expected_tensors(cfg: TargetConfig) -> dict[str, tuple[tuple, tuple[int, ...], bool]]:
    """HF name -> (our path, HF shape, transposed?) for every tensor `cfg` needs."""
    out = {}
    for path, var in nnx.to_flat_state(_abstract_state(cfg)):
        name, transpose = hf_name(path)
        shape = tuple(var.get_value().shape)
        out[name] = (path, shape[::-1] if transpose else shape, transpose)
    return out


# ------------------------------------------------------------------------------------------------
# reading: config, files, headers


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
        raise CheckpointError("sliding-window attention layers are not supported")
    if target_layer_ids is None and hf.get(_LAYER_IDS_KEY) is not None:
        target_layer_ids = tuple(hf[_LAYER_IDS_KEY])
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


def weight_files(path: str) -> dict[str, str]:
    """HF tensor name -> file path, from model.safetensors or the sharded index."""
    single = os.path.join(path, SAFETENSORS)
    index = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(single):
        with safe_open(single, "numpy") as f:
            return {k: single for k in f.keys()}
    if not os.path.isfile(index):
        present = sorted(os.listdir(path))
        hint = (
            " (found PyTorch .bin weights: re-save with save_pretrained(safe_serialization=True))"
            if any(p.endswith(".bin") for p in present)
            else ""
        )
        raise CheckpointError(
            f"missing files: neither {SAFETENSORS} nor {SAFETENSORS_INDEX} in {path!r}{hint}"
        )
    with open(index) as fh:
        try:
            weight_map = json.load(fh)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a safetensors index (no weight_map)") from e
    missing = sorted({f for f in weight_map.values() if not os.path.isfile(os.path.join(path, f))})
    if missing:
        raise CheckpointError(
            f"missing files: shard(s) {missing} listed in {SAFETENSORS_INDEX} are not in {path!r}"
        )
    files = {}
    for shard in sorted(set(weight_map.values())):
        full = os.path.join(path, shard)
        with safe_open(full, "numpy") as f:
            keys = set(f.keys())
        absent = sorted(k for k, s in weight_map.items() if s == shard and k not in keys)
        if absent:
            raise CheckpointError(
                f"{SAFETENSORS_INDEX} places {absent[:5]} in {shard}, which does not hold them"
            )
        files.update({k: full for k in keys})
    return files


def tensor_headers(files: Mapping[str, str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF tensor name -> (shape, safetensors dtype) read from the headers only."""
    by_file: dict[str, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    out = {}
    for f, names in by_file.items():
        with safe_open(f, "numpy") as fh:
            for n in names:
                s = fh.get_slice(n)
                out[n] = (tuple(s.get_shape()), s.get_dtype())
    return out


def _check_tensors(cfg: TargetConfig, headers, path: str) -> dict:
    expected = expected_tensors(cfg)
    present = {n for n in headers if not n.endswith(_IGNORED_SUFFIXES)}
    if cfg.tie_word_embeddings:
        present.discard("lm_head.weight")  # tied: HF ignores a stored head too
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected))
    if missing:
        hint = ""
        if missing == ["lm_head.weight"]:
            hint = "; config.json says tie_word_embeddings=false but the checkpoint has no head"
        raise CheckpointError(
            f"missing tensors in {path!r}: {len(missing)} of {len(expected)} expected for a "
            f"{cfg.architecture} model are absent, e.g. {missing[:5]}{hint}"
        )
    if unexpected:
        raise CheckpointError(
            f"unexpected tensors in {path!r} that a {cfg.architecture} model does not have: "
            f"{len(unexpected)}, e.g. {unexpected[:5]}; is config.json for this checkpoint?"
        )
    for name, (_, shape, _) in expected.items():
        got, dt = headers[name]
        if got != shape:
            raise CheckpointError(
                f"shape mismatch for {name}: config.json implies {shape}, checkpoint has {got}"
            )
        if dt not in FLOAT_DTYPES:
            raise CheckpointError(f"{name} has dtype {dt}; only float tensors can be loaded")
    return expected


def check_checkpoint(
    path: str | os.PathLike,
    *,
    dtype: str = "float32",
    target_layer_ids: tuple[int, ...] | None = None,
) -> TargetConfig:
    """Validate a checkpoint directory without reading weights; returns its TargetConfig."""
    path = os.fspath(path)
    cfg = config_from_hf(read_hf_config(path), dtype=dtype, target_layer_ids=target_layer_ids)
    _check_tensors(cfg, tensor_headers(weight_files(path)), path)
    return cfg


# ------------------------------------------------------------------------------------------------
# loading


def load_target(
    path: str | os.PathLike,
    *,
    dtype: str = "float32",
    mesh: jax.sharding.Mesh | None = None,
    target_layer_ids: tuple[int, ...] | None = None,
) -> tuple[TargetConfig, nnx.State]:
    """Load a Hugging Face Qwen3 / Qwen2 / Llama checkpoint as (cfg, params).

    Reads `config.json` and `model.safetensors` or the shards named by
    `model.safetensors.index.json`. Weights are cast to `dtype` ("float32" or "bfloat16"),
    which also becomes `cfg.dtype`. With a `mesh`, every parameter is created directly with the
    sharding of `parallel.param_shardings` (each device reads only its slice from the file);
    without one, it lands on the default device. `target_layer_ids` default to the ids saved by
    `save_target_hf`, else to `config.default_target_layer_ids`.

    Raises CheckpointError before reading any weight if the directory, the architecture, the
    tensor names, shapes or dtypes do not fit.
    """
    path = os.fspath(path)
    if dtype not in NP_DTYPE:
        raise CheckpointError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    cfg = config_from_hf(read_hf_config(path), dtype=dtype, target_layer_ids=target_layer_ids)
    files = weight_files(path)
    expected = _check_tensors(cfg, tensor_headers(files), path)
    abstract = _abstract_state(cfg)
    np_dtype = NP_DTYPE[dtype]
    shardings = None
    if mesh is not None:
        from dspark_jax.parallel import param_shardings

        shardings = dict(nnx.to_flat_state(param_shardings(abstract, mesh)))

    by_path = {p: (name, t) for name, (p, _, t) in expected.items()}
    loaded = []
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, "numpy")) for f in set(files.values())}
        for p, var in nnx.to_flat_state(abstract):
            name, transpose = by_path[p]
            sl = handles[files[name]].get_slice(name)
            shape = tuple(var.get_value().shape)

            def read(index, sl=sl, transpose=transpose, shape=shape):
                index = _normalize_index(index, len(shape))
                block = sl[index[::-1]] if transpose else sl[index]
                block = np.asarray(block)
                return np.ascontiguousarray(block.T if transpose else block).astype(np_dtype)

            if shardings is None:
                arr = jnp.asarray(read(tuple(slice(None) for _ in shape)))
            else:
                arr = jax.make_array_from_callback(shape, shardings[p].get_value(), read)
            loaded.append((p, var.replace(arr)))
    return cfg, nnx.from_flat_state(loaded)


def _normalize_index(index, ndim: int) -> tuple[slice, ...]:
    index = tuple(index) + (slice(None),) * (ndim - len(tuple(index)))
    return tuple(slice(s.start, s.stop) if isinstance(s, slice) else s for s in index)


# ------------------------------------------------------------------------------------------------
# tokenizer


def quiet_transformers():
    """`import transformers` without its advisory "PyTorch was not found" line: we only use its
    tokenizers, never its models. Only that import is quieted; later warnings are untouched."""
    import sys

    if "transformers" not in sys.modules:
        old = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
        os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
        try:
            import transformers  # noqa: F401
        finally:
            if old is None:
                del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]
            else:
                os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = old
    return sys.modules["transformers"]


def load_tokenizer(
    path: str | os.PathLike,
    cfg: TargetConfig | None = None,
    *,
    require_chat_template: bool = False,
):
    """`transformers.AutoTokenizer` from a directory, offline (no hub access): the one tokenizer
    loader, for HF checkpoints and run directories (train/tokenizer.py's output) alike.

    With `cfg`, checks that every token id the tokenizer can emit (`len(tokenizer)`, including
    added special tokens) indexes a row of the model's embedding; a larger tokenizer raises
    CheckpointError (a smaller one is normal: models pad their vocabulary). With
    `require_chat_template`, a tokenizer without a chat template raises CheckpointError.
    """
    path = os.fspath(path)
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not os.path.isdir(path) or not any(os.path.isfile(os.path.join(path, n)) for n in names):
        raise CheckpointError(
            f"missing files: no tokenizer in {path!r} (expected one of {list(names)}); train one "
            "with train.py --stages tokenizer (dspark_jax.train.tokenizer.train_tokenizer), point "
            "to a Hugging Face model directory, or save one with tokenizer.save_pretrained(path)"
        )
    try:
        tok = quiet_transformers().AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types; report them as one
        raise CheckpointError(f"could not load the tokenizer in {path!r}: {e}") from e
    if require_chat_template and getattr(tok, "chat_template", None) is None:
        raise CheckpointError(
            f"the tokenizer in {path!r} has no chat template; add one to tokenizer_config.json "
            "(chat_template) or chat_template.jinja"
        )
    if cfg is not None:
        check_tokenizer_fits(tok, cfg)
    return tok


def check_tokenizer_fits(tokenizer, cfg: TargetConfig) -> None:
    """CheckpointError if the tokenizer can emit ids >= the model's embedding rows."""
    n = len(tokenizer)
    if n > cfg.vocab_size:
        raise CheckpointError(
            f"tokenizer vocabulary ({n} tokens incl. added ones) is larger than the model's "
            f"embedding rows (vocab_size={cfg.vocab_size}); ids >= {cfg.vocab_size} would index "
            "past the embedding: use the tokenizer that belongs to this checkpoint"
        )


# ------------------------------------------------------------------------------------------------
# saving


def hf_config_dict(cfg: TargetConfig, dtype: str | None = None) -> dict[str, Any]:
    """The Hugging Face `config.json` for `cfg` (transformers 5 layout, `rope_parameters`)."""
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
    d: dict[str, Any] = {
        "architectures": [_HF_CLASS[cfg.architecture]],
        "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.qkv_bias,
        "attention_dropout": 0.0,
        "dtype": dtype or cfg.dtype,
        _LAYER_IDS_KEY: list(cfg.target_layer_ids),
    }
    if cfg.architecture == "llama":
        d["mlp_bias"] = False
    else:
        d["use_sliding_window"] = False
    return d


def to_host(x) -> np.ndarray:
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def save_target_hf(
    cfg: TargetConfig,
    params: nnx.State,
    out_dir: str | os.PathLike,
    *,
    dtype: str | None = None,
    tokenizer=None,
) -> str:
    """Write `cfg` and `params` as a Hugging Face checkpoint: config.json + model.safetensors.

    The result loads with `load_target` and with transformers' `AutoModelForCausalLM`. Tensors
    are stored in `dtype` (default `cfg.dtype`); a tied model stores no `lm_head.weight`. Files
    are written to temporaries and renamed, so an interrupted save leaves no half-written file.
    In a multi-process run every process must call this; only process 0 writes. Returns out_dir.
    """
    out_dir = os.fspath(out_dir)
    dtype = dtype or cfg.dtype
    if dtype not in NP_DTYPE:
        raise CheckpointError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    expected = {p: name for name, (p, _, _) in expected_tensors(cfg).items()}
    flat = dict(nnx.to_flat_state(params))
    missing = sorted(expected[p] for p in set(expected) - set(flat))
    unexpected = sorted(str(p) for p in set(flat) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"params do not match cfg: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    tensors = {}
    for p, var in flat.items():
        name, transpose = hf_name(p)
        a = to_host(var.get_value())
        tensors[name] = np.ascontiguousarray(a.T if transpose else a).astype(NP_DTYPE[dtype])
    if jax.process_index() != 0:
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    with atomic_path(os.path.join(out_dir, SAFETENSORS)) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})
    text = json.dumps(hf_config_dict(cfg, dtype), indent=2) + "\n"
    write_text_atomic(os.path.join(out_dir, "config.json"), text)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir
