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
from dspark_jax.engine.rounds import RoundsOut, RoundsSpec
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
    g = spec.dcfg.block_size
    n = inp.active.shape[0]
    k_max = spec.max_rounds

    def body(carry):
        k, state, room, outs, _ = carry
        lengths = rounds_lib.device_lengths(state, inp.active, room, inp.gamma_p,
                                            inp.use_threshold, inp.cuts)  # fmt: skip
        fwd = _verify(spec, tparams, state, lengths, inp.active, tables)
        state, ro = paged_finish(spec.dcfg, spec.scfg, dparams, state, fwd, lengths, inp.active,
                                 inp.seeds, inp.sampling, inp.key, tables)  # fmt: skip
        done = rounds_lib._finished(ro, inp, room)
        room = room - (ro.num_accepted + 1)
        outs = RoundsOut(
            outs.emitted.at[k].set(ro.emitted),
            outs.num_accepted.at[k].set(ro.num_accepted),
            outs.lengths.at[k].set(lengths),
            outs.next_conf.at[k].set(ro.next_conf),
            k + 1,
        )
        go = (k + 1 < jnp.minimum(inp.n_rounds, k_max)) & ~jnp.any(done)
        return k + 1, state, room, outs, go

    outs = RoundsOut(
        jnp.full((k_max, n, g + 1), -1, jnp.int32),
        jnp.zeros((k_max, n), jnp.int32),
        jnp.zeros((k_max, n), jnp.int32),
        jnp.zeros((k_max, n, g), jnp.float32),
        jnp.int32(0),
    )
    room = jnp.asarray(inp.room, jnp.int32)
    carry = (jnp.int32(0), state, room, outs, jnp.any(inp.active) & (inp.n_rounds > 0))
    _, state, _, outs, _ = jax.lax.while_loop(lambda c: c[4], body, carry)
    return state, outs
