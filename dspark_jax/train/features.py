"""Target features for training drafters (docs/METHOD.md §1.4): online (default) or from a cache.

The drafter needs two tensors per token: `target_features` [L, m*H], the raw outputs of the
configured `target_layer_ids` concatenated in order, and `target_hidden` [L, H], the final-normed
last hidden state. Target logits are never materialised here: the loss recomputes them from
`target_hidden` through the drafter's frozen LM head, only where it needs them.

* Online: `target_features(...)` runs the frozen target (no KV cache, no logits) inside the
  caller's jitted train step, so nothing is stored (the reference cache is ~38 TB for Qwen3-4B).
* Offline: `write_feature_cache` runs the target once over a dataset and writes chunked `.npy`
  files (bf16 by default, fp32 with `dtype="float32"`) plus `index.json`; `FeatureCacheReader`
  serves them as a loader source. Every chunk is written into a temporary directory and renamed
  into place, then the index is replaced atomically, so an interrupted writer leaves only complete
  chunks; running it again skips them and finishes the rest.

Cache layout::

    index.json                   version, dtype, sizes, target config, data fingerprint, chunks
    chunk_000000/input_ids.npy   [T] int32   (T = tokens of the chunk's samples, concatenated)
                 loss_mask.npy   [T] uint8
                 offsets.npy     [n + 1] int64  sample i is rows offsets[i]:offsets[i+1]
                 features.npy    [T, m*H]  bf16 stored as its uint16 bit pattern, or float32
                 hidden.npy      [T, H]

Multi-process runs: process k of n computes only the chunks c with c % n == k and records them
in its own `index.p0000k.json` (no two processes write one file); the reader merges `index.json`
and every `index.p*.json` (same fingerprint). Each process must then hold the target on its own
devices (e.g. `parallel.make_mesh(devices=jax.local_devices())`), since the processes run
different batches.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from dspark_jax.config import TargetConfig
from dspark_jax.errors import ConfigError, FeatureCacheError
from dspark_jax.io import atomic_dir, atomic_write
from dspark_jax.models import transformer
from dspark_jax.train.data import TokenizedSample
from dspark_jax.train.data_packing import DEFAULT_BUCKETS, pad_to_bucket

log = logging.getLogger(__name__)

CACHE_VERSION = 1
_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def target_features(
    target_cfg: TargetConfig, target_params, input_ids_BxL: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(features [B, L, m*H], hidden [B, L, H]) of the frozen target; traceable, no gradient.

    Static: `target_cfg` and the shapes. Arrays: `target_params`, `input_ids_BxL`. Sequences are
    right-padded: positions are 0..L-1 and attention is causal, so padding never changes a real
    token's outputs. No KV cache and no logits are computed.
    """
    chex.assert_rank(input_ids_BxL, 2)
    chex.assert_type(input_ids_BxL, int)
    b, length = input_ids_BxL.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    out, _ = transformer.forward(
        target_cfg, target_params, input_ids_BxL, positions, None, compute_logits=False
    )
    chex.assert_shape(out.features, (b, length, target_cfg.feature_size))
    chex.assert_shape(out.hidden, (b, length, target_cfg.hidden_size))
    return jax.lax.stop_gradient(out.features), jax.lax.stop_gradient(out.hidden)


# `target_features` jitted (static: the config); the feature writer's and `train.batches`'
target_features_jit = jax.jit(target_features, static_argnums=0)


# ------------------------------------------------------------------------------------------------
# Offline cache


def _fingerprint(samples: Sequence[TokenizedSample], target_cfg: TargetConfig, dtype: str) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(target_cfg.to_json(), sort_keys=True).encode())
    h.update(dtype.encode())
    for s in samples:
        ids = np.asarray(s.input_ids, np.int32)
        h.update(np.int64(len(ids)).tobytes())
        h.update(ids.tobytes())
        h.update(np.asarray(s.loss_mask, np.uint8).tobytes())
    return h.hexdigest()


def _save_npy(path: Path, arr: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, arr)
        f.flush()
        os.fsync(f.fileno())


def _chunk_name(c: int) -> str:
    return f"chunk_{c:06d}"


