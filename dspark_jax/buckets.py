"""Static shapes: "the smallest bucket >= n", and the default bucket tuples, one per purpose.

A jitted function compiles once per distinct input shape, so every variable size (batch, prompt
length, cache length, packed tokens) is rounded up to one of a few buckets. Each caller raises
its own error (naming its own knob) when `n` is above the largest bucket; `bucket_up` returns
None then.

A leaf module (standard library and numpy only): spec/ and sched/ may import it
(docs/ARCHITECTURE.md §2.12).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "ENGINE_PROMPT_BUCKETS",
    "GENERATE_BATCH_BUCKETS",
    "GENERATE_LENGTH_BUCKETS",
    "TRAIN_SEQ_BUCKETS",
    "bucket_up",
    "bucket_up_array",
    "pow2_bucket",
]

# models/generate.py: batch sizes and prompt + new-token lengths of one generate() call.
GENERATE_BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
GENERATE_LENGTH_BUCKETS: tuple[int, ...] = tuple(2**i for i in range(4, 16))  # 16 ... 32768
# train/: padded training sequence lengths (data_packing.pad_to_bucket, the feature cache).
TRAIN_SEQ_BUCKETS: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096)
# engine/engine.py: prompt chunk lengths of the slot engine's prefill.
ENGINE_PROMPT_BUCKETS: tuple[int, ...] = (32, 128, 512)


def bucket_up(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest of `buckets` that is >= n, or None when n exceeds them all."""
    for b in sorted(buckets):
        if b >= n:
            return int(b)
    return None


def bucket_up_array(x: np.ndarray, buckets: Sequence[int]) -> np.ndarray:
    """`bucket_up` elementwise over integer array `x`: -1 where x exceeds the largest bucket;
    `x` itself when `buckets` is empty (unbucketed)."""
    if not buckets:
        return x
    b = np.asarray(sorted(buckets), np.int64)
    i = np.searchsorted(b, x, side="left")
    return np.where(i < b.size, b[np.minimum(i, b.size - 1)], -1)


def pow2_bucket(n: int, smallest: int = 32) -> int:
    """The smallest `smallest * 2**k` >= n (unbounded)."""
    b = smallest
    while b < n:
        b *= 2
    return b
