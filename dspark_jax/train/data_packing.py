"""Static-shape batching: samples right-padded to the smallest length bucket that fits, grouped
by bucket so there are at most `len(buckets)` distinct shapes (one compilation each).
"""

from __future__ import annotations

import collections
import dataclasses
import random
from collections.abc import Sequence

import numpy as np

from dspark_jax.buckets import TRAIN_SEQ_BUCKETS, bucket_up
from dspark_jax.train.data import TokenizedSample

DEFAULT_BUCKETS: tuple[int, ...] = TRAIN_SEQ_BUCKETS


# ------------------------------------------------------------------------------------------------
# Static-shape batching


@dataclasses.dataclass(frozen=True, eq=False)
class PaddedBatch:
    """Right-padded batch: `input_ids` int32 [N, L], `loss_mask` uint8 [N, L] (0 on padding),
    `lengths` int32 [N] (0 for filler rows added to reach a static batch size)."""

    input_ids: np.ndarray  # [N, L] int32
    loss_mask: np.ndarray  # [N, L] uint8
    lengths: np.ndarray  # [N] int32

    @property
    def attention_mask(self) -> np.ndarray:
        """[N, L] bool, True on real tokens."""
        return np.arange(self.input_ids.shape[1])[None, :] < self.lengths[:, None]


def choose_bucket(length: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """The smallest bucket ≥ `length`."""
    b = bucket_up(length, buckets)
    if b is not None:
        return b
    raise ValueError(
        f"sequence of length {length} exceeds the largest bucket {max(buckets)}: add a larger "
        "bucket or lower RenderConfig.max_length"
    )


def pad_to_bucket(
    samples: Sequence[TokenizedSample],
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    *,
    pad_id: int = 0,
    batch_size: int | None = None,
) -> PaddedBatch:
    """Stack samples right-padded to the smallest bucket that fits the longest one.

    With `batch_size`, filler rows (all `pad_id`, mask 0, length 0) pad N up to it so the batch
    shape is static too.
    """
    if not samples:
        raise ValueError("pad_to_bucket needs at least one sample")
    n = len(samples) if batch_size is None else batch_size
    if n < len(samples):
        raise ValueError(f"{len(samples)} samples do not fit batch_size={batch_size}")
    L = choose_bucket(max(len(s) for s in samples), buckets)
    ids_NxL = np.full((n, L), pad_id, dtype=np.int32)
    mask_NxL = np.zeros((n, L), dtype=np.uint8)
    lengths_N = np.zeros((n,), dtype=np.int32)
    for i, s in enumerate(samples):
        ids_NxL[i, : len(s)] = s.input_ids
        mask_NxL[i, : len(s)] = s.loss_mask
        lengths_N[i] = len(s)
    return PaddedBatch(ids_NxL, mask_NxL, lengths_N)


def make_batches(
    samples: Sequence[TokenizedSample],
    batch_size: int,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    *,
    pad_id: int = 0,
    seed: int | None = None,
    drop_remainder: bool = False,
) -> list[PaddedBatch]:
    """Group samples by length bucket and cut each group into `[batch_size, bucket]` batches.

    So there are at most `len(buckets)` distinct shapes. A group's last partial batch is filled
    with empty rows (or dropped with `drop_remainder`). With `seed`, samples are shuffled within
    groups and the batch order is shuffled; without it, input order is kept.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
    rng = random.Random(seed)
    groups: dict[int, list[TokenizedSample]] = collections.defaultdict(list)
    for s in samples:
        groups[choose_bucket(len(s), buckets)].append(s)
    batches: list[PaddedBatch] = []
    for L in sorted(groups):
        group = groups[L]
        if seed is not None:
            rng.shuffle(group)
        for lo in range(0, len(group), batch_size):
            part = group[lo : lo + batch_size]
            if len(part) < batch_size and drop_remainder:
                continue
            batches.append(pad_to_bucket(part, (L,), pad_id=pad_id, batch_size=batch_size))
    if seed is not None:
        rng.shuffle(batches)
    return batches