def _index_files(out: Path) -> list[Path]:
    """index.json (single-process writer) and index.p*.json (one per process), if present."""
    return [p for p in [out / "index.json", *sorted(out.glob("index.p*.json"))] if p.is_file()]


def _merged_index(out: Path) -> dict | None:
    """Every index file of `out` merged (chunks united); None when there is none. Files written
    for other data or settings raise `FeatureCacheError`."""
    merged = None
    for f in _index_files(out):
        try:
            index = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise FeatureCacheError(f"{f} is corrupt ({e}); rebuild the cache") from e
        if merged is None:
            merged = index
            continue
        keys = ("fingerprint", "chunk_size", "version", "dtype")
        if any(index.get(k) != merged.get(k) for k in keys):
            raise FeatureCacheError(
                f"{f} belongs to another feature cache than {_index_files(out)[0]}; use a new "
                "directory or delete this one"
            )
        merged["chunks"] = {**merged["chunks"], **index["chunks"]}
    return merged


def write_feature_cache(
    out_dir: str | os.PathLike,
    target_cfg: TargetConfig,
    target_params,
    samples: Sequence[TokenizedSample],
    *,
    chunk_size: int = 256,
    batch_size: int = 8,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    dtype: str = "bfloat16",
    progress: bool = False,
    max_chunks: int | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
) -> FeatureCacheReader:
    """Compute and store the target features of `samples` under `out_dir`; returns a reader.

    Resumable: an existing cache with the same fingerprint (samples, target config, dtype,
    chunk size) keeps its completed chunks and only the missing ones are computed. A cache
    built for other data or another target raises `FeatureCacheError` instead of being mixed.
    `max_chunks` stops after writing that many new chunks (for tests of interruption).
    The forward is jitted with one compilation per bucket. In a multi-process run (default:
    `jax.process_index()` of `jax.process_count()`) this process writes only its own chunks
    (c % count == index) and its own `index.p<index>.json`; the returned reader sees every
    process's chunks written so far.
    """
    pi = jax.process_index() if process_index is None else process_index
    pn = jax.process_count() if process_count is None else process_count
    _check_request(samples, pi, pn, dtype, chunk_size, batch_size, buckets)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_chunks = -(-len(samples) // chunk_size)
    index_path = out / ("index.json" if pn == 1 else f"index.p{pi:05d}.json")
    index = _open_index(out, samples, target_cfg, dtype, chunk_size, n_chunks)
    mine = [c for c in range(n_chunks) if c % pn == pi]
    _remove_leftovers(out, {_chunk_name(c) for c in mine}, index)
    todo = [c for c in mine if _chunk_name(c) not in index["chunks"]]
    if max_chunks is not None:
        todo = todo[:max_chunks]
    bar = tqdm(total=len(todo), desc="feature cache", unit="chunk") if progress and todo else None
    for c in todo:
        lo, hi = c * chunk_size, min((c + 1) * chunk_size, len(samples))
        feats, hids = _chunk_features(target_cfg, target_params, samples[lo:hi], batch_size,
                                      buckets, _DTYPES[dtype])  # fmt: skip
        name = _chunk_name(c)
        n_tokens = _write_chunk(out / name, samples[lo:hi], feats, hids, dtype)
        index["chunks"][name] = {"start": lo, "count": hi - lo, "num_tokens": n_tokens}
        with atomic_write(index_path) as fh:
            json.dump(index, fh, indent=1)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if not index_path.exists():  # max_chunks=0 on a fresh cache
        with atomic_write(index_path) as fh:
            json.dump(index, fh, indent=1)
    return FeatureCacheReader(out, allow_incomplete=max_chunks is not None or pn > 1)


def _check_request(samples, pi: int, pn: int, dtype: str, chunk_size: int, batch_size: int,
                   buckets: Sequence[int]) -> None:  # fmt: skip
    """`write_feature_cache`'s arguments, checked before any work."""
    if not 0 <= pi < pn:
        raise ConfigError(f"process_index {pi} must be in 0 .. {pn - 1}")
    if dtype not in _DTYPES:
        raise ConfigError(f"feature cache dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if not samples:
        raise FeatureCacheError("no samples to cache: the dataset is empty")
    if chunk_size < 1 or batch_size < 1:
        raise ConfigError("chunk_size and batch_size must be >= 1")
    too_long = [i for i, s in enumerate(samples) if len(s) > max(buckets)]
    if too_long:
        raise FeatureCacheError(
            f"sample {too_long[0]} (length {len(samples[too_long[0]])}) exceeds the largest bucket "
            f"{max(buckets)}; add a larger bucket"
        )


def _open_index(out: Path, samples, target_cfg: TargetConfig, dtype: str, chunk_size: int,
                n_chunks: int) -> dict:  # fmt: skip
    """The index of the cache already in `out` (every process's chunks), or a new one;
    FeatureCacheError when `out` holds a cache of other data, target or settings."""
    fp = _fingerprint(samples, target_cfg, dtype)
    index = _merged_index(out)
    if index is None:
        return {
            "version": CACHE_VERSION,
            "dtype": dtype,
            "num_samples": len(samples),
            "chunk_size": chunk_size,
            "num_chunks": n_chunks,
            "feature_size": target_cfg.feature_size,
            "hidden_size": target_cfg.hidden_size,
            "target": target_cfg.to_json(),
            "fingerprint": fp,
            "chunks": {},
        }
    same = (
        index.get("fingerprint") == fp
        and index.get("chunk_size") == chunk_size
        and index.get("version") == CACHE_VERSION
    )
    if not same:
        raise FeatureCacheError(
            f"{out} holds a feature cache for other data, target or settings; use a new "
            "directory or delete this one"
        )
    return index


def _remove_leftovers(out: Path, mine: set[str], index: dict) -> None:
    """Leftovers of an interrupted writer: temporary dirs, and chunk dirs renamed into place
    whose index update never happened. Neither is trusted. Only this process's chunks (`mine`):
    another process may be writing its own right now."""
    for p in out.iterdir():
        if (
            p.is_dir()
            and p.name.split(".")[0] in mine
            and (".tmp" in p.name or p.name not in index["chunks"])
        ):
            shutil.rmtree(p)


def _chunk_features(target_cfg, target_params, chunk, batch_size: int, buckets, np_dtype):
    """The target's features [L, m*H] and last hidden states [L, H] of each sample of `chunk`,
    computed in padded batches (one compilation per bucket), stored as `np_dtype`."""
    feats, hids = [], []
    for b in range(0, len(chunk), batch_size):
        part = chunk[b : b + batch_size]
        batch = pad_to_bucket(part, buckets, batch_size=batch_size)
        f, h = target_features_jit(target_cfg, target_params, jnp.asarray(batch.input_ids))
        f = np.asarray(jax.device_get(f.astype(jnp.float32))).astype(np_dtype)
        h = np.asarray(jax.device_get(h.astype(jnp.float32))).astype(np_dtype)
        for r, s in enumerate(part):
            feats.append(f[r, : len(s)])
            hids.append(h[r, : len(s)])
    return feats, hids


def _write_chunk(path: Path, chunk, feats, hids, dtype: str) -> int:
    """One chunk directory, atomically (`<name>.tmp` is debris `_remove_leftovers` removes);
    returns its number of tokens."""
    offsets = np.cumsum([0] + [len(s) for s in chunk]).astype(np.int64)
    with atomic_dir(path) as tmp:
        ids = np.concatenate([s.input_ids for s in chunk]).astype(np.int32)
        _save_npy(tmp / "input_ids.npy", ids)
        mask = np.concatenate([s.loss_mask for s in chunk]).astype(np.uint8)
        _save_npy(tmp / "loss_mask.npy", mask)
        _save_npy(tmp / "offsets.npy", offsets)
        for fname, arrs in (("features.npy", feats), ("hidden.npy", hids)):
            arr = np.concatenate(arrs, axis=0)
            _save_npy(tmp / fname, arr.view(np.uint16) if dtype == "bfloat16" else arr)
    return int(offsets[-1])


class FeatureCacheReader:
    """A loader source over a feature cache (memory-mapped; arrays are read on demand).

    `get(i)` returns `input_ids` [L] int32, `loss_mask` [L] uint8, `target_features` [L, m*H] and
    `target_hidden` [L, H] in the cache dtype (bf16 as `ml_dtypes.bfloat16`). An incomplete cache
    (interrupted writer) raises `FeatureCacheError` unless `allow_incomplete`.
    """

    def __init__(self, path: str | os.PathLike, *, allow_incomplete: bool = False):
        self.path = Path(path)
        index = _merged_index(self.path) if self.path.is_dir() else None
        if index is None:
            raise FeatureCacheError(
                f"no feature cache at {self.path} (index.json missing); build it with "
                "write_feature_cache"
            )
        self.index = index
        if self.index.get("version") != CACHE_VERSION:
            raise FeatureCacheError(
                f"{self.path}: cache version {self.index.get('version')} is not {CACHE_VERSION}; "
                "rebuild it"
            )
        chunks = self.index["chunks"]
        missing = self.index["num_chunks"] - len(chunks)
        if missing and not allow_incomplete:
            raise FeatureCacheError(
                f"{self.path}: feature cache is incomplete ({missing} of "
                f"{self.index['num_chunks']} chunks missing); run write_feature_cache again with "
                "the same arguments to finish it (completed chunks are kept)"
            )
        self.dtype = _DTYPES[self.index["dtype"]]
        self.target_cfg = TargetConfig.from_json(self.index["target"])
        self._chunks = sorted(
            ((v["start"], v["count"], k) for k, v in chunks.items()), key=lambda t: t[0]
        )
        self._rows = []  # (chunk name, position within chunk) per readable sample
        lengths, loss_tokens = [], []
        self._arrays: dict[str, dict[str, np.ndarray]] = {}
        for _start, count, name in self._chunks:
            d = self.path / name
            try:
                offsets = np.load(d / "offsets.npy")
                mask = np.load(d / "loss_mask.npy", mmap_mode="r")
            except (OSError, ValueError) as e:
                raise FeatureCacheError(f"{d} is unreadable ({e}); delete it and resume") from e
            if len(offsets) != count + 1:
                raise FeatureCacheError(
                    f"{d}: offsets do not match the index; delete it and resume"
                )
            lens = np.diff(offsets)
            csum = np.concatenate([[0], np.cumsum(np.asarray(mask, np.int64))])
            sums = csum[offsets[1:]] - csum[offsets[:-1]]
            for j in range(count):
                self._rows.append((name, j))
            lengths.extend(lens.tolist())
            loss_tokens.extend(np.asarray(sums).tolist())
        self.lengths = np.asarray(lengths, np.int64)
        self.num_loss_tokens = np.asarray(loss_tokens, np.int64)

    @property
    def feature_size(self) -> int:
        return int(self.index["feature_size"])

    @property
    def hidden_size(self) -> int:
        return int(self.index["hidden_size"])

    def __len__(self) -> int:
        return len(self._rows)

    def _chunk(self, name: str) -> dict[str, np.ndarray]:
        if name not in self._arrays:
            d = self.path / name
            arrs = {
                k: np.load(d / f"{k}.npy", mmap_mode="r")
                for k in ("input_ids", "loss_mask", "offsets", "features", "hidden")
            }
            for k in ("features", "hidden"):
                if self.dtype == ml_dtypes.bfloat16:
                    arrs[k] = arrs[k].view(ml_dtypes.bfloat16)
            self._arrays[name] = arrs
        return self._arrays[name]

    def get(self, i: int) -> dict[str, np.ndarray]:
        name, j = self._rows[i]
        a = self._chunk(name)
        lo, hi = int(a["offsets"][j]), int(a["offsets"][j + 1])
        return {
            "input_ids": np.asarray(a["input_ids"][lo:hi]),
            "loss_mask": np.asarray(a["loss_mask"][lo:hi]),
            "target_features": np.asarray(a["features"][lo:hi]),
            "target_hidden": np.asarray(a["hidden"][lo:hi]),
        }

    def check_target(self, target_cfg: TargetConfig) -> None:
        """Raise `FeatureCacheError` unless the cache was built by a target with this config."""
        mine = self.target_cfg.to_json()
        theirs = target_cfg.to_json()
        mine.pop("dtype", None)
        theirs.pop("dtype", None)
        if mine != theirs:
            diff = sorted(k for k in mine if mine.get(k) != theirs.get(k))
            raise FeatureCacheError(
                f"feature cache {self.path} was built for another target (differs in {diff}); "
                "rebuild it for this target or train against the cached one"
            )
