"""Device side of the serving engine: slot state, slot prefill and one packed speculative round.

Slot state (`SlotState`, static shapes fixed at start-up): the target KV cache and the drafter
context for `num_slots` slots of `max_len` positions, each slot's anchor (last committed token, at
position `cache.lengths[s]`), its round counter and its pending proposal (drafted at the end of
the previous round, or at admission). Inactive slots are masked everywhere (no K/V write, no
commit); their proposal is garbage that nothing reads.

`prefill_chunk` writes a prompt chunk into one slot (`max_len` cache, logits only at the last
valid position); the last chunk also draws the first token exactly like plain decoding (stream
SAMPLE at position prompt_len) and proposes the slot's first draft block.

`packed_round` verifies the scheduled prefixes: the admitted tokens (anchor + l_r drafts for every
active slot) are packed into a flat static bucket of T tokens (`models.packed`), so the target's
cost follows `R + sum l_r`; attention reads are bounded by a cache-length bucket. Then it runs
`spec.verify_core` per slot, commits (cache length, drafter context, anchor) and drafts the next
block with noise keyed by (seed, round counter, position) (`spec.rng.DRAFT_ROUND`).

Both programs take `(spec, tparams, dparams, state, inputs)`: a static, hashable spec (configs,
sampling mode, buckets: `PrefillSpec`, `RoundSpec`) and the arrays as one NamedTuple pytree
(`PrefillInputs`, `RoundInputs`). `engine.programs.EnginePrograms` jits and calls them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax import drafters
from dspark_jax.drafters.paged_context import put_rows, take_rows
from dspark_jax.models import generate as gen
from dspark_jax.models import transformer as tf
from dspark_jax.models.generate import sample_tokens
from dspark_jax.models.packed import packed_forward, packed_forward_kv, write_kv
from dspark_jax.spec import rng as rng_lib
from dspark_jax.spec.verify import verify_core


class SlotState(NamedTuple):
    cache: tf.KVCache  # [N, ...]; cache.lengths[s] = position of slot s's anchor
    ctx: object  # drafter context [N, ...]; ctx.lengths == cache.lengths for active slots
    anchor: jax.Array  # [N] int32
    rounds: jax.Array  # [N] int32, rounds verified since admission (keys the draft noise)
    prop_tokens: jax.Array  # [N, γ] int32, the pending draft block
    prop_probs: jax.Array  # [N, γ, V] fp32, the distributions it was drawn from
    prop_conf: jax.Array  # [N, γ] fp32 raw confidence logits (zeros without a head)


class RoundOut(NamedTuple):
    emitted: jax.Array  # [N, γ+1] committed tokens (-1 past A+1, for inactive and faulty slots)
    num_accepted: jax.Array  # [N]; -1: the slot's verified logits were not finite (`finite_rows`)
    next_conf: jax.Array  # [N, γ] raw confidence logits of the next pending block


def init_state(tcfg, dcfg, num_slots: int, max_len: int) -> SlotState:
    g, v = dcfg.block_size, tcfg.vocab_size
    return SlotState(
        cache=tf.init_cache(tcfg, num_slots, max_len, lookahead=g + 1),  # Gemma 4: rings
        ctx=drafters.init_context(dcfg, num_slots, max_len),
        anchor=jnp.zeros((num_slots,), jnp.int32),
        rounds=jnp.zeros((num_slots,), jnp.int32),
        prop_tokens=jnp.zeros((num_slots, g), jnp.int32),
        prop_probs=jnp.zeros((num_slots, g, v), jnp.float32),
        prop_conf=jnp.zeros((num_slots, g), jnp.float32),
    )


def _take_slot(tree, slot):
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, slot, 1, 0), tree)


def _take_slot_prefix(tree, slot, length: int):
    """Cache arrays [N, K, S, d] -> [1, K, length, d] of one slot (its first `length` positions)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, slot, 1, 0)[:, :, :length], tree)


def _put_slot(tree, one, slot):
    """Write `one` ([1, ...], possibly shorter along later axes) at the start of slot `slot`."""

    def put(a, b):
        idx = (slot,) + (0,) * (a.ndim - 1)
        return jax.lax.dynamic_update_slice(a, b.astype(a.dtype), idx)

    return jax.tree.map(put, tree, one)


def _conf_or_zeros(prop, b, g):
    if prop.conf_logits is None:
        return jnp.zeros((b, g), jnp.float32)
    return prop.conf_logits.astype(jnp.float32)


class PrefillSpec(NamedTuple):
    """`prefill_chunk`'s static part: configs, sampling mode, cache-length bucket."""

    tcfg: object
    dcfg: object
    scfg: object
    cache_len: int


class PrefillInputs(NamedTuple):
    """`prefill_chunk`'s arrays: the slot, the chunk (right-padded), its offset and length."""

    slot: jax.Array  # int32
    tokens: jax.Array  # [C] int32, right-padded
    next_tokens: jax.Array  # [C] the committed token after each (all but the prompt's last)
    start: jax.Array  # int32, the chunk's first position
    n_valid: jax.Array  # int32 >= 1
    is_last: jax.Array  # bool, the prompt's last chunk
    seed: jax.Array  # uint32, the request's seed
    sampling: object  # batch-1 SamplingParams; None in greedy mode
    key: jax.Array  # the engine's root key


class RoundSpec(NamedTuple):
    """`packed_round`'s static part: configs, sampling mode, token bucket T (>= sum over active
    of lengths + 1), cache bucket S (>= every active anchor position + lengths + 1) and the
    verify forward's form (`verify_forward`'s `one_set`)."""

    tcfg: object
    dcfg: object
    scfg: object
    num_tokens: int
    cache_len: int
    one_set: bool = False


class RoundInputs(NamedTuple):
    """`packed_round`'s arrays, one row per slot."""

    lengths: jax.Array  # [N] int32 verified drafts (0..γ)
    active: jax.Array  # [N] bool
    seeds: jax.Array  # [N] uint32
    sampling: object  # SamplingParams [N]; None in greedy mode
    key: jax.Array  # the engine's root key


def prefill_chunk(spec: PrefillSpec, tparams, dparams, state: SlotState, inp: PrefillInputs):
    """Write prompt tokens [start, start + n_valid) of one slot. The chunk's attention reads, and
    the slot's K/V it copies and writes back, stop at `spec.cache_len` (a cache-length bucket
    >= start + n_valid) instead of at max_len.

    Returns (state, first token, raw confidence logits [γ] of the slot's first block); the
    latter two are meaningful only on the last chunk, but a first token of -1 on any chunk says
    its hidden states or logits were not finite (`chunk_finite`).
    """
    tcfg, dcfg, scfg, cache_len = spec
    slot, tokens_C, next_C, start, n_valid, is_last, seed, sp1, key = inp
    g = dcfg.block_size
    c = tokens_C.shape[0]
    s_b = min(int(cache_len), state.cache.max_len)
    cache1 = tf.KVCache(
        _take_slot_prefix(state.cache.k, slot, s_b),
        _take_slot_prefix(state.cache.v, slot, s_b),
        start[None],
    )
    logits, out, cache1 = _prefill_target(tcfg, tparams, tokens_C, start, n_valid, cache1, s_b)
    seed1 = seed[None]
    pos1 = (start + n_valid)[None]
    first = sample_tokens(logits, rng_lib.stream_key(key, rng_lib.SAMPLE), seed1, pos1, sp1, scfg)
    idx = jnp.arange(c, dtype=jnp.int32)
    nxt = jnp.where(is_last & (idx == n_valid - 1), first[0], next_C)
    ctx1 = _take_slot(state.ctx, slot)
    ctx1 = ctx1._replace(lengths=start[None])
    ctx1 = drafters.extend_context(dcfg, dparams, ctx1, out.features, nxt[None], n_valid[None])
    rounds1 = jnp.zeros((1,), jnp.int32)
    prop = drafters.propose(dcfg, dparams, ctx1, first, key, seed1, sp1, scfg, rounds_B=rounds1)
    conf = _conf_or_zeros(prop, 1, g)
    cache = state.cache._replace(
        k=_put_slot(state.cache.k, cache1.k, slot),  # writes [slot, :, :s_b] back
        v=_put_slot(state.cache.v, cache1.v, slot),
        lengths=jax.lax.dynamic_update_slice_in_dim(state.cache.lengths, pos1, slot, 0),
    )
    state = SlotState(
        cache=cache,
        ctx=_put_slot(state.ctx, ctx1, slot),
        anchor=_put_slot(state.anchor, first, slot),
        rounds=_put_slot(state.rounds, rounds1, slot),
        prop_tokens=_put_slot(state.prop_tokens, prop.tokens, slot),
        prop_probs=_put_slot(state.prop_probs, prop.probs.astype(jnp.float32), slot),
        prop_conf=_put_slot(state.prop_conf, conf, slot),
    )
    return state, jnp.where(chunk_finite(logits, out.hidden, n_valid), first[0], -1), conf[0]


def _prefill_target(tcfg, tparams, tokens_C, start, n_valid, cache1, cache_len):
    """(logits [1, V] at the last valid token, ForwardOut [1, C, ...], the one-slot cache with the
    chunk's K/V) for prompt tokens [start, start + n_valid). Generate's prefill, fed at the
    chunk's offset in the slot; with Gemma 4 sliding-layer rings the packed forward, which
    reads the cache before writing it (a chunk may bring more tokens than a ring holds)."""
    if all(k.shape[2] == cache1.max_len for k in cache1.k):
        return gen.prefill(tcfg, tparams, tokens_C[None], n_valid[None], cache1,
                           start_B=start[None])  # fmt: skip
    c = tokens_C.shape[0]
    off = jnp.arange(c, dtype=jnp.int32)
    slot, valid = jnp.zeros((c,), jnp.int32), off < n_valid
    out, kv = packed_forward_kv(tcfg, tparams, tokens_C, slot, off, start + off, valid, cache1,
                                cache_len, compute_logits=False)  # fmt: skip
    last = jax.lax.dynamic_index_in_dim(out.hidden[0], n_valid - 1, keepdims=True)  # [1, H]
    logits = tf.build(tcfg, tparams).logits(last[None])[:, 0]
    return logits, out, write_kv(cache1, kv).with_lengths(start[None] + n_valid)


def chunk_finite(logits_1xV, hidden_1xCxH, n_valid):
    """Whether a prefill chunk's valid hidden states and its last logits are finite (else the
    chunk reports first token -1 and the request ends with an error: a non-finite K/V entry is
    read as 0 by later positions, `models.layers`, so the NaN must be caught where it arises)."""
    valid = jnp.arange(hidden_1xCxH.shape[1])[None, :, None] < n_valid
    return jnp.all(jnp.isfinite(logits_1xV)) & jnp.all(jnp.isfinite(hidden_1xCxH) | ~valid)


def finite_rows(logits_NxGxV, num_accepted_N, lengths_N, probs_NxGxV=None):
    """[N] bool: every value a row's verification read is finite: the target's logits at
    positions 0..A (the accepted drafts' and the bonus token's; a rejected draft's later logits
    are never read) and, when sampling, the draft distributions of the verified drafts up to the
    first rejected one. A row that fails it reports num_accepted -1 and emits nothing (its
    request ends with an error, `engine.commit`); no other row's values depend on it."""
    ok = jnp.all(jnp.isfinite(logits_NxGxV), axis=-1)  # [N, γ+1]
    i = jnp.arange(ok.shape[1])[None, :]
    ok = jnp.all(ok | (i > num_accepted_N[:, None]), axis=1)
    if probs_NxGxV is None:
        return ok
    read = (i[:, :-1] <= num_accepted_N[:, None]) & (i[:, :-1] < lengths_N[:, None])  # [N, γ]
    q_ok = jnp.all(jnp.isfinite(probs_NxGxV), axis=-1) | ~read
    return ok & jnp.all(q_ok, axis=1)


def pack_indices(lengths_N, active_N, num_tokens: int):
    """Flat layout of the admitted tokens: slot, offset in the slot's block, validity [T], and
    each slot's start offset [N]. Slot s contributes lengths[s] + 1 tokens when active."""
    n_tok = jnp.where(active_N, lengths_N + 1, 0).astype(jnp.int32)
    ends = jnp.cumsum(n_tok)
    starts = ends - n_tok
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    slot = jnp.clip(jnp.searchsorted(ends, t, side="right"), 0, n_tok.shape[0] - 1)
    offset = t - starts[slot]
    valid = t < ends[-1]
    return slot.astype(jnp.int32), jnp.where(valid, offset, 0), valid, starts


def packed_round(spec: RoundSpec, tparams, dparams, state: SlotState, inp: RoundInputs):
    """One speculative round over the active slots (`state` donated). Returns (state,
    RoundOut)."""
    lengths_N = jnp.where(inp.active, inp.lengths, 0).astype(jnp.int32)
    fwd = verify_forward(spec.tcfg, spec.dcfg, spec.num_tokens, spec.cache_len, tparams, state,
                         lengths_N, inp.active, one_set=spec.one_set)  # fmt: skip
    return finish_round(spec.dcfg, spec.scfg, dparams, state, fwd, lengths_N, inp.active,
                        inp.seeds, inp.sampling, inp.key)  # fmt: skip


def verify_forward(
    tcfg, dcfg, num_tokens, cache_len, tparams, state, lengths_N, active_N, *, write=True,
    one_set=False,
):  # fmt: skip
    """The target's packed verify forward (bucket T = num_tokens, attention over cache_len):
    (logits [N, γ+1, V], features [N, γ+1, F], the cache with the tokens' K/V written); with
    `write=False` the cache is only read and the last item is the tokens' K/V
    (`models.packed.NewKV`, for `write_kv`). `one_set` (with `write`): `models.packed`'s cheaper
    form (the tokens' own K/V read back from the cache in one key set), equal to the default up
    to float reassociation, so one engine runs one form in all its round programs
    (`EnginePrograms` decides)."""
    g = dcfg.block_size
    pos0 = state.cache.lengths  # [N]
    slot, off, valid, starts = pack_indices(lengths_N, active_N, num_tokens)
    drafts = state.prop_tokens[slot, jnp.clip(off - 1, 0, g - 1)]
    toks = jnp.where(off == 0, state.anchor[slot], drafts)
    pos = pos0[slot] + off
    common = (tcfg, tparams, toks, slot, off, pos, valid, state.cache, cache_len)
    if write:
        out, c = packed_forward(*common, slot_tokens=g + 1, one_set=one_set)
    else:
        out, c = packed_forward_kv(*common, slot_tokens=g + 1)
    idx = jnp.clip(starts[:, None] + jnp.arange(g + 1, dtype=jnp.int32)[None, :], 0, num_tokens - 1)
    return out.logits[0][idx], out.features[0][idx], c


def finish_round(dcfg, scfg, dparams, state, fwd, lengths_N, active_N, seeds_N, sp, key,
                 draft_rows=None):  # fmt: skip
    """Verify, commit (cache length, drafter context, anchor, round counter) and draft the next
    block, from `verify_forward`'s outputs. Returns (state, RoundOut).

    `draft_rows` [M] (distinct slots, M static; None: every slot; a paged context only): the
    drafter extends and proposes for these rows only, the others keep their context and pending
    block (the paged round drafts the round's rows, `paged_device.paged_finish`; a slot outside
    them must be inactive). A row's proposal does not depend on which other rows are drafted with it."""
    g = dcfg.block_size
    n = lengths_N.shape[0]
    logits, feats, cache = fwd
    pos0 = state.cache.lengths
    rng = rng_lib.RequestRng(key, seeds_N, pos0)
    probs = None if scfg.greedy else state.prop_probs
    a, nxt = verify_core(logits, state.prop_tokens, probs, lengths_N, rng, sp, scfg)
    num_new = jnp.where(active_N, a + 1, 0)
    cache = cache.with_lengths(pos0 + num_new)
    i = jnp.arange(g + 1)[None, :]
    drafts_pad = jnp.concatenate([state.prop_tokens, jnp.zeros((n, 1), jnp.int32)], axis=1)
    next_tokens = jnp.where(i < a[:, None], drafts_pad, nxt[:, None])  # [N, γ+1]
    anchor = jnp.where(active_N, nxt, state.anchor)
    rounds = state.rounds + active_N.astype(jnp.int32)
    ok = finite_rows(logits, a, lengths_N, probs)
    emitted = jnp.where((i <= a[:, None]) & (active_N & ok)[:, None], next_tokens, -1)
    draft = lambda ctx, sel: _draft(dcfg, scfg, dparams, ctx, key, sel, feats, next_tokens,
                                    num_new, anchor, seeds_N, sp, rounds)  # fmt: skip
    if draft_rows is None:  # every row: the drafter's outputs are the state's
        ctx_n, prop = draft(state.ctx, slice(None))
        conf = _conf_or_zeros(prop, n, g)
        toks, probs_n = prop.tokens, prop.probs.astype(jnp.float32)
    else:
        ctx, prop = draft(take_rows(state.ctx, draft_rows), draft_rows)
        ctx_n = put_rows(state.ctx, ctx, draft_rows)
        put = lambda whole, part: whole.at[draft_rows].set(part.astype(whole.dtype))
        conf = put(state.prop_conf, _conf_or_zeros(prop, draft_rows.shape[0], g))
        toks, probs_n = put(state.prop_tokens, prop.tokens), put(state.prop_probs, prop.probs)
    new_state = SlotState(cache, ctx_n, anchor, rounds, toks, probs_n, conf)
    return new_state, RoundOut(emitted, jnp.where(ok, a, -1), conf)


def _draft(dcfg, scfg, dparams, ctx, key, sel, feats, next_tokens, num_new, anchor, seeds, sp,
           rounds):  # fmt: skip
    """The drafter's extension and next proposal for rows `sel` of the per-row arrays (`ctx`:
    those rows' context already). Returns (ctx, Proposal)."""
    pick = lambda tree: jax.tree.map(lambda x: x[sel], tree)
    ctx = drafters.extend_context(dcfg, dparams, ctx, feats[sel], next_tokens[sel], num_new[sel])
    prop = drafters.propose(dcfg, dparams, ctx, anchor[sel], key, seeds[sel], pick(sp), scfg,
                            rounds_B=rounds[sel])  # fmt: skip
    return ctx, prop
