"""Device side of the serving engine on a paged KV cache (`EngineConfig(kv_layout="paged")`).

The target's K/V live in page pools (`models.paged.PagedKVCache`) and the drafter's context in
pools under the same block tables (`drafters.paged_context`); the host's `engine.pages.PagePool`
says which pages each request holds and passes its table with every call. Per-row state (anchor
position, anchor, round counter, pending proposal) stays dense per slot (`PagedState`).

`paged_prefill_chunk` writes one prompt chunk of one slot (`paged_forward` with R = 1 row,
request-major); the last chunk draws the first token like `device.prefill_chunk` or, for a
request resumed after a preemption (recompute), takes the anchor it had (`PagedPrefillInputs.
anchor` >= 0) and its round counter, so its next proposal, and so its tokens, are the ones it
would have had without the preemption. `paged_round` is `device.packed_round` with the paged
verify forward (request-major, `q_per_req = γ + 1`) and the drafter extending and reading its
own pages under the same tables (`paged_context`) in `device.finish_round`.

Static shapes: the table width B (a cache bucket / page_size, rounded up) comes with the tables;
one program per (mode, T, B) round and (mode, chunk, B) prefill, as the dense engine's (T, S).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax import drafters
from dspark_jax.drafters.paged_context import PagedContext, init_paged_context, with_tables
from dspark_jax.engine.device import (
    PrefillInputs,
    PrefillSpec,
    RoundInputs,
    RoundSpec,
    SlotState,
    _conf_or_zeros,
    _put_slot,
    _take_slot,
    chunk_finite,
    finish_round,
    pack_indices,
)
from dspark_jax.models.decoding import _lm_logits
from dspark_jax.models.generate import sample_tokens
from dspark_jax.models.paged import PagedKVCache, init_paged_cache, paged_forward
from dspark_jax.spec import rng as rng_lib


class PagedState(NamedTuple):
    cache: PagedKVCache  # target K/V pools [P, page, n_kv, d] per layer
    ctx: PagedContext  # drafter K/V pools + dense per-row fields [N]
    pos: jax.Array  # [N] int32, each slot's anchor position (the dense cache.lengths)
    anchor: jax.Array  # [N] int32
    rounds: jax.Array  # [N] int32
    prop_tokens: jax.Array  # [N, γ]
    prop_probs: jax.Array  # [N, γ, V]
    prop_conf: jax.Array  # [N, γ]


class PagedPrefillInputs(NamedTuple):
    base: PrefillInputs
    table: jax.Array  # [1, B] int32, the slot's block table (padded with page 0)
    anchor: jax.Array  # int32: -1 draws the first token; >= 0 resumes with this anchor
    rounds: jax.Array  # int32, the round counter to resume with (0 for a new request)


class PagedRoundInputs(NamedTuple):
    base: RoundInputs
    tables: jax.Array  # [N, B] int32, each slot's block table (free slots: zeros)


class _Lens(NamedTuple):
    """The dense cache's `lengths` / `with_lengths`, all `finish_round` reads of it."""

    lengths: jax.Array

    def with_lengths(self, lengths):
        return _Lens(lengths)


def init_paged_state(tcfg, dcfg, num_slots: int, num_pages: int, page_size: int) -> PagedState:
    g, v = dcfg.block_size, tcfg.vocab_size
    return PagedState(
        cache=init_paged_cache(tcfg, num_pages, page_size),
        ctx=init_paged_context(dcfg, num_slots, num_pages, page_size),
        pos=jnp.zeros((num_slots,), jnp.int32),
        anchor=jnp.zeros((num_slots,), jnp.int32),
        rounds=jnp.zeros((num_slots,), jnp.int32),
        prop_tokens=jnp.zeros((num_slots, g), jnp.int32),
        prop_probs=jnp.zeros((num_slots, g, v), jnp.float32),
        prop_conf=jnp.zeros((num_slots, g), jnp.float32),
    )


def paged_prefill_chunk(spec: PrefillSpec, tparams, dparams, state: PagedState, inp):
    """Prompt tokens [start, start + n_valid) of one slot into its pages. Returns (state, first
    token, raw confidence logits [γ]) as `device.prefill_chunk` (meaningful on the last chunk)."""
    tcfg, dcfg, scfg, _ = spec
    base, table_1xB, resume_anchor, resume_rounds = inp
    slot, tokens_C, next_C, start, n_valid, is_last, seed, sp1, key = base
    g = dcfg.block_size
    c = tokens_C.shape[0]
    end = start + n_valid
    cu = jnp.stack([jnp.int32(0), n_valid.astype(jnp.int32)])
    out, cache = paged_forward(tcfg, tparams, tokens_C, cu, end[None].astype(jnp.int32),
                               table_1xB, state.cache, compute_logits=False,
                               q_per_req=c)  # fmt: skip
    last = out.hidden[0, n_valid - 1]  # [H]
    logits = _lm_logits(tcfg, tparams, last[None, None, :])[:, 0]  # [1, V]
    seed1, pos1 = seed[None], end[None]
    drawn = sample_tokens(logits, rng_lib.stream_key(key, rng_lib.SAMPLE), seed1, pos1, sp1, scfg)
    first = jnp.where(resume_anchor >= 0, resume_anchor, drawn[0])[None].astype(jnp.int32)
    idx = jnp.arange(c, dtype=jnp.int32)
    nxt = jnp.where(is_last & (idx == n_valid - 1), first[0], next_C)
    rows1 = _take_slot(state.ctx.rows, slot)._replace(lengths=start[None])
    pc1 = PagedContext(state.ctx.k, state.ctx.v, rows1, table_1xB)
    pc1 = drafters.extend_context(dcfg, dparams, pc1, out.features, nxt[None], n_valid[None])
    rounds1 = resume_rounds[None].astype(jnp.int32)
    prop = drafters.propose(dcfg, dparams, pc1, first, key, seed1, sp1, scfg, rounds_B=rounds1)
    conf = _conf_or_zeros(prop, 1, g)
    ctx = PagedContext(pc1.k, pc1.v, _put_slot(state.ctx.rows, pc1.rows, slot))
    state = PagedState(
        cache=cache,
        ctx=ctx,
        pos=_put_slot(state.pos, pos1, slot),
        anchor=_put_slot(state.anchor, first, slot),
        rounds=_put_slot(state.rounds, rounds1, slot),
        prop_tokens=_put_slot(state.prop_tokens, prop.tokens, slot),
        prop_probs=_put_slot(state.prop_probs, prop.probs.astype(jnp.float32), slot),
        prop_conf=_put_slot(state.prop_conf, conf, slot),
    )
    ok = chunk_finite(logits, out.hidden, n_valid)  # else first -1 (`device.prefill_chunk`)
    return state, jnp.where(ok, first[0], -1), conf[0]


