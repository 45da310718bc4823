"""Sampling transforms: logits -> the exact distribution a token is drawn from.

One transform serves the target, the drafter and plain decoding, so target and draft
distributions are always computed the same way (a condition for lossless speculative sampling).

Order of operations (per row, as in Hugging Face / vLLM):

1. temperature: ``z = logits / T``; a row with ``T == 0`` becomes a point mass on the argmax
   (first index on ties), which makes greedy rows exact inside a sampled batch;
2. top-k: keep tokens whose ``z`` is >= the k-th largest ``z`` (ties at the boundary are kept);
3. top-p: on the renormalised top-k distribution, keep the smallest set of most likely tokens
   whose mass reaches ``top_p`` (again every token tied with the last kept one is kept);
4. min-p: keep tokens with ``p >= min_p * max(p)``;
5. renormalise (softmax over the kept tokens).

Static vs array: :class:`SamplingConfig` (hashable, a static jit argument) says which of these
stages exist at all (``greedy``, ``top_k``, ``top_p``, ``min_p``); :class:`SamplingParams` holds the
per-row values as ``[B]`` arrays, so changing a request's temperature or top-p never recompiles.
``SamplingConfig(greedy=True)`` is a separate static mode (argmax, no softmax, no randomness).

Validation happens here, at the API boundary, on the host: :func:`validate_sampling_params` and
:func:`check_logits` raise ``ValueError`` with the fix in the message. Nothing inside a jitted
function raises.

Shapes are written as comments at definitions (``# [B, ..., V]``): the leading axis of logits is
always the request axis ``B`` that the ``[B]`` parameters index.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.sampling_knobs import SamplingParams, check_sampling_knobs

__all__ = [
    "SamplingConfig",
    "SamplingParams",
    "validate_sampling_params",
    "check_logits",
    "transform_logits",
    "probs_from_logits",
    "sample_from_probs",
    "sample_from_logits",
    "gumbel_noise",
    "sample_with_noise",
    "sample_transformed",
    "probs_of_draws",
]


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static structure of sampling (hashable; pass as a static jit argument).

    Attributes:
      greedy: argmax mode. No randomness, no softmax; parameters are not read. Greedy verification
        accepts a draft iff it equals the target argmax.
      top_k / top_p / min_p: whether the stage exists. A stage that is off ignores the matching
        ``SamplingParams`` field, so :meth:`for_params` turns a stage on whenever any row uses it
        (``verify(..., validate=True)`` checks this).
    """

    greedy: bool = False
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False

    def __post_init__(self):
        if self.greedy and (self.top_k or self.top_p or self.min_p):
            raise ValueError(
                "SamplingConfig(greedy=True) takes the argmax; top_k/top_p/min_p filters do not "
                "change it. Set them to False (or use greedy=False with temperature-0 rows)."
            )

    @classmethod
    def for_params(cls, params: SamplingParams) -> SamplingConfig:
        """The smallest config that honours every row of concrete ``params`` (host side).

        All-greedy batches get the static greedy mode (identical results, cheaper); otherwise
        temperature-0 rows are exact point masses inside the sampled mode.
        """
        temperature = np.asarray(params.temperature)
        if temperature.size and np.all(temperature == 0):
            return cls(greedy=True)
        return cls(
            greedy=False,
            top_k=bool(np.any(np.asarray(params.top_k) > 0)),
            top_p=bool(np.any(np.asarray(params.top_p) < 1)),
            min_p=bool(np.any(np.asarray(params.min_p) > 0)),
        )

    def covers(self, params: SamplingParams) -> str | None:
        """None if this config honours every row of concrete ``params``; otherwise why not."""
        temperature = np.asarray(params.temperature)
        if self.greedy:
            if np.any(temperature != 0):
                return (
                    "SamplingConfig(greedy=True) but some rows have temperature > 0; use "
                    "SamplingConfig.for_params(params) instead of silently decoding them greedily"
                )
            return None
        for stage, values, off in (
            ("top_k", np.asarray(params.top_k), lambda v: v == 0),
            ("top_p", np.asarray(params.top_p), lambda v: v >= 1),
            ("min_p", np.asarray(params.min_p), lambda v: v == 0),
        ):
            if not getattr(self, stage) and not np.all(off(values)):
                return (
                    f"some rows set {stage} but SamplingConfig({stage}=False) would ignore it; "
                    "use SamplingConfig.for_params(params)"
                )
        return None


def validate_sampling_params(
    temperature,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    *,
    batch_size: int | None = None,
    on_host: bool = False,
) -> SamplingParams:
    """Check per-request sampling knobs on the host and pack them as ``[B]`` arrays (on the
    default device; numpy arrays with ``on_host``, which never touches a device: a config check
    that runs before ``jax.distributed.initialize``).

    Args (scalars broadcast to ``[B]``; ``B`` is ``batch_size`` or the length of any array arg):
      temperature: 0 (greedy for that row) or finite and >= ``MIN_TEMPERATURE`` (1e-4).
      top_k: integer >= 0; 0 = off.
      top_p: in (0, 1]; 1 = off.
      min_p: in [0, 1]; 0 = off.

    Raises:
      ValueError: naming the offending rows and the valid range. Call this when a request
        arrives, never inside a jitted loop.
    """
    host = check_sampling_knobs(temperature, top_k, top_p, min_p, batch_size=batch_size)
    if on_host:
        return host
    # cast on the host and transfer: jnp.asarray would compile a small program per dtype
    # before the caller has finished checking the request
    return SamplingParams(*(jax.device_put(x) for x in host))


def check_logits(logits, name: str = "logits", valid=None) -> None:
    """Raise ``ValueError`` if concrete ``logits`` contain NaN or +inf (where ``valid`` is True).

    ``-inf`` is allowed (a token masked out of the vocabulary). ``valid`` (broadcastable to
    ``logits.shape[:-1]``) restricts the check to positions that are read. This is a host-side
    check: it synchronises with the device, so call it at the API boundary.
    """
    if isinstance(logits, jax.core.Tracer):
        raise TypeError(f"check_logits({name}) needs concrete values; call it outside jit")
    bad = np.asarray(_nan_or_posinf(jnp.asarray(logits)))  # [...]
    if valid is not None:
        bad = bad & np.asarray(valid)
    if np.any(bad):
        where = np.argwhere(bad)[:4].tolist()
        raise ValueError(
            f"{name} contain NaN or +inf at (row, ...) positions {where}; the model produced "
            "invalid logits (check the checkpoint dtype / overflow) - refusing to sample from them"
        )


@jax.jit
def _nan_or_posinf(x: jax.Array) -> jax.Array:
    """[..., V] -> [...] bool: the row holds a NaN or +inf (one compiled reduction)."""
    return jnp.any(jnp.isnan(x) | (x == jnp.inf), axis=-1)


def _rows(x: jax.Array, ndim: int) -> jax.Array:
    """[B] -> [B, 1, ..., 1] so a per-request knob broadcasts over logits of rank ``ndim``."""
    return x.reshape(x.shape + (1,) * (ndim - 1))


def _point_mass_logits(x: jax.Array) -> jax.Array:
    """0 at the argmax (first index on ties), -inf elsewhere."""
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)  # [..., V]
    top = jnp.argmax(x, axis=-1)[..., None]  # [..., 1]
    return jnp.where(vocab_ids == top, 0.0, -jnp.inf).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("cfg",))
def transform_logits(
    logits: jax.Array, params: SamplingParams | None, cfg: SamplingConfig
) -> jax.Array:
    """Logits of the exact sampling distribution: scaled, with removed tokens at ``-inf``.

    Args:
      logits: ``[B, ..., V]`` (any float dtype; computed in float32 or wider).
      params: per-row knobs ``[B]`` (may be None in greedy mode).
      cfg: static stage switches.

    Returns:
      ``[B, ..., V]`` float logits; ``softmax`` of them is the distribution tokens are drawn from.
      Jitted (``cfg`` static), also traceable inside other jitted code; never raises.
    """
    x = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # [B, ..., V]
    if cfg.greedy:
        return _point_mass_logits(x)
    z, greedy_row = _filtered(x, params, cfg)
    return jnp.where(greedy_row, _point_mass_logits(x), z)


def _filtered(x: jax.Array, params: SamplingParams, cfg: SamplingConfig):
    """The sampled mode's transform before greedy rows become point masses: ``(z, greedy_row)``,
    z ``[B, ..., V]`` the scaled logits (greedy rows unscaled) with removed tokens at ``-inf``,
    greedy_row ``[B, 1.., 1]``. Every stage keeps a row's largest logits (ties included), so a
    greedy row's argmax of z is the argmax of x."""
    vocab = x.shape[-1]
    temperature = _rows(params.temperature.astype(x.dtype), x.ndim)  # [B, 1.., 1]
    greedy_row = temperature == 0
    z = x / jnp.where(greedy_row, 1.0, temperature)  # [B, ..., V]
    keep = jnp.ones(z.shape, bool)
    if cfg.top_k or cfg.top_p:
        z_sorted = -jnp.sort(-z, axis=-1)  # [B, ..., V] descending
        if cfg.top_k:
            k = _rows(params.top_k, x.ndim)
            k = jnp.where(k <= 0, vocab, jnp.minimum(k, vocab))  # [B, 1.., 1]
            kth = jnp.take_along_axis(z_sorted, jnp.broadcast_to(k - 1, z.shape[:-1] + (1,)), -1)
            keep = keep & (z >= kth)
            z_sorted = jnp.where(z_sorted >= kth, z_sorted, -jnp.inf)
        if cfg.top_p:
            p_sorted = jax.nn.softmax(z_sorted, axis=-1)  # [B, ..., V]
            mass_before = jnp.cumsum(p_sorted, axis=-1) - p_sorted
            top_p = _rows(params.top_p.astype(x.dtype), x.ndim)
            n_keep = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)  # [B, ..., 1]
            n_keep = jnp.clip(n_keep, 1, vocab)
            last_kept = jnp.take_along_axis(z_sorted, n_keep - 1, axis=-1)  # [B, ..., 1]
            keep = keep & ((top_p >= 1) | (z >= last_kept))
    if cfg.min_p:
        min_p = _rows(params.min_p.astype(x.dtype), x.ndim)
        z_max = jnp.max(z, axis=-1, keepdims=True)
        # p >= min_p * p_max  <=>  z >= z_max + log(min_p); log(0) = -inf keeps everything.
        keep = keep & (z >= z_max + jnp.log(min_p))
    return jnp.where(keep, z, -jnp.inf), greedy_row


