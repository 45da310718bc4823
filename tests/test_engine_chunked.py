"""Chunked prefill between rounds (`prefill_tokens_per_step`): a long prompt is prefilled one
16-token chunk per step while the running requests get a round every step; the tokens equal
plain greedy decoding and, seeded and sampled, the unbounded engine's; on both KV layouts."""

from __future__ import annotations

import jax
import pytest

from dspark_jax import parallel
from dspark_jax.config import MeshConfig
from dspark_jax.engine import RequestParams, ServingEngine
from dspark_jax.models.generate import generate
from dspark_jax.testing import CompileCounter
from tests.engine_models import agreeing_pair

G = 4
LONG = [(5 * i + 3) % 60 + 1 for i in range(70)]  # 5 chunks of 16 (the last one 6 tokens)
PROMPTS = [[3, 9, 1], LONG, [5, 6, 7, 8, 2], [7] * 20]
MAX_NEW = [30, 12, 20, 10]
KW = dict(num_slots=3, max_len=112, prompt_buckets=(16,), token_buckets=(15,),
          cache_buckets=(112,))  # fmt: skip
LAYOUTS = [dict(kv_layout="slots"), dict(kv_layout="paged", page_size=8)]


@pytest.fixture(scope="module")
def pair():
    return agreeing_pair(vocab=64, gamma=G)


@pytest.fixture(scope="module")
def refs(pair):
    tcfg, tp, _, _ = pair
    return [generate(tcfg, tp, [p], max_new_tokens=m)[0] for p, m in zip(PROMPTS, MAX_NEW)]


def _engine(pair, budget, modes=("greedy",), **kw):
    tcfg, tp, dcfg, dp = pair
    return ServingEngine(tcfg, dcfg, tp, dp, modes=modes, prefill_tokens_per_step=budget,
                         **{**KW, **kw})  # fmt: skip


def _params(sampled):
    if sampled:
        return [RequestParams(m, temperature=0.8, top_p=0.9, seed=7 + i)
                for i, m in enumerate(MAX_NEW)]  # fmt: skip
    return [RequestParams(m, temperature=0.0) for m in MAX_NEW]


def _run(eng, params):
    """Submit request 0, step it into its rounds, then the rest; per step the tokens each got."""
    hs = [eng.submit(PROMPTS[0], params[0])]
    eng.step()
    hs += [eng.submit(p, q) for p, q in zip(PROMPTS[1:], params[1:])]
    steps = []
    while eng.has_work():
        got = {}
        for d in eng.step():
            got[d.request_id] = got.get(d.request_id, 0) + len(d.tokens)
        steps.append([got.get(h.id, 0) for h in hs])
    return [h.result() for h in hs], steps


@pytest.mark.parametrize("layout", LAYOUTS, ids=["slots", "paged"])
def test_chunked_greedy_equals_plain_and_running_request_never_stalls(pair, refs, layout):
    eng = _engine(pair, 16, **layout)
    eng.warmup()
    with CompileCounter() as cc:
        outs, steps = _run(eng, _params(False))
    assert cc.count == 0, cc.names
    for o, ref in zip(outs, refs):
        assert o.tokens == ref
    # the long prompt's 5 chunks take 5 steps; request 0 gets tokens on every one of them
    first_long = next(k for k, s in enumerate(steps) if s[1])
    assert first_long >= 4
    assert all(s[0] > 0 for s in steps[:first_long]), steps
    if eng.page_pool is not None:
        eng.page_pool.check()
        assert eng.page_pool.used_pages == 0


@pytest.mark.parametrize("layout", LAYOUTS, ids=["slots", "paged"])
def test_chunked_sampled_equals_unbounded(pair, layout):
    a, _ = _run(_engine(pair, 0, modes=("filtered",), **layout), _params(True))
    b, _ = _run(_engine(pair, 16, modes=("filtered",), **layout), _params(True))
    for x, y in zip(a, b):
        assert x.tokens == y.tokens and x.num_accepted == y.num_accepted


def test_half_prefilled_cancel_and_preemption_free_their_pages(pair, refs):
    """A pool of 14 pages of 8 preempts; a half-prefilled request is cancelled; the others
    still equal plain greedy decoding and every page returns."""
    eng = _engine(pair, 16, kv_layout="paged", page_size=8, num_pages=14)
    hs = [eng.submit(p, q) for p, q in zip(PROMPTS, _params(False))]
    victim = eng.submit(LONG, RequestParams(5, temperature=0.0))
    while eng.has_work():
        eng.step()
        req = eng.slots.find(victim.id)
        if req is not None and req.fill is not None and req.fill.start > 0:
            eng.cancel(victim.id)
    assert victim.result().finish_reason == "cancelled"
    for h, ref in zip(hs, refs):
        assert h.result().tokens == ref
    assert eng.page_pool.preemptions > 0
    eng.page_pool.check()
    assert eng.page_pool.used_pages == 0


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_chunked_on_a_mesh_equals_plain(pair, refs):
    mesh = parallel.make_mesh(MeshConfig(data=1, fsdp=1, tensor=8))
    outs, _ = _run(_engine(pair, 16, mesh=mesh), _params(False))
    for o, ref in zip(outs, refs):
        assert o.tokens == ref
