"""Deterministic, resumable training data order with static (bucketed) batch shapes.

Order (docs/METHOD.md §1.5): with N usable samples and G sequences per optimizer step,
`samples_per_epoch = floor(N / G) * G`; epoch e draws a fresh permutation seeded `data_seed + e`
(default 42 + e, independent of the model seed) and keeps its first `samples_per_epoch` entries.
The epochs are concatenated into one endless *stream*; the loader's whole state is a single
integer, the stream `position` (sequences consumed so far), which the trainer checkpoints. Any
position can be re-derived, so resuming is exact and needs no iterator state.

One optimizer step consumes `G` consecutive stream entries as `G / B` micro-batches of `B`
sequences (B = global micro-batch, over all devices and processes).

Multi-process runs (`num_shards` = P > 1, one shard per process): the usable rows are cut into P
contiguous shards and shard k has its own stream (epoch e: permutation seeded (data_seed + e, k),
`samples_per_epoch` = whole per-process steps of the smallest shard). Rows [k·B/P, (k+1)·B/P)
of every micro-batch, the rows process k's devices hold, come from shard k, so a process reads
only the samples (and feature-cache chunks) of its own shard. Every process still computes the
whole index array from the lengths alone, so bucket lengths agree everywhere. The order depends
on P; resume with the same number of processes. A per-host source (`host_data.HostSource`,
the pipeline's online drafters in a multi-process run) keeps the one-process order instead: its
batches are gathered on the mesh. A micro-batch is right-padded
to the smallest configured bucket that fits its longest sequence, so the number of distinct
shapes the train step sees is at most the number of buckets.

A *source* is anything with `__len__`, `lengths` (int [N]), `num_loss_tokens` (int [N]) and
`get(i) -> {"input_ids": [L] int32, "loss_mask": [L] uint8, ...}`; extra per-token fields
(offline target features: `target_features` [L, m*H], `target_hidden` [L, H]) are padded along.
`InMemorySource` wraps `TokenizedSample`s; `features.FeatureCacheReader` is the offline source.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from dspark_jax.errors import ConfigError, DatasetError
from dspark_jax.train.data import TokenizedSample
from dspark_jax.train.data_packing import choose_bucket

log = logging.getLogger(__name__)


class SampleSource(Protocol):
    lengths: np.ndarray  # [N] int
    num_loss_tokens: np.ndarray  # [N] int

    def __len__(self) -> int: ...

    def get(self, i: int) -> dict[str, np.ndarray]: ...


class InMemorySource:
    """`TokenizedSample`s held in memory (online feature mode: only tokens and masks)."""

    def __init__(self, samples: Sequence[TokenizedSample]):
        self.samples = list(samples)
        self.lengths = np.asarray([len(s) for s in self.samples], dtype=np.int64)
        self.num_loss_tokens = np.asarray(
            [int(np.asarray(s.loss_mask).sum()) for s in self.samples], dtype=np.int64
        )

    def __len__(self) -> int:
        return len(self.samples)

    def get(self, i: int) -> dict[str, np.ndarray]:
        s = self.samples[i]
        return {
            "input_ids": np.asarray(s.input_ids, np.int32),
            "loss_mask": np.asarray(s.loss_mask, np.uint8),
        }


def as_source(data) -> SampleSource:
    """A list of `TokenizedSample` becomes an `InMemorySource`; a source passes through."""
    if hasattr(data, "get") and hasattr(data, "lengths"):
        return data
    return InMemorySource(data)


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """Which source rows form one micro-batch, and its static length.

    `indices` int [B]: source row per batch row, -1 for a filler row (all padding, mask 0).
    `length`: the bucket length L every row is padded to.
    """

    indices: np.ndarray
    length: int

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.indices), self.length)


def load_rows(
    source: SampleSource, mb: MicroBatch, rows: slice = slice(None), *, pad_id: int = 0
) -> dict[str, np.ndarray]:
    """Right-padded numpy arrays for `mb.indices[rows]`: every field `[b, L, ...]`, plus
    `attention_mask` uint8 [b, L] (1 on real tokens).

    Padding is `pad_id` for `input_ids` and zero elsewhere (so `loss_mask` is 0 on padding and on
    filler rows). Only the requested rows are read (multi-process: each process its own rows).
    """
    idx = mb.indices[rows]
    out: dict[str, np.ndarray] = {}
    for r, i in enumerate(idx):
        if i < 0:
            continue
        sample = dict(source.get(int(i)))
        sample["attention_mask"] = np.ones(sample["input_ids"].shape, np.uint8)
        for k, v in sample.items():
            if k not in out:
                fill = pad_id if k == "input_ids" else 0
                out[k] = np.full((len(idx), mb.length) + v.shape[1:], fill, dtype=v.dtype)
            out[k][r, : v.shape[0]] = v
    if "input_ids" not in out:  # every row is filler: the fields of a row of the source
        # (a per-host source may not hold row 0: it names its fields)
        proto = dict(source.prototype() if hasattr(source, "prototype") else source.get(0))
        proto["attention_mask"] = proto["input_ids"]
        for k, v in proto.items():
            fill = pad_id if k == "input_ids" else 0
            dt = np.uint8 if k == "attention_mask" else v.dtype
            out[k] = np.full((len(idx), mb.length) + v.shape[1:], fill, dtype=dt)
    return out


def _check_lengths(source: SampleSource, buckets: Sequence[int], what: str) -> None:
    too_long = np.flatnonzero(source.lengths > max(buckets))
    if len(too_long):
        raise DatasetError(
            f"{what}: {len(too_long)} sample(s) are longer than the largest bucket {max(buckets)} "
            f"(first: row {int(too_long[0])}, length {int(source.lengths[too_long[0]])}); add a "
            "larger bucket to TrainConfig.seq_buckets or truncate the data (RenderConfig.max_length)"
        )


class DataLoader:
    """The training stream over a source (static after construction, state = a position).

    Raises `DatasetError` at construction (before any step) for an empty dataset, fewer usable
    samples than one global batch, a sequence longer than every bucket, or (with
    `empty_sequences="error"`) a sequence without supervised tokens; with "skip" such sequences
    are left out of the stream and counted in `num_skipped`.
    """

    def __init__(
        self,
        source: SampleSource,
        *,
        global_batch: int,
        micro_batch: int,
        buckets: Sequence[int],
        data_seed: int = 42,
        empty_sequences: str = "skip",
        num_shards: int = 1,
    ):
        if global_batch % micro_batch:
            raise ConfigError(
                f"global_batch={global_batch} must be a multiple of micro_batch={micro_batch}"
            )
        if num_shards < 1 or micro_batch % num_shards:
            raise ConfigError(
                f"micro_batch={micro_batch} must be a multiple of the number of data shards "
                f"(processes) {num_shards}"
            )
        self.num_shards = num_shards
        self.source = source
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.buckets = tuple(sorted(buckets))
        self.data_seed = data_seed
        n = len(source)
        if n == 0:
            raise DatasetError(
                "the training set is empty: check the data path and the filters that ran before "
                "(min_loss_tokens, max_length)"
            )
        empty = np.flatnonzero(np.asarray(source.num_loss_tokens) == 0)
        if len(empty) and empty_sequences == "error":
            raise DatasetError(
                f"{len(empty)} of {n} training sequences have no supervised token (first: row "
                f"{int(empty[0])}); drop them or set TrainConfig.empty_sequences='skip'"
            )
        if len(empty):
            log.warning("skipping %d of %d sequences without supervised tokens", len(empty), n)
        self.num_skipped = int(len(empty))
        self.usable = np.setdiff1d(np.arange(n), empty)  # sorted source rows
        _check_lengths(source, self.buckets, "training set")
        p = num_shards
        own = getattr(source, "process_rows", None)  # per-host blocks (`host_data.HostShards`)
        if own is not None:
            if len(own) != p:
                raise ConfigError(
                    f"the data is held in {len(own)} per-process blocks but the mesh gives {p} "
                    "data shard(s): lay the processes along the mesh's data / fsdp axes"
                )
            self.shards = [np.intersect1d(rows, self.usable) for rows in own]
        else:
            cuts = [len(self.usable) * k // p for k in range(p + 1)]
            self.shards = [self.usable[cuts[k] : cuts[k + 1]] for k in range(p)]
        g_local = global_batch // p
        self.samples_per_epoch = min(len(x) for x in self.shards) // g_local * g_local
        if self.samples_per_epoch == 0:
            raise DatasetError(
                f"the training set has {len(self.usable)} usable sequence(s), fewer than one "
                f"global batch of {global_batch}"
                + (f" ({g_local} per each of {p} data shards)" if p > 1 else "")
                + "; lower TrainConfig.global_batch_size or add data"
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.samples_per_epoch * self.num_shards // self.global_batch

    def shard_rows(self, shard: int) -> np.ndarray:
        """The source rows data shard `shard` (process `shard`) may ever read."""
        return self.shards[shard]

    @property
    def accum_steps(self) -> int:
        return self.global_batch // self.micro_batch

    @functools.lru_cache(maxsize=8)  # noqa: B019 (a loader lives as long as its run)
    def _epoch_order(self, epoch: int, shard: int = 0) -> np.ndarray:
        rows = self.shards[shard]
        seed = self.data_seed + epoch if self.num_shards == 1 else (self.data_seed + epoch, shard)
        perm = np.random.default_rng(seed).permutation(len(rows))
        return rows[perm[: self.samples_per_epoch]]

    def stream(self, position: int, count: int, shard: int = 0) -> np.ndarray:
        """Source rows at positions [position, position + count) of a shard's stream."""
        out = np.empty((count,), dtype=np.int64)
        for j in range(count):
            epoch, k = divmod(position + j, self.samples_per_epoch)
            out[j] = self._epoch_order(epoch, shard)[k]
        return out

    def micro_batches(self, position: int) -> list[MicroBatch]:
        """The `accum_steps` micro-batches of the optimizer step starting at (global stream)
        `position`; with P shards, rows [k·B/P, (k+1)·B/P) of each come from shard k."""
        p = self.num_shards
        if p == 1:
            rows = self.stream(position, self.global_batch)
        else:
            b_local, g_local = self.micro_batch // p, self.global_batch // p
            per = [self.stream(position // p, g_local, k) for k in range(p)]
            rows = np.concatenate(
                [
                    np.concatenate([x[a * b_local : (a + 1) * b_local] for x in per])
                    for a in range(self.accum_steps)
                ]
            )
        out = []
        for a in range(self.accum_steps):
            idx = rows[a * self.micro_batch : (a + 1) * self.micro_batch]
            length = choose_bucket(int(self.source.lengths[idx].max()), self.buckets)
            out.append(MicroBatch(idx, length))
        return out


def eval_batches(
    source: SampleSource,
    *,
    batch_size: int,
    buckets: Sequence[int],
    max_batches: int = 0,
) -> list[MicroBatch]:
    """Fixed held-out batches in source order; sequences without supervision are left out.

    The last batch is completed with filler rows (index -1), so every batch is [batch_size, L].
    A per-host source (`process_rows`: P blocks) fills rows [k·B/P, (k+1)·B/P) of every batch
    from block k, so each process reads only its own rows.
    """
    _check_lengths(source, buckets, "evaluation set")
    rows = np.flatnonzero(np.asarray(source.num_loss_tokens) > 0)
    own = getattr(source, "process_rows", None)
    if own is not None:
        b_local = batch_size // len(own)
        blocks = [np.intersect1d(r, rows) for r in own]
        n = max(-(-len(x) // b_local) for x in blocks)
        rows = np.concatenate(
            [np.pad(x, (0, n * b_local - len(x)), constant_values=-1).reshape(n, b_local)
             for x in blocks], axis=1
        ).reshape(-1)  # fmt: skip
    out = []
    for lo in range(0, len(rows), batch_size):
        idx = rows[lo : lo + batch_size]
        length = choose_bucket(int(source.lengths[idx[idx >= 0]].max()), buckets)
        idx = np.concatenate([idx, -np.ones((batch_size - len(idx),), np.int64)])
        out.append(MicroBatch(idx, length))
        if max_batches and len(out) >= max_batches:
            break
    return out
