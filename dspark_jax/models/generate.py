"""Batched autoregressive generation with the target model over its static KV cache.

The host side: request checks, buckets, which programs run (`models.decoding` has the
device-side contract they are built from: prefill, extend, sampling, the decode step and loop,
re-exported here).

    outs = generate(cfg, params, [[1, 2, 3], [4, 5]], max_new_tokens=32)          # greedy
    outs = generate(cfg, params, prompts, max_new_tokens=32, seeds=[7, 8],
                    sampling=validate_sampling_params([0.7, 1.0], top_p=0.9))

Static shapes: the batch is padded to a batch bucket, prompts are right-padded to a length bucket
and the KV cache gets `S` = the smallest length bucket that holds every prompt plus its new
tokens (so attention reads only that many positions, not the model's maximum). Everything a
request varies within its buckets (prompt tokens and lengths, max new tokens, stop ids, seeds,
temperature / top-k / top-p / min-p) is an array, so a warm engine never recompiles for it.
Greedy vs sampled, and which sampling stages exist at all, are static (`SamplingConfig`).

Randomness: see `models.decoding` (keyed by request seed and position, independent of the
batch and of padding).

The loop: after one prefill of all rows at once, the decode steps run inside one jitted
`lax.while_loop` (one dispatch per batch, two at batch 1 on CPU where prefill and loop take
different XLA:CPU options; finished rows are masked, the loop exits when every row is done).
The alternative, a jitted one-step function driven from the host (`loop="host"`, dispatched
asynchronously, `done` read back every 8 steps), is kept for measurement. On the 2-core
CPU we develop on, benchmarks/vs_transformers.py measured the device loop 1.3x faster at batch 1
(per-token dispatch is a visible share of a ~7 ms step) and on par (0.93x, within noise) at batch 8.

Shapes are written as suffixes: B batch (bucket), P prompt bucket, S cache length, T new tokens,
V vocab, K stop ids.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.buckets import GENERATE_BATCH_BUCKETS, GENERATE_LENGTH_BUCKETS, pow2_bucket
from dspark_jax.config import TargetConfig
from dspark_jax.errors import RequestError

# the device-side contract, re-exported: generate's public API has always included it
from dspark_jax.models.decoding import (
    PAD_TOKEN,
    DecodeRequest,
    DecodeState,
    _decode_loop,
    bucket_size,
    decode_step,
    decode_step_jit,
    extend,
    extend_jit,
    generate_jit,
    prefill,
    prefill_jit,
    sample_tokens,
    start,
    start_jit,
    token_keys,
)
from dspark_jax.models.generate_queue import run_queue
from dspark_jax.models.validate import check_request_fits
from dspark_jax.runtime.xla_cpu import batch1_decode_compiler_options, engine_compiler_options
from dspark_jax.spec.sampling import (
    SamplingConfig,
    SamplingParams,
    validate_sampling_params,
)

__all__ = [
    "DEFAULT_BATCH_BUCKETS",
    "DEFAULT_LENGTH_BUCKETS",
    "DecodeRequest",
    "DecodeState",
    "bucket_size",
    "decode_step",
    "decode_step_jit",
    "extend",
    "extend_jit",
    "generate",
    "generate_jit",
    "prefill",
    "prefill_jit",
    "sample_tokens",
    "start",
    "start_jit",
    "token_keys",
]

DEFAULT_BATCH_BUCKETS = GENERATE_BATCH_BUCKETS
DEFAULT_LENGTH_BUCKETS = GENERATE_LENGTH_BUCKETS  # 16 ... 32768
_MIN_STOP_BUCKET = 4


# ------------------------------------------------------------------------------------------------
# the programs generate() runs (models.decoding has the device-side contract)


def _batch1_programs():
    """(prefill, decode loop) for batch 1, each compiled with its XLA:CPU option (`xla_cpu.py`:
    prefill as the serving engine's programs, the loop with YNNPACK's dots), or None where
    neither applies (then `generate_jit`, one program)."""
    pre = tuple((engine_compiler_options() or {}).items())
    loop = tuple((batch1_decode_compiler_options() or {}).items())
    return _batch1_jits(pre, loop) if pre or loop else None


@functools.cache
def _batch1_jits(pre: tuple, loop: tuple):
    names = ("cfg", "scfg", "cache_len")
    return (
        jax.jit(start, static_argnames=names, compiler_options=dict(pre) or None),
        jax.jit(_decode_loop, static_argnames=names, compiler_options=dict(loop) or None),
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------
# host API


def _as_sampling(sampling, n: int) -> SamplingParams | None:
    if sampling is None:
        return None
    if isinstance(sampling, SamplingParams):
        fields = sampling._asdict()
    elif isinstance(sampling, Mapping):
        fields = dict(sampling)
    else:
        raise TypeError(
            "sampling must be None (greedy), a SamplingParams or a dict with temperature / "
            f"top_k / top_p / min_p; got {type(sampling).__name__}"
        )
    host = {k: np.asarray(v) for k, v in fields.items()}
    return validate_sampling_params(**host, batch_size=n)


def _per_request(name: str, value, n: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim == 0:
        arr = np.full((n,), arr)
    if arr.shape != (n,):
        raise RequestError(f"{name} must be an int or one per prompt ({n}), got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise RequestError(f"{name} must be integers, got {arr.dtype}")
    return arr.astype(np.int64)


def generate(
    cfg: TargetConfig,
    params: nnx.State,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    sampling: SamplingParams | Mapping | None = None,
    sampling_config: SamplingConfig | None = None,
    stop_ids: Sequence[int] = (),
    seeds: Sequence[int] | None = None,
    key: jax.Array | int = 0,
    batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
    length_buckets: Sequence[int] | None = None,
    loop: str = "device",
) -> list[list[int]]:
    """Generate continuations for a list of token-id prompts; returns the new tokens per prompt.

    Args:
      prompts: non-empty lists of token ids in [0, vocab).
      max_new_tokens: >= 1, one for all or one per prompt.
      sampling: None for greedy; else per-request knobs (`SamplingParams` or a dict of
        temperature / top_k / top_p / min_p, scalars or one per prompt), validated here.
      sampling_config: the static sampling stages; default `SamplingConfig.for_params(sampling)`.
        Pin it (e.g. all stages on) to keep one compiled program across requests that toggle
        top-k / top-p.
      stop_ids: token ids that end a request; the stop token is included in its output.
      seeds: one integer per prompt (default: its index); with `key` they fix the randomness.
      key: base PRNG key or an int seed for it.
      batch_buckets / length_buckets: static sizes. Batches above the largest batch bucket are
        split; the cache length is a length bucket too. Default length buckets: powers of two
        below the target's context, then the context itself, so every request within the
        context runs; given ones are the caller's limit (capped at the context).
      loop: "device" (one jitted while loop per batch), "host" (a jitted step per token, for
        comparison) or "queue" (continuous batching: up to max(batch_buckets) rows work through
        every prompt in one loop, a finished row taking the next prompt; `models.generate_queue`).

    Raises (before any device work): RequestError / ValueError for an empty prompt, token ids
    outside the vocabulary, a prompt plus max_new_tokens beyond the model's context
    (max_position_embeddings), bad seeds, invalid sampling parameters.
    """
    n = len(prompts)
    if n == 0:
        return []
    if loop not in ("device", "host", "queue"):
        raise ValueError(f"loop must be 'device', 'host' or 'queue', got {loop!r}")
    lens = np.array([len(p) for p in prompts], np.int64)
    max_new = _per_request("max_new_tokens", max_new_tokens, n)
    if length_buckets is None:
        length_buckets = context_buckets(DEFAULT_LENGTH_BUCKETS, cfg.max_position_embeddings)
    _check_prompts(cfg, prompts, lens, max_new, length_buckets)
    stop = np.asarray(list(stop_ids), np.int64).reshape(-1)
    if stop.size and (stop.min() < 0 or stop.max() >= cfg.vocab_size):
        raise RequestError(f"stop_ids must lie in [0, {cfg.vocab_size}), got {stop.tolist()}")
    seeds_arr = _per_request("seeds", np.arange(n) if seeds is None else seeds, n)
    if np.any((seeds_arr < 0) | (seeds_arr >= 2**32)):
        raise RequestError("seeds must lie in [0, 2**32)")
    sp, scfg = _sampling_mode(sampling, sampling_config, n)
    if isinstance(key, (int, np.integer)):
        key = jax.random.key(key)

    k_stop = pow2_bucket(stop.size, _MIN_STOP_BUCKET)
    stop_K = np.full((k_stop,), -1, np.int32)
    stop_K[: stop.size] = stop
    rows = _HostRows(lens, max_new, seeds_arr, None if sp is None else [np.asarray(f) for f in sp])
    buckets = (tuple(batch_buckets), tuple(length_buckets))
    chunk = max(batch_buckets)
    if loop == "queue":
        return run_queue(cfg, params, prompts, rows, stop_K, key, scfg, buckets)[0]
    outs: list[list[int]] = []
    for lo in range(0, n, chunk):
        idx = np.arange(lo, min(lo + chunk, n))
        sub = [prompts[i] for i in idx]
        outs.extend(_run_bucket(cfg, params, sub, rows.take(idx), stop_K, key, scfg, buckets, loop))
    return outs


def context_buckets(length_buckets: Sequence[int], context: int) -> tuple[int, ...]:
    """`length_buckets` below `context`, then `context` itself: the largest bucket is the
    target's context, whatever the caller's buckets."""
    return tuple(sorted({int(b) for b in length_buckets if 0 < int(b) < context} | {context}))


def _check_prompts(cfg, prompts, lens, max_new, length_buckets) -> None:
    """RequestError for a request `generate` cannot run: max_new_tokens < 1, an empty prompt,
    token ids outside the vocabulary, a prompt plus its new tokens beyond the cache."""
    if np.any(max_new < 1):
        raise RequestError(f"max_new_tokens must be >= 1, got {max_new[max_new < 1][:4].tolist()}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise RequestError(f"request {i} has an empty prompt; give at least one token")
        a = np.asarray(p)
        if a.dtype.kind not in "iu" or a.min() < 0 or a.max() >= cfg.vocab_size:
            raise RequestError(
                f"prompt {i} must hold integer token ids in [0, {cfg.vocab_size}); got "
                f"dtype {a.dtype}, range [{a.min()}, {a.max()}]"
            )
    ctx = cfg.max_position_embeddings
    over = np.flatnonzero(lens + max_new > ctx)
    if over.size:
        i = int(over[0])
        raise RequestError(
            f"prompt {i} ({lens[i]} tokens) + max_new_tokens ({max_new[i]}) exceeds the target's "
            f"context of {ctx} tokens (max_position_embeddings); shorten the prompt or lower "
            f"max_new_tokens to <= {max(ctx - int(lens[i]), 0)}"
        )
    max_cache = min(max(length_buckets), ctx)
    for i in range(len(prompts)):
        check_request_fits(
            prompt_lens=[int(lens[i])], max_new_tokens=int(max_new[i]), max_len=max_cache, cfg=cfg
        )


def _sampling_mode(sampling, sampling_config, n: int):
    """(validated per-request knobs or None for greedy, the static SamplingConfig)."""
    sp = _as_sampling(sampling, n)
    if sp is not None and sampling_config is None and SamplingConfig.for_params(sp).greedy:
        sp = None  # all rows at temperature 0: the static greedy mode gives the same tokens
    if sp is None:
        if sampling_config is not None and not sampling_config.greedy:
            raise ValueError("sampling_config is sampled but sampling=None (greedy) was given")
        return None, SamplingConfig(greedy=True)
    scfg = sampling_config or SamplingConfig.for_params(sp)
    why = scfg.covers(sp)
    if why:
        raise ValueError(why)
    return sp, scfg


class _HostRows(NamedTuple):
    """Validated per-request host arrays [n] (numpy)."""

    lens: np.ndarray
    max_new: np.ndarray
    seeds: np.ndarray
    sampling: list[np.ndarray] | None  # SamplingParams fields, or None for greedy

    def take(self, idx) -> _HostRows:
        sampling = None if self.sampling is None else [f[idx] for f in self.sampling]
        return _HostRows(self.lens[idx], self.max_new[idx], self.seeds[idx], sampling)


def _run_bucket(cfg, params, prompts, rows: _HostRows, stop_K, key, scfg, buckets, loop):
    """Pad one chunk of requests to its buckets, run it, and cut each row's new tokens out."""
    batch_buckets, length_buckets = buckets
    n, lens = len(prompts), rows.lens
    b = bucket_size(n, batch_buckets, "batch size")
    p = bucket_size(int(lens.max()), length_buckets, "length of prompt")
    s = bucket_size(int((lens + rows.max_new).max()), length_buckets, "length of prompt + new")
    s = min(s, cfg.max_position_embeddings)
    tokens = np.full((b, p), PAD_TOKEN, np.int32)
    for i, pr in enumerate(prompts):
        tokens[i, : len(pr)] = pr
    lengths = np.ones((b,), np.int32)
    lengths[:n] = lens
    mx = np.zeros((b,), np.int32)  # padding rows: done before they start
    mx[:n] = rows.max_new
    sd = np.zeros((b,), np.uint32)
    sd[:n] = rows.seeds
    sampling = None
    if rows.sampling is not None:
        pad = (1.0, 0, 1.0, 0.0)  # neutral knobs for padding rows (their tokens are dropped)
        sampling = SamplingParams(
            *(
                np.concatenate([f, np.full((b - n,), v, f.dtype)])
                for f, v in zip(rows.sampling, pad)
            )
        )
    req = DecodeRequest(mx, stop_K, key, sd, sampling)
    if loop == "device":
        # batch 1: prefill and the loop as two programs with their XLA:CPU options (the loop's
        # keeps its cache updates in place, xla_cpu.py)
        batch1 = _batch1_programs() if b == 1 else None
        if batch1 is None:
            toks, num = generate_jit(cfg, params, tokens, lengths, req, scfg=scfg, cache_len=s)
        else:
            state = batch1[0](cfg, params, tokens, lengths, req, scfg=scfg, cache_len=s)
            toks, num = batch1[1](cfg, params, state, req, scfg=scfg, cache_len=s)
    else:
        toks, num = _generate_host(cfg, params, tokens, lengths, req, scfg, s)
    toks, num = np.asarray(toks), np.asarray(num)
    return [toks[i, lens[i] : lens[i] + num[i]].tolist() for i in range(n)]


def _generate_host(cfg, params, tokens, lengths, req, scfg, cache_len, sync_every: int = 8):
    """Host-driven loop: one jitted step per token, `done` read back every `sync_every` steps."""
    req = jax.device_put(req)
    state = start_jit(cfg, params, tokens, lengths, req, scfg=scfg, cache_len=cache_len)
    steps = 0
    while steps < cache_len:
        for _ in range(sync_every):
            state = decode_step_jit(cfg, params, state, req, scfg=scfg)
        steps += sync_every
        if bool(jnp.all(state.done_B)):
            break
    return state.tokens_BxS, state.num_new_B
