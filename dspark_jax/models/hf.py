"""Hugging Face checkpoints: load Qwen3 / Qwen2 / Llama / Gemma 4 (text) safetensors into our params,
save ours back (not yet Gemma 4).

The weights live here; the `config.json` translation is `models.hf_config` and the tokenizer
`models.hf_tokenizer` (both re-exported, so `from dspark_jax.models.hf import load_tokenizer` works).

    cfg, params = load_target("/ckpt/Qwen3-4B", dtype="bfloat16", mesh=mesh)
    tok = load_tokenizer("/ckpt/Qwen3-4B", cfg)
    save_target_hf(cfg, params, "/out/my-target")  # transformers can load it too

Name mapping (HF stores Linear weights [out, in]; our kernels are [in, out], so kernels are
transposed on the way in and out; embeddings, norms and other parameters are not; Gemma 4's
modules carry transformers' attribute names, so its tensors map by path the same way):

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

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

from dspark_jax.config import TargetConfig
from dspark_jax.errors import CheckpointError
from dspark_jax.io import atomic_path, write_text_atomic
from dspark_jax.models.hf_config import (  # noqa: F401 (callers import them from here too)
    config_from_hf,
    hf_config_dict,
    read_hf_config,
)
from dspark_jax.models.hf_gemma4 import weights_prefix
from dspark_jax.models.hf_tokenizer import (  # noqa: F401 (callers import them from here too)
    check_tokenizer_fits,
    load_tokenizer,
    quiet_transformers,
)
from dspark_jax.models.transformer import model_class
from dspark_jax.parallel import param_shardings

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Buffers some older checkpoints carry; recomputed by us, never loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
NP_DTYPE = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


# ------------------------------------------------------------------------------------------------
# names and expected shapes


def hf_name(path: tuple, prefix: str = "model.") -> tuple[str, bool]:
    """(Hugging Face tensor name, transposed?) for one of our flat parameter paths; `prefix`
    is where the decoder's tensors live (`hf_gemma4.weights_prefix`)."""
    parts = [str(p) for p in path]
    if parts == ["embed_tokens"]:
        return prefix + "embed_tokens.weight", False
    transpose = parts[-1] == "kernel"
    if transpose:
        parts[-1] = "weight"
    if parts[0] == "lm_head":
        return "lm_head.weight", transpose
    return prefix + ".".join(parts), transpose


def _abstract_state(cfg: TargetConfig) -> nnx.State:
    return nnx.split(nnx.eval_shape(lambda: model_class(cfg)(cfg, rngs=nnx.Rngs(0))))[1]


def expected_tensors(
    cfg: TargetConfig, prefix: str = "model."
) -> dict[str, tuple[tuple, tuple[int, ...], bool]]:
    """HF name -> (our path, HF shape, transposed?) for every tensor `cfg` needs."""
    out = {}
    for path, var in nnx.to_flat_state(_abstract_state(cfg)):
        name, transpose = hf_name(path, prefix)
        shape = tuple(var.get_value().shape)
        out[name] = (path, shape[::-1] if transpose else shape, transpose)
    return out


# ------------------------------------------------------------------------------------------------
# reading: config, files, headers


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


def ignored_tensors(cfg: TargetConfig, names, prefix: str = "model.") -> set[str]:
    """Those of `names` a checkpoint may carry that the model never reads (transformers skips
    them too): the K/V projections and norms of Gemma 4's KV-shared layers; in a multimodal
    checkpoint, everything outside the text decoder but its LM head."""
    if cfg.gemma is None:
        return set()
    first = cfg.num_layers - cfg.gemma.num_kv_shared_layers
    parts = ("k_proj.weight", "v_proj.weight", "k_norm.weight", "v_norm.weight")
    kv = {f"{prefix}layers.{i}.self_attn.{p}" for i in range(first, cfg.num_layers) for p in parts}
    other = set() if prefix == "model." else {n for n in names if not n.startswith(prefix)}
    return kv | (other - {"lm_head.weight"})


def _check_tensors(cfg: TargetConfig, headers, path: str, prefix: str = "model.") -> dict:
    expected = expected_tensors(cfg, prefix)
    present = {n for n in headers if not n.endswith(_IGNORED_SUFFIXES)}
    present -= ignored_tensors(cfg, present, prefix)
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
    check_shapes({n: shape for n, (_, shape, _) in expected.items()}, headers, "config.json")
    return expected


def check_shapes(shapes: Mapping[str, tuple], headers: Mapping, source: str) -> None:
    """CheckpointError unless each tensor of `shapes` has that shape and a float dtype in
    `headers` (name -> (shape, dtype)); `source` names what implies the shapes."""
    for name, shape in shapes.items():
        got, dt = headers[name]
        if tuple(got) != tuple(shape):
            raise CheckpointError(
                f"shape mismatch for {name}: {source} implies {shape}, checkpoint has {tuple(got)}"
            )
        if dt not in FLOAT_DTYPES:
            raise CheckpointError(f"{name} has dtype {dt}; only float tensors can be loaded")


def check_checkpoint(
    path: str | os.PathLike,
    *,
    dtype: str = "float32",
    target_layer_ids: tuple[int, ...] | None = None,
) -> TargetConfig:
    """Validate a checkpoint directory without reading weights; returns its TargetConfig."""
    path = os.fspath(path)
    hf = read_hf_config(path)
    cfg = config_from_hf(hf, dtype=dtype, target_layer_ids=target_layer_ids)
    _check_tensors(cfg, tensor_headers(weight_files(path)), path, weights_prefix(hf))
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
    """Load a Hugging Face Qwen3 / Qwen2 / Llama / Gemma 4 checkpoint as (cfg, params) (of a
    multimodal Gemma 4 checkpoint, its text decoder).

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
    hf = read_hf_config(path)
    cfg = config_from_hf(hf, dtype=dtype, target_layer_ids=target_layer_ids)
    files = weight_files(path)
    expected = _check_tensors(cfg, tensor_headers(files), path, weights_prefix(hf))
    abstract = _abstract_state(cfg)
    np_dtype = NP_DTYPE[dtype]
    shardings = None
    if mesh is not None:
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
# saving


def to_host(x) -> np.ndarray:
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))

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
    text = json.dumps(hf_config_dict(cfg, dtype), indent=2) + "\n"  # refuses before any write
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
    write_text_atomic(os.path.join(out_dir, "config.json"), text)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir
