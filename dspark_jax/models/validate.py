"""Host-side checks that a generation request fits the target and its KV cache, before any work.

The forward drops K/V writes past the cache end (`mode="drop"`), so a request that outgrows its
cache would not crash: it would silently attend to a truncated context. These checks turn that
into a clear error raised before anything is allocated or compiled.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dspark_jax.config import TargetConfig
from dspark_jax.errors import RequestError


def check_request_fits(
    cache=None,
    *,
    prompt_lens: int | Sequence[int] | np.ndarray,
    max_new_tokens: int = 0,
    lookahead: int = 0,
    batch: int | None = None,
    max_len: int | None = None,
    slots: int | None = None,
    cfg: TargetConfig | None = None,
) -> None:
    """Raise RequestError unless every request fits.

    Args:
      cache: a `KVCache` (or anything with `max_len` and `batch`), or None when `max_len` and
        `slots` are given instead (to check before allocating the cache).
      prompt_lens: one prompt length, or one per request.
      max_new_tokens: tokens each request may generate.
      lookahead: extra positions a step may write past the last committed token (speculative
        verification writes up to gamma draft tokens there).
      batch: number of requests (default: the number of prompt lengths).
      max_len, slots: override the cache's positions per slot and its number of slots.
      cfg: when given, positions must also stay below `cfg.max_position_embeddings`.

    A request needs `prompt_len + max_new_tokens + lookahead` cache positions (one more than
    strictly written, since the last sampled token is never fed back: conservative by one).
    """
    if cache is not None:
        max_len = cache.max_len if max_len is None else max_len
        slots = cache.batch if slots is None else slots
    if max_len is None:
        raise RequestError("check_request_fits needs a cache or max_len=")
    lens = np.atleast_1d(np.asarray(prompt_lens, dtype=np.int64))
    if lens.ndim != 1:
        raise RequestError(f"prompt_lens must be an int or a 1-d sequence, got shape {lens.shape}")
    batch = len(lens) if batch is None else int(batch)
    if batch < 1:
        raise RequestError(f"batch must be >= 1, got {batch}")
    if slots is not None and batch > slots:
        raise RequestError(
            f"batch of {batch} requests is larger than the cache's {slots} slots; split the "
            f"batch or build the cache with batch >= {batch}"
        )
    if max_new_tokens < 0 or lookahead < 0:
        raise RequestError(
            f"max_new_tokens ({max_new_tokens}) and lookahead ({lookahead}) must be >= 0"
        )
    for i, n in enumerate(lens.tolist()):
        if n < 1:
            raise RequestError(f"request {i} has an empty prompt (length {n}); give >= 1 token")
        if n > max_len:
            raise RequestError(
                f"prompt of request {i} is {n} tokens, longer than the KV cache ({max_len} "
                f"positions per slot); truncate the prompt or build a cache with max_len >= "
                f"{n + max_new_tokens + lookahead}"
            )
        need = n + max_new_tokens + lookahead
        if need > max_len:
            raise RequestError(
                f"request {i} needs {need} cache positions (prompt {n} + max_new_tokens "
                f"{max_new_tokens} + lookahead {lookahead}) but the KV cache has {max_len}; "
                f"lower max_new_tokens to <= {max(max_len - n - lookahead, 0)} or enlarge the cache"
            )
        if cfg is not None and need > cfg.max_position_embeddings:
            raise RequestError(
                f"request {i} needs positions up to {need}, beyond the model's "
                f"max_position_embeddings={cfg.max_position_embeddings}; shorten the prompt or "
                "lower max_new_tokens"
            )