def paged_verify(tcfg, dcfg, num_tokens, tparams, state, lengths_N, active_N, tables, *,
                 write=True):  # fmt: skip
    """The paged verify forward (request-major, bucket T = num_tokens): (logits [N, γ+1, V],
    features [N, γ+1, F], the pools with the tokens' K/V written); `write=False`: the pools only
    read and the last item the tokens' `PagedNewKV` (for `write_new_kv`)."""
    g = dcfg.block_size
    slot, off, valid, starts = pack_indices(lengths_N, active_N, num_tokens)
    drafts = state.prop_tokens[slot, jnp.clip(off - 1, 0, g - 1)]
    toks = jnp.where(off == 0, state.anchor[slot], drafts)
    # The attention's rows: a bucket of T tokens holds at most T requests of at most T tokens
    # each, so the active slots (first, in slot order: the bucket's order) fill R = min(N, T)
    # rows of min(γ + 1, T) queries; small buckets attend over R rows, not N.
    order = round_rows(active_N, num_tokens)
    n_tok = jnp.where(active_N, lengths_N + 1, 0).astype(jnp.int32)[order]
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(n_tok).astype(jnp.int32)])
    kv_lens = jnp.where(n_tok > 0, state.pos[order] + n_tok, 0).astype(jnp.int32)
    out, c = paged_forward(tcfg, tparams, toks, cu, kv_lens, tables[order], state.cache,
                           q_per_req=min(g + 1, num_tokens), write=write)  # fmt: skip
    idx = jnp.clip(starts[:, None] + jnp.arange(g + 1, dtype=jnp.int32)[None, :], 0, num_tokens - 1)
    return out.logits[0][idx], out.features[0][idx], c


def round_rows(active_N, num_tokens: int):
    """[min(N, T)] int32: the slots a round of T tokens serves, the active ones first in slot
    order (a bucket of T tokens holds at most T requests), then inactive ones."""
    rows = min(active_N.shape[0], num_tokens)
    return jnp.argsort(jnp.logical_not(active_N), stable=True)[:rows].astype(jnp.int32)


def paged_finish(dcfg, scfg, dparams, state, fwd, lengths_N, active_N, seeds, sp, key, tables,
                 num_tokens=None):  # fmt: skip
    """`device.finish_round` on the paged state: the drafter extends and reads its pages under
    the rows' tables (`drafters.paged_context`), for the `round_rows` of a bucket of
    `num_tokens` (static; None: every slot). Returns (state, RoundOut)."""
    logits, feats, cache = fwd
    rows = SlotState(_Lens(state.pos), with_tables(state.ctx, tables), state.anchor,
                     state.rounds, state.prop_tokens, state.prop_probs, state.prop_conf)  # fmt: skip
    sel = None if num_tokens is None else round_rows(active_N, num_tokens)
    if sel is not None and sel.shape[0] == active_N.shape[0]:
        sel = None  # every slot: no row selection
    new, ro = finish_round(dcfg, scfg, dparams, rows, (logits, feats, _Lens(state.pos)),
                           lengths_N, active_N, seeds, sp, key, draft_rows=sel)  # fmt: skip
    new_state = PagedState(cache, with_tables(new.ctx, None), new.cache.lengths, new.anchor,
                           new.rounds, new.prop_tokens, new.prop_probs, new.prop_conf)  # fmt: skip
    return new_state, ro


def paged_round(spec: RoundSpec, tparams, dparams, state: PagedState, inp: PagedRoundInputs):
    """One speculative round over the active slots on the pools (`state` donated): (state,
    device.RoundOut), the same tokens as `device.packed_round`."""
    base, tables = inp
    lengths_N = jnp.where(base.active, base.lengths, 0).astype(jnp.int32)
    fwd = paged_verify(spec.tcfg, spec.dcfg, spec.num_tokens, tparams, state, lengths_N,
                       base.active, tables)  # fmt: skip
    return paged_finish(spec.dcfg, spec.scfg, dparams, state, fwd, lengths_N, base.active,
                        base.seeds, base.sampling, base.key, tables, spec.num_tokens)  # fmt: skip
