"""Gemma 4 targets on the paged KV layout (issue 41 item 3, issue 39).

The tiny all-features Gemma 4 config of `test_gemma4_engine.py` (sliding window 8, global layers
with their own head geometry and K = V, KV-shared layers, per-layer inputs, experts, soft-capped
logits) on prompts longer than the window: the paged forward equals the full pass of
`models.forward` (prefill, a verify, a rejected tail overwritten), writing and read-only; the
engine's paged layout gives plain greedy decoding's tokens with a pool that preempts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.engine import RequestParams
from dspark_jax.models import transformer as tf
from dspark_jax.models.generate import generate
from dspark_jax.models.paged import init_paged_cache, paged_forward, write_new_kv
from dspark_jax.testing import CompileCounter, positions_like, random_params
from tests.test_gemma4_engine import CFG, MAX_NEW, PROMPT_LENS, TOL, G, V, _engine, gemma_pair

PAGE, B, P = 4, 12, 40  # a request holds up to 48 positions
PREFIX = (20, 31, 26)  # > 2 sliding windows
# per step: (new tokens, of them committed) per request; request 1 keeps 2 of its 5
STEPS = [((3, 5, 0), (3, 2, 0)), ((1, 4, 2), (1, 4, 2))]


@pytest.fixture(scope="module")
def params():
    """`random_params` with each layer's scalar 1 + its random value (as `gemma_pair`): with the
    raw scalars (~0.03) the residual stream shrinks ~30x a layer and float reassociation reaches
    the logits ~100x amplified (3e-3 here, and as much for the slot layout's packed forward of
    the same 80-token bucket: 2.9e-3)."""
    p = jax.tree.map(lambda x: x, random_params(CFG, 0))
    for layer in p["layers"].values():
        layer["layer_scalar"] = layer["layer_scalar"].replace(1.0 + layer["layer_scalar"][...])
    return p


@functools.partial(jax.jit, static_argnames=("q_per_req", "read_only"))
def _step(params, toks, cu, kv, tables, cache, *, q_per_req, read_only):
    args = (CFG, params, toks, cu, kv, tables, cache)
    if read_only:  # the device-resident rounds' form: pools only read, K/V written after
        out, new = paged_forward(*args, q_per_req=q_per_req, write=False)
        return out, write_new_kv(cache, new)
    return paged_forward(*args, q_per_req=q_per_req)


@jax.jit
def _full_pass(params, toks):
    return tf.forward(CFG, params, toks, positions_like(toks))[0]


def _full(params, seq):  # one program: right padding to the tables' length is never seen
    return _full_pass(params, jnp.asarray([seq + [0] * (B * PAGE - len(seq))], jnp.int32))


def _worst(out, cu, hist, new, params):
    """Max abs difference of each request's new tokens' logits and features to the full pass
    over its history."""
    worst = 0.0
    for r, n in enumerate(new):
        if n:
            ref = _full(params, hist[r])
            got, want = slice(int(cu[r]), int(cu[r + 1])), slice(len(hist[r]) - n, len(hist[r]))
            for a, b in ((out.logits, ref.logits), (out.features, ref.features)):
                worst = max(worst, float(np.abs(np.asarray(a[0, got] - b[0, want])).max()))
    return worst


def _call(params, cache, tables, hist, new, bucket, **kw):
    toks = sum((h[len(h) - n :] for h, n in zip(hist, new)), [])
    toks = np.asarray(toks + [0] * (bucket - len(toks)), np.int32)
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    kv = np.asarray([len(h) if n else 0 for h, n in zip(hist, new)], np.int32)
    out, cache = _step(params, toks, cu, kv, tables, cache, **kw)
    return out, cache, _worst(out, cu, hist, new, params)


def test_paged_forward_equals_the_full_pass(params):
    """Three requests' prefixes (20, 31, 26 tokens) prefilled in one request-major call, then a
    verify (3, 5, 0 new tokens and bucket padding) of which request 1 keeps 2, then a step that
    overwrites its rejected tail: every new token's logits and features equal the full pass over
    its request's history, token- and request-major, writing or read-only (`write_new_kv`
    after); every form leaves the same pools."""
    rng = np.random.default_rng(1)
    tables = jnp.asarray(rng.permutation(P)[: 3 * B].reshape(3, B), jnp.int32)  # interleaved
    hist0 = [rng.integers(0, V, n).tolist() for n in PREFIX]
    cache0 = init_paged_cache(CFG, P, PAGE)
    shapes = {(k.shape, v.shape) for k, v in zip(cache0.k, cache0.v)}
    assert len(cache0.k) == CFG.num_layers - CFG.gemma.num_kv_shared_layers
    assert shapes == {((P, PAGE, 2, 16),) * 2, ((P, PAGE, 1, 32),) * 2}  # sliding / global
    pre, cache0, worst = _call(params, cache0, tables, hist0, PREFIX, 80, q_per_req=32,
                               read_only=False)  # fmt: skip
    news = [[rng.integers(0, V, n).tolist() for n in new] for new, _ in STEPS]
    pools, report = {}, {"prefill": worst}
    for q_per_req in (0, 5):
        for read_only in (False, True):
            cache, hist = jax.tree.map(jnp.copy, cache0), [list(h) for h in hist0]
            worst = 0.0
            for (new, keep), toks in zip(STEPS, news):
                hist = [h + t for h, t in zip(hist, toks)]
                _, cache, w = _call(params, cache, tables, hist, new, 10, q_per_req=q_per_req,
                                    read_only=read_only)  # fmt: skip
                worst = max(worst, w)
                hist = [h[: len(h) - n + k] for h, n, k in zip(hist, new, keep)]
            pools[q_per_req, read_only] = cache
            report[q_per_req, read_only] = worst
    print("paged vs full pass, max abs diff (logits, features):", report)
    assert max(report.values()) <= TOL, report
    ref = pools[0, False]
    for c in pools.values():  # the same K/V, whatever the form (valid positions hold the same)
        for a, b in zip(c.k + c.v, ref.k + ref.v):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOL / 10)


@pytest.fixture(scope="module")
def pair():
    return gemma_pair(gamma=G)


@pytest.fixture(scope="module")
def prompts():  # test_gemma4_engine's prompts (20-40 tokens)
    rng = np.random.default_rng(5)
    return [[int(t) for t in rng.integers(0, V - 1, size=n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def refs(pair, prompts):
    tcfg, tp, _, _ = pair
    return [generate(tcfg, tp, [p], max_new_tokens=m)[0] for p, m in zip(prompts, MAX_NEW)]


@pytest.mark.parametrize("rounds_per_call", [1, 3])
def test_paged_engine_greedy_equals_plain_decoding(pair, prompts, refs, rounds_per_call):
    """Five requests on three slots, 12 pages of 8 (96 positions for requests of 46-52): the
    paged engine preempts and recomputes, and every request gets plain greedy decoding's
    tokens, drafts accepted and rejected; nothing compiles after warm-up, every page returns."""
    eng = _engine(pair, "greedy", kv_layout="paged", page_size=8, num_pages=12,
                  rounds_per_call=rounds_per_call)  # fmt: skip
    eng.warmup()
    n = eng.compilations
    with CompileCounter() as cc:
        handles = []
        for k, (p, m) in enumerate(zip(prompts, MAX_NEW)):
            handles.append(eng.submit(p, RequestParams(m, temperature=0.0)))
            if k % 2:
                eng.step()
        while eng.has_work():
            eng.step()
        outs = [h.result() for h in handles]
    assert cc.count == 0, cc.names
    assert eng.compilations == n
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.tokens == ref, (rounds_per_call, i)
    assert sum(sum(o.num_accepted) for o in outs) > 0  # drafts accepted ...
    assert sum(sum(o.num_accepted) for o in outs) < sum(sum(o.proposed) for o in outs)  # and not
    print(f"rounds_per_call={rounds_per_call}: {eng.page_pool.preemptions} preemptions")
    assert eng.page_pool.preemptions > 0
    eng.page_pool.check()
    assert eng.page_pool.used_pages == 0
