"""Batched chain speculative decoding: prefill, propose, verify, commit (jitted), host loop.

One round for every request b (anchor = its last committed token, at position `pos[b]`):

1. the drafter proposes γ tokens and the distributions they were drawn from (+ confidences);
2. the verification length n[b] in 0..γ is chosen — fixed γ, or by a scheduler from the
   confidences (two jitted calls then: `propose_step` and `verify_step`);
3. the target scores `[anchor, d_1..d_γ]` at positions pos..pos+γ in one forward with its KV cache;
4. `spec.verify_core` accepts A drafts and draws the next token (residual or bonus);
5. commit: the target cache length becomes pos + A + 1 (rejected K/V are never read again), the
   drafter context gets the target features of positions pos..pos+A, the next token becomes the
   new anchor at pos + A + 1.

All randomness is keyed by (stream, request seed, position) (`spec.rng`), so a request's output
does not depend on which other requests share the batch. Greedy (`SamplingConfig(greedy=True)`)
output equals plain greedy decoding token for token; sampled output follows the target's
distribution exactly (tests/test_speculative.py).

Stop tokens and `max_new_tokens` are handled on the host after each round: an accepted stop draft
truncates the round (recorded without a bonus token, REFERENCE §6.2 step 5).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import drafters
from dspark_jax.buckets import DECODER_LENGTH_BUCKETS, bucket_up
from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.errors import ConfigError
from dspark_jax.models.generate import sample_tokens
from dspark_jax.models.transformer import KVCache, forward, init_cache
from dspark_jax.spec import rng as rng_lib
from dspark_jax.spec.sampling import (
    SamplingConfig,
    SamplingParams,
    validate_sampling_params,
)
from dspark_jax.spec.verify import verify_core


class SpecState(NamedTuple):
    """Device state of a batch of requests between rounds (a pytree of arrays)."""

    cache: KVCache  # target KV cache; cache.lengths[b] = position of b's anchor
    ctx: object  # drafter context; ctx.lengths == cache.lengths
    anchor: jax.Array  # [B] int32, committed but not yet fed to the target


class RoundOut(NamedTuple):
    emitted: jax.Array  # [B, γ+1] committed tokens of this round (-1 past A+1)
    num_accepted: jax.Array  # [B] accepted drafts A
    conf_logits: jax.Array | None  # [B, γ]


def prefill(
    tcfg: TargetConfig,
    dcfg: DrafterConfig,
    scfg: SamplingConfig,
    max_len: int,
    tparams,
    dparams,
    tokens_BxT,
    lengths_B,
    key,
    seeds_B,
    sp: SamplingParams | None,
) -> SpecState:
    """Prefill the target and the drafter on right-padded prompts; sample the first token.

    Static: configs, max_len, shapes. Arrays: params, tokens [B, T], lengths [B] (≥ 1), key,
    seeds [B], sampling params [B]. The first token is drawn like plain decoding's (stream SAMPLE
    at position lengths[b]).
    """
    b, t = tokens_BxT.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cache = init_cache(tcfg, b, max_len)
    out, cache = forward(tcfg, tparams, tokens_BxT, positions, cache)
    last = jnp.take_along_axis(out.logits, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    # drawn exactly like plain decoding's token at that position (spec.rng SAMPLE stream)
    first = sample_tokens(
        last, rng_lib.stream_key(key, rng_lib.SAMPLE), seeds_B, lengths_B, sp, scfg
    )
    cache = cache.with_lengths(lengths_B)
    # next_tokens[t] = the committed token at position t + 1 (Eagle3 pairs feature t with it).
    shifted = jnp.concatenate([tokens_BxT[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
    idx = jnp.arange(t)[None, :]
    next_tokens = jnp.where(idx == (lengths_B - 1)[:, None], first[:, None], shifted)
    ctx = drafters.prefill_context(dcfg, dparams, out.features, next_tokens, lengths_B, max_len)
    return SpecState(cache, ctx, first)


def propose_step(dcfg, scfg, dparams, state: SpecState, key, seeds_B, sp):
    """Draft γ tokens for every request. Static: dcfg, scfg."""
    return drafters.propose(
        dcfg, dparams, state.ctx, state.anchor, key, seeds_B, None if scfg.greedy else sp, scfg
    )


def verify_step(
    tcfg, dcfg, scfg, tparams, dparams, state: SpecState, proposal, lengths_B, key, seeds_B, sp
) -> tuple[SpecState, RoundOut]:
    """Verify the first lengths[b] drafts of `proposal` and commit. Static: configs, scfg."""
    g = dcfg.block_size
    pos = state.cache.lengths  # [B]
    toks = jnp.concatenate([state.anchor[:, None], proposal.tokens], axis=1)  # [B, γ+1]
    positions = pos[:, None] + jnp.arange(g + 1, dtype=jnp.int32)[None, :]
    out, cache = forward(tcfg, tparams, toks, positions, state.cache)
    rng = rng_lib.RequestRng(key, seeds_B, pos)
    probs = None if scfg.greedy else proposal.probs
    a, nxt = verify_core(out.logits, proposal.tokens, probs, lengths_B, rng, sp, scfg)
    cache = cache.with_lengths(pos + a + 1)
    i = jnp.arange(g + 1)[None, :]
    drafts_pad = jnp.concatenate([proposal.tokens, jnp.zeros_like(nxt)[:, None]], axis=1)
    next_tokens = jnp.where(i < a[:, None], drafts_pad, nxt[:, None])  # [B, γ+1]
    ctx = drafters.extend_context(dcfg, dparams, state.ctx, out.features, next_tokens, a + 1)
    emitted = jnp.where(i <= a[:, None], next_tokens, -1)
    return SpecState(cache, ctx, nxt), RoundOut(emitted, a, proposal.conf_logits)


def fused_round(tcfg, dcfg, scfg, tparams, dparams, state, lengths_B, key, seeds_B, sp):
    """propose + verify + commit in one call (fixed or precomputed verification lengths)."""
    prop = propose_step(dcfg, scfg, dparams, state, key, seeds_B, sp)
    return verify_step(tcfg, dcfg, scfg, tparams, dparams, state, prop, lengths_B, key, seeds_B, sp)


@dataclasses.dataclass
class RequestResult:
    """One request's output and per-round records (REFERENCE §6.2–6.3 conventions)."""

    tokens: list[int]  # generated tokens (the first one comes from the prefill)
    num_accepted: list[int]  # per round: accepted drafts A (truncated at an accepted stop draft)
    proposed: list[int]  # per round: verified proposal length n (= A when it ended on a stop)
    eos: list[bool]  # per round: ended on an accepted stop draft (no bonus token)
    conf_logits: list[np.ndarray]  # per round [γ] confidence logits (DSpark), else empty


class SpeculativeDecoder:
    """Jitted batched speculative generation for one (target, drafter) pair.

    Static structure: configs, `max_len`, the batch size, the prompt-length buckets and the
    sampling structure (`SamplingConfig`). Per request: prompt, seed, temperature / top-k /
    top-p / min-p. A `policy` (callable conf_logits [B, γ] np -> lengths [B]) turns on scheduled
    verification; without it every round verifies all γ drafts (paper Table 1 setting).
    """

    def __init__(
        self,
        tcfg: TargetConfig,
        dcfg: DrafterConfig,
        tparams,
        dparams,
        *,
        max_len: int = 1024,
        length_buckets: tuple[int, ...] = DECODER_LENGTH_BUCKETS,
        root_seed: int = 0,
    ):
        if dcfg.target.hidden_size != tcfg.hidden_size or dcfg.target.vocab_size != tcfg.vocab_size:
            raise ConfigError("drafter was built for a different target (hidden size / vocab)")
        self.tcfg, self.dcfg = tcfg, dcfg
        self.tparams, self.dparams = tparams, dparams
        self.max_len = max_len
        self.length_buckets = tuple(sorted(length_buckets))
        self.key = jax.random.key(root_seed)
        self._prefill = jax.jit(prefill, static_argnums=(0, 1, 2, 3))
        self._propose = jax.jit(propose_step, static_argnums=(0, 1))
        self._verify = jax.jit(verify_step, static_argnums=(0, 1, 2), donate_argnums=(5,))
        self._fused = jax.jit(fused_round, static_argnums=(0, 1, 2), donate_argnums=(5,))

    def _bucket(self, n: int) -> int:
        b = bucket_up(n, self.length_buckets)
        if b is not None:
            return b
        raise ConfigError(
            f"prompt of {n} tokens exceeds the largest length bucket {self.length_buckets[-1]}"
        )

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        seeds=None,
        stop_ids=(),
        policy=None,
    ) -> list[RequestResult]:
        """Generate for a batch of prompts (padded to a length bucket). Returns per-request
        tokens and per-round records (accepted length, proposal length, confidences)."""
        b = len(prompts)
        if b == 0:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ConfigError("empty prompt: every request needs at least one token")
        longest = max(len(p) for p in prompts)
        t = self._bucket(longest)
        g = self.dcfg.block_size
        if longest + max_new_tokens + g + 1 > self.max_len:
            raise ConfigError(
                f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) + γ+1 ({g + 1}) exceeds "
                f"the cache length max_len={self.max_len}; raise max_len or shorten the request"
            )
        sp = validate_sampling_params(temperature, top_k, top_p, min_p, batch_size=b)
        scfg = SamplingConfig.for_params(sp)
        seeds = np.arange(b) if seeds is None else np.asarray(seeds)
        seeds_j = jnp.asarray(seeds, jnp.uint32)
        toks = np.zeros((b, t), np.int32)
        for i, p in enumerate(prompts):
            toks[i, : len(p)] = p
        lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
        state = self._prefill(
            self.tcfg,
            self.dcfg,
            scfg,
            self.max_len,
            self.tparams,
            self.dparams,
            jnp.asarray(toks),
            lengths,
            self.key,
            seeds_j,
            sp,
        )
        stop = set(int(s) for s in stop_ids)
        results = [RequestResult([], [], [], [], []) for _ in range(b)]
        first = np.asarray(state.anchor)
        done = np.zeros(b, bool)
        for i in range(b):
            results[i].tokens.append(int(first[i]))
            if int(first[i]) in stop or max_new_tokens <= 1:
                done[i] = True
        full = jnp.full((b,), g, jnp.int32)
        while not done.all():
            if policy is None:
                state, out = self._fused(
                    self.tcfg,
                    self.dcfg,
                    scfg,
                    self.tparams,
                    self.dparams,
                    state,
                    full,
                    self.key,
                    seeds_j,
                    sp,
                )
                n = np.full(b, g)
            else:
                prop = self._propose(self.dcfg, scfg, self.dparams, state, self.key, seeds_j, sp)
                conf = None if prop.conf_logits is None else np.asarray(prop.conf_logits)
                n = np.asarray(policy(conf), np.int32).reshape(b)
                state, out = self._verify(
                    self.tcfg,
                    self.dcfg,
                    scfg,
                    self.tparams,
                    self.dparams,
                    state,
                    prop,
                    jnp.asarray(n),
                    self.key,
                    seeds_j,
                    sp,
                )
            emitted = np.asarray(out.emitted)
            a = np.asarray(out.num_accepted)
            conf = None if out.conf_logits is None else np.asarray(out.conf_logits)
            for i in np.nonzero(~done)[0]:
                r = results[i]
                new = [int(x) for x in emitted[i, : a[i] + 1]]
                room = max_new_tokens - len(r.tokens)
                acc, nn, eos = int(a[i]), int(n[i]), False
                for j, tok in enumerate(new):
                    if tok in stop:
                        done[i] = True
                        if j < acc:  # an accepted stop draft ends the round without a bonus
                            acc, nn, eos = j + 1, j + 1, True
                        new = new[: j + 1]
                        break
                r.num_accepted.append(acc)
                r.proposed.append(nn)
                r.eos.append(eos)
                if conf is not None:
                    r.conf_logits.append(conf[i])
                if len(new) >= room:
                    new = new[:room]
                    done[i] = True
                r.tokens.extend(new)
        return results
