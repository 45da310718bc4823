"""Continuous batching for `generate(..., loop="queue")`: R decode rows work through Q requests in
one jitted `lax.while_loop`; a row whose request finishes hands its tokens over and takes the next
waiting request, prefilled inside the same loop.

Why: a static batch decodes until its longest row is done. The demo's regenerated answers average
~58 of at most 128 tokens and one in nine reaches the limit, so nearly every batch of 32 ran all
128 steps while most of its rows sat finished. Here the rows stay busy until the queue runs dry.

Tokens: the same keys as `generate` (the token at position p of the request with seed s is drawn
with `fold_in(fold_in(key, s), p)`), so a request's output depends neither on the row nor on the
time it ran — up to the float rounding of a one-row prefill against a batched one (the tests
check the tokens equal `generate`'s static batches).

Shapes: R rows (static), Q queued requests (a bucket; `num_q` of them real), P prompt bucket, S
cache length (holds every request's prompt plus its new tokens), V vocab, K stop ids.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.buckets import pow2_bucket
from dspark_jax.models import transformer as tf
from dspark_jax.models.decoding import (
    PAD_TOKEN,
    DecodeRequest,
    DecodeState,
    bucket_size,
    decode_step,
    prefill,
    sample_tokens,
    start,
)
from dspark_jax.spec.sampling import SamplingParams

PREFILL_CHUNK = 32  # tokens per prefill call of an admitted prompt


class QueueState(NamedTuple):
    dec: DecodeState  # the R rows
    item_R: jax.Array  # int32: the queued request each row decodes (-1: idle)
    next_q: jax.Array  # int32: the next waiting request
    out_QxS: jax.Array  # int32: finished requests' tokens (position p at [q, p])
    num_Q: jax.Array  # int32: their new-token counts
    steps: jax.Array  # int32: decode steps run


def _take(req_Q: DecodeRequest, idx, live) -> DecodeRequest:
    """The requests at `idx` (rows where `live` is False get max_new 0: idle)."""
    sampling = None if req_Q.sampling is None else jax.tree.map(lambda f: f[idx], req_Q.sampling)
    max_new = jnp.where(live, req_Q.max_new_B[idx], 0)
    return DecodeRequest(max_new, req_Q.stop_K, req_Q.key, req_Q.seeds_B[idx], sampling)


def _rows_request(req_Q: DecodeRequest, item_R) -> DecodeRequest:
    return _take(req_Q, jnp.maximum(item_R, 0), item_R >= 0)


def _admit(cfg, params, scfg, tokens_QxP, lengths_Q, req_Q, st: QueueState, r) -> QueueState:
    """Row r takes request `next_q`: its prompt prefilled into the row's cache and its first token
    drawn, leaving the row as `generate.start` leaves one."""
    q = st.next_q
    dec, c = st.dec, st.dec.cache
    row = lambda x: jax.lax.dynamic_slice_in_dim(x, r, 1, axis=0)
    one = tf.KVCache(tuple(map(row, c.k)), tuple(map(row, c.v)), jnp.zeros((1,), jnp.int32))
    length = lengths_Q[q][None]
    # the prompt in chunks of C tokens (its own length, not the queue's prompt bucket P)
    c_len = min(PREFILL_CHUNK, tokens_QxP.shape[1])

    def chunk(carry):
        i, one, _ = carry
        at = i * c_len
        toks = jax.lax.dynamic_slice(tokens_QxP, (q, at), (1, c_len))
        n = jnp.clip(length - at, 1, c_len)
        logits, _, one = prefill(cfg, params, toks, n, one, start_B=at[None])
        return i + 1, one, logits

    logits0 = jnp.zeros((1, cfg.vocab_size), jnp.float32)
    _, one, logits = jax.lax.while_loop(
        lambda c: c[0] * c_len < length[0], chunk, (jnp.int32(0), one, logits0)
    )
    req1 = _take(req_Q, q[None], jnp.ones((1,), bool))
    tok = sample_tokens(logits, req1.key, req1.seeds_B, length, req1.sampling, scfg)[0]
    put = lambda big, small: jax.lax.dynamic_update_slice_in_dim(big, small, r, axis=0)
    s = dec.tokens_BxS.shape[1]
    done = jnp.any(tok == req_Q.stop_K) | (req1.max_new_B[0] <= 1)
    dec = DecodeState(
        cache=tf.KVCache(
            tuple(map(put, c.k, one.k)), tuple(map(put, c.v, one.v)), c.lengths.at[r].set(length[0])
        ),
        last_B=dec.last_B.at[r].set(tok),
        tokens_BxS=dec.tokens_BxS.at[r].set(jnp.zeros((s,), jnp.int32).at[length[0]].set(tok)),
        num_new_B=dec.num_new_B.at[r].set(1),
        done_B=dec.done_B.at[r].set(done),
    )
    return st._replace(dec=dec, item_R=st.item_R.at[r].set(q), next_q=q + 1)


def _retire(cfg, params, scfg, tokens_QxP, lengths_Q, req_Q, num_q, st: QueueState):
    """Every finished row hands its tokens over and takes the next waiting request (or idles)."""

    def finished(st):
        return jnp.any(st.dec.done_B & (st.item_R >= 0))

    def one(st):
        r = jnp.argmax(st.dec.done_B & (st.item_R >= 0)).astype(jnp.int32)
        q = st.item_R[r]
        st = st._replace(
            out_QxS=st.out_QxS.at[q].set(st.dec.tokens_BxS[r]),
            num_Q=st.num_Q.at[q].set(st.dec.num_new_B[r]),
        )
        return jax.lax.cond(
            st.next_q < num_q,
            lambda st: _admit(cfg, params, scfg, tokens_QxP, lengths_Q, req_Q, st, r),
            lambda st: st._replace(item_R=st.item_R.at[r].set(-1)),
            st,
        )

    return jax.lax.while_loop(finished, one, st)


def _generate_queue(cfg, params, tokens_QxP, lengths_Q, req_Q, num_q, *, scfg, cache_len, rows):
    """The queue's tokens [Q, S], new-token counts [Q] and the decode steps run; requests at index
    >= num_q are not run."""
    q_max = tokens_QxP.shape[0]
    first = jnp.arange(rows, dtype=jnp.int32)
    item = jnp.where(first < jnp.minimum(num_q, q_max), first, -1)
    idx = jnp.minimum(first, q_max - 1)
    dec = start(cfg, params, tokens_QxP[idx], jnp.where(item >= 0, lengths_Q[idx], 1),
                _rows_request(req_Q, item), scfg=scfg, cache_len=cache_len)  # fmt: skip
    st = QueueState(
        dec, item, jnp.minimum(num_q, rows).astype(jnp.int32),
        jnp.zeros((q_max, cache_len), jnp.int32), jnp.zeros((q_max,), jnp.int32), jnp.int32(0),
    )  # fmt: skip
    retire = functools.partial(_retire, cfg, params, scfg, tokens_QxP, lengths_Q, req_Q, num_q)
    st = retire(st)

    def body(st):
        dec = decode_step(cfg, params, st.dec, _rows_request(req_Q, st.item_R), scfg=scfg)
        return retire(st._replace(dec=dec, steps=st.steps + 1))

    st = jax.lax.while_loop(lambda st: jnp.any(st.item_R >= 0), body, st)
    return st.out_QxS, st.num_Q, st.steps


generate_queue_jit = jax.jit(_generate_queue, static_argnames=("cfg", "scfg", "cache_len", "rows"))


def run_queue(cfg, params, prompts, rows_host, stop_K, key, scfg, buckets):
    """`generate`'s queue loop. Requests are grouped by the cache length they need (a length
    bucket: decode attention reads the whole cache, so one long request would make every row's
    step pay for its length); each group runs through `bucket(min(group, max batch bucket))`
    rows. Returns the new tokens per request and the decode steps run."""
    batch_buckets, length_buckets = buckets
    lens = rows_host.lens
    need = np.array([bucket_size(int(x), length_buckets, "length of prompt + new")
                     for x in lens + rows_host.max_new])  # fmt: skip
    outs: list[list[int] | None] = [None] * len(prompts)
    steps = 0
    for s in sorted(set(need.tolist())):
        idx = np.flatnonzero(need == s)
        rows = bucket_size(min(len(idx), max(batch_buckets)), batch_buckets, "batch size")
        got, k = _run_group(cfg, params, [prompts[i] for i in idx], rows_host.take(idx), stop_K,
                            key, scfg, min(s, cfg.max_position_embeddings), rows)  # fmt: skip
        for i, o in zip(idx, got):
            outs[i] = o
        steps += k
    return outs, steps


def _run_group(cfg, params, prompts, rows_host, stop_K, key, scfg, s, num_rows):
    """One queue through `num_rows` rows with cache length `s`. Few programs across calls: the
    queue is padded to a power of two of at least 4 x `num_rows` requests and the prompts to `s`
    tokens (the loop only reads an admitted prompt's own chunks)."""
    n, lens = len(prompts), rows_host.lens
    q = max(4 * num_rows, pow2_bucket(n, 1))
    p = -(-s // PREFILL_CHUNK) * PREFILL_CHUNK  # whole chunks
    tokens = np.full((q, p), PAD_TOKEN, np.int32)
    for i, pr in enumerate(prompts):
        tokens[i, : len(pr)] = pr
    pad = lambda a, v, dt: np.concatenate([np.asarray(a, dt), np.full((q - n,), v, dt)])
    sampling = None
    if rows_host.sampling is not None:
        neutral = (1.0, 0, 1.0, 0.0)  # the padding requests never run
        sampling = SamplingParams(
            *(pad(f, v, f.dtype) for f, v in zip(rows_host.sampling, neutral))
        )
    req = DecodeRequest(
        pad(rows_host.max_new, 0, np.int32), stop_K, key, pad(rows_host.seeds, 0, np.uint32),
        sampling,
    )  # fmt: skip
    toks, num, steps = generate_queue_jit(
        cfg, params, tokens, pad(lens, 1, np.int32), req, np.int32(n),
        scfg=scfg, cache_len=s, rows=num_rows,
    )  # fmt: skip
    toks, num = np.asarray(toks), np.asarray(num)
    return [toks[i, lens[i] : lens[i] + num[i]].tolist() for i in range(n)], int(steps)
