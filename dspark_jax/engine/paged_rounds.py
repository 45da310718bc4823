"""Device-resident rounds on the paged KV cache: `rounds.packed_rounds` with the paged round.

The block tables are a loop invariant of the call: the host grows every running request's
pages for K rounds (pos + K·(γ+1) positions, capped at its whole length) before the call, and
passes the tables at the full width (max_len / page_size), so the loop never needs the host.
Each round's token bucket T is chosen on the device as the host would choose it, by `lax.switch`
over read-only verify forwards (`paged_verify(write=False)`), whose K/V (padded to the largest
bucket) are written after the switch; with one token bucket the forward writes in place. The
lengths, stops and budgets are `engine.rounds`' (`device_lengths`, `_finished`), so a request's
tokens do not depend on K.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dspark_jax.engine import rounds as rounds_lib
from dspark_jax.engine.paged_device import paged_finish, paged_verify
from dspark_jax.engine.rounds import RoundsSpec
from dspark_jax.models.paged import PagedNewKV, write_new_kv


def _padded(kv: PagedNewKV, max_tokens: int) -> PagedNewKV:
    pad = max_tokens - kv.slots.shape[0]
    grow = lambda x: jnp.pad(x, ((0, pad), (0, 0), (0, 0)))
    slots = jnp.pad(kv.slots, (0, pad), constant_values=-1)
    return PagedNewKV(tuple(map(grow, kv.k)), tuple(map(grow, kv.v)), slots)


def _branch(tcfg, dcfg, num_tokens, max_tokens, tparams, state, lengths, active, tables):
    logits, feats, kv = paged_verify(tcfg, dcfg, num_tokens, tparams, state, lengths, active,
                                     tables, write=False)  # fmt: skip
    return logits, feats, _padded(kv, max_tokens)


def _verify(spec: RoundsSpec, tparams, state, lengths, active, tables):
    tcfg, dcfg, _, token_buckets = spec[:4]
    if len(token_buckets) == 1:
        return paged_verify(tcfg, dcfg, token_buckets[0], tparams, state, lengths, active, tables)
    top = max(token_buckets)
    branches = [functools.partial(_branch, tcfg, dcfg, t, top) for t in token_buckets]
    tb = jnp.asarray(token_buckets, jnp.int32)
    total = jnp.sum(jnp.where(active, lengths + 1, 0))
    it = jnp.minimum(jnp.searchsorted(tb, total, side="left"), len(token_buckets) - 1)
    logits, feats, kv = jax.lax.switch(it, branches, tparams, state, lengths, active, tables)
    return logits, feats, write_new_kv(state.cache, kv)


def paged_rounds(spec: RoundsSpec, tparams, dparams, state, inp):
    """Up to min(n_rounds, max_rounds) rounds (`state` donated), `inp` = (RoundsInputs, tables
    [N, B]); the loop ends after a round in which any row finishes. Returns (state,
    RoundsOut)."""
    inp, tables = inp

    def one_round(state, lengths):
        fwd = _verify(spec, tparams, state, lengths, inp.active, tables)
        return paged_finish(spec.dcfg, spec.scfg, dparams, state, fwd, lengths, inp.active,
                            inp.seeds, inp.sampling, inp.key, tables)  # fmt: skip

    return rounds_lib.resident_loop(spec, state, inp, one_round)