def sample_transformed(
    noise: jax.Array, logits: jax.Array, params: SamplingParams | None, cfg: SamplingConfig
) -> jax.Array:
    """``sample_with_noise(noise, transform_logits(logits, params, cfg))`` [...] int32, the
    same token, with one reduction over the vocabulary instead of two: a greedy row takes the
    argmax of its filtered logits (the point mass's token) without building the point mass.
    ``noise`` from :func:`gumbel_noise` (unused, may be None, in greedy mode)."""
    x = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    if cfg.greedy:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    z, greedy_row = _filtered(x, params, cfg)
    return sample_with_noise(jnp.where(greedy_row, 0.0, noise), z)


def probs_of_draws(
    logits: jax.Array, tokens: jax.Array, params: SamplingParams | None, cfg: SamplingConfig
) -> jax.Array:
    """``probs_from_logits(logits, params, cfg)`` for logits whose ``tokens`` [...] were drawn
    by :func:`sample_transformed`: a greedy row's point mass is the one-hot of its token (the
    argmax), so no second argmax is taken. Not for tokens drawn otherwise (forced tokens)."""
    x = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    one_hot = jax.nn.one_hot(tokens, x.shape[-1], dtype=x.dtype)
    if cfg.greedy:
        return one_hot
    z, greedy_row = _filtered(x, params, cfg)
    return jnp.where(greedy_row, one_hot, jax.nn.softmax(z, axis=-1))


@functools.partial(jax.jit, static_argnames=("cfg",))
def probs_from_logits(
    logits: jax.Array, params: SamplingParams | None, cfg: SamplingConfig
) -> jax.Array:
    """``softmax(transform_logits(...))``: ``[B, ..., V]`` probabilities (float32 or wider)."""
    return jax.nn.softmax(transform_logits(logits, params, cfg), axis=-1)


def gumbel_noise(keys: jax.Array, num_classes: int, dtype=jnp.float32) -> jax.Array:
    """The Gumbel noise [..., V] that :func:`sample_from_logits` adds for each key of ``keys``.

    A loop that draws one token per step (a drafter's γ slots) can make all its noise with one
    vectorised call before the loop and draw with :func:`sample_with_noise` inside it: the same
    tokens bit for bit, and on CPU one threefry pass instead of one per step (CPU JAX runs
    threefry as a rolled loop of small ops; the per-slot draws were about a third of the demo
    drafters' γ = 7 proposal, docs/MEASUREMENTS.md: decode_paths).

    The keys are made before the noise (an optimization barrier): XLA would otherwise fuse a
    key's derivation (`fold_in`s of seed and position) into the fusion that hashes each of its V
    elements and recompute it per element; with threefry unrolled (`xla_cpu.unrolled_threefry`)
    that made sampled decoding at batch 32 0.94x instead of 1.05x (benchmarks/ab.py threefry).
    """
    flat = jnp.reshape(keys, (-1,))
    flat = jax.random.wrap_key_data(
        jax.lax.optimization_barrier(jax.random.key_data(flat)), impl=jax.random.key_impl(flat)
    )
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (num_classes,), dtype))(flat)
    return noise.reshape(*jnp.shape(keys), num_classes)


def sample_with_noise(noise: jax.Array, logits: jax.Array) -> jax.Array:
    """Gumbel-max draw ``argmax(noise + logits)`` [...] with noise from :func:`gumbel_noise`."""
    return jnp.argmax(noise + logits, axis=-1).astype(jnp.int32)


@jax.jit
def sample_from_logits(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """One token per row from ``softmax(logits)``; ``keys`` [B] (one key per row), logits [B, V].

    Gumbel-max (``jax.random.categorical``'s draw): a ``-inf`` logit is never drawn. Pass logits
    from :func:`transform_logits`.
    """
    return sample_with_noise(gumbel_noise(keys, logits.shape[-1], logits.dtype), logits)


@jax.jit
def sample_from_probs(keys: jax.Array, probs: jax.Array) -> jax.Array:
    """One token per row from ``probs`` [B, V] (rows need not be normalised); keys [B]."""
    return sample_from_logits(keys, jnp.log(probs))
