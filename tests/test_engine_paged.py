"""ServingEngine on the paged KV cache (`kv_layout="paged"`): greedy == plain greedy decoding for
every policy, seeded sampling == the slot engine, preemption (a small pool) changes no token,
all pages return after cancellations, no compilation after warm-up."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax.engine import RequestParams, ServingEngine
from dspark_jax.errors import ConfigError, RequestError
from dspark_jax.models.generate import generate
from dspark_jax.sched import CostProfile
from dspark_jax.testing import CompileCounter
from tests.engine_models import agreeing_pair, trained_pair

G = 4
PROMPTS = [[3, 9, 1], [5, 6, 7, 8, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48], [1, 2], [7] * 20]
MAX_NEW = [40, 25, 33, 12, 30]
COST = CostProfile.from_step_time(1.0, 0.08, max_tokens=64)
KW = dict(num_slots=3, max_len=96, prompt_buckets=(8, 16), token_buckets=(4, 8, 15),
          cache_buckets=(48, 96))  # fmt: skip


@pytest.fixture(scope="module")
def pair():
    return agreeing_pair(vocab=64, gamma=G)


@pytest.fixture(scope="module")
def refs(pair):
    tcfg, tp, _, _ = pair
    return [generate(tcfg, tp, [p], max_new_tokens=m)[0] for p, m in zip(PROMPTS, MAX_NEW)]


def _engine(pair, modes=("greedy",), **kw):
    tcfg, tp, dcfg, dp = pair
    return ServingEngine(tcfg, dcfg, tp, dp, modes=modes, kv_layout="paged", page_size=8,
                         **{**KW, **kw})  # fmt: skip


@pytest.fixture(scope="module")
def engine(pair):
    eng = _engine(pair)
    eng.warmup()
    return eng


def _run_staggered(eng, order, params=None):
    handles = {}
    for k, i in enumerate(order):
        p = RequestParams(MAX_NEW[i], temperature=0.0) if params is None else params[i]
        handles[i] = eng.submit(PROMPTS[i], p)
        if k % 2 == 1:
            eng.step()
    while eng.has_work():
        eng.step()
    return {i: h.result() for i, h in handles.items()}


@pytest.mark.parametrize("policy", ["mtp1", "fixed", "threshold", "alg1", "async"])
def test_paged_greedy_equals_plain_decoding_every_policy(engine, refs, policy):
    engine.set_policy(policy, cost_profile=COST, threshold=0.4)
    before = engine.compilations
    with CompileCounter() as cc:
        outs = _run_staggered(engine, [0, 1, 2, 3, 4])
        outs2 = _run_staggered(engine, [4, 2, 0, 3, 1])
    assert cc.count == 0, cc.names
    assert engine.compilations == before
    for i, ref in enumerate(refs):
        assert outs[i].tokens == ref, (policy, i)
        assert outs2[i].tokens == ref, (policy, i)
    engine.page_pool.check()
    assert engine.page_pool.used_pages == 0
    if policy == "fixed":  # drafts really are accepted
        assert sum(sum(o.num_accepted) for o in outs.values()) > 0


def _sampled_params():
    return [RequestParams(m, temperature=0.8, top_p=0.9, seed=100 + i)
            for i, m in enumerate(MAX_NEW)]  # fmt: skip


def test_paged_sampled_equals_slot_engine(pair):
    tcfg, tp, dcfg, dp = pair
    slots = ServingEngine(tcfg, dcfg, tp, dp, modes=("filtered",), **KW)
    paged = _engine(pair, modes=("filtered",))
    a = _run_staggered(slots, [0, 1, 2, 3, 4], _sampled_params())
    b = _run_staggered(paged, [0, 1, 2, 3, 4], _sampled_params())
    for i in range(len(PROMPTS)):
        assert a[i].tokens == b[i].tokens, i
        assert a[i].num_accepted == b[i].num_accepted, i
    paged.page_pool.check()


@pytest.mark.parametrize("modes", [("greedy",), ("filtered",)])
def test_preemption_changes_no_token(pair, modes):
    """A pool of 12 pages of 8 (96 positions for 3 slots) forces preemptions by recompute; the
    tokens equal a large pool's, and (batch invariance, issue 39 item 4: T = 0.8, top-p 0.9 in
    "filtered") the tokens of the same seeded requests served one at a time."""
    params = _sampled_params() if modes == ("filtered",) else None
    big = _engine(pair, modes=modes)
    small = _engine(pair, modes=modes, num_pages=12)
    a = _run_staggered(big, [0, 1, 2, 3, 4], params)
    b = _run_staggered(small, [0, 1, 2, 3, 4], params)
    alone = [_run_staggered(big, [i], params)[i] for i in range(len(PROMPTS))]
    assert small.page_pool.preemptions > 0
    assert big.page_pool.preemptions == 0
    for i in range(len(PROMPTS)):
        assert a[i].tokens == b[i].tokens == alone[i].tokens, (modes, i)
    small.page_pool.check()
    assert small.page_pool.used_pages == 0


def test_cancellations_free_every_page(engine):
    hs = [engine.submit(p, RequestParams(m, temperature=0.0)) for p, m in zip(PROMPTS, MAX_NEW)]
    engine.step()
    engine.cancel(hs[0].id)  # running
    engine.cancel(hs[4].id)  # queued
    engine.step()
    engine.cancel(hs[1].id)
    while engine.has_work():
        engine.step()
    reasons = [h.result().finish_reason for h in hs]
    assert reasons[0] == reasons[1] == reasons[4] == "cancelled"
    engine.page_pool.check()
    assert engine.page_pool.used_pages == 0


def test_paged_config_errors(pair):
    tcfg, tp, dcfg, dp = pair
    with pytest.raises(ConfigError, match="kv_layout"):
        ServingEngine(tcfg, dcfg, tp, dp, kv_layout="pages", **KW)
    eng = _engine(pair, num_pages=4)  # 32 positions
    with pytest.raises(RequestError, match="num_pages"):
        eng.submit([1] * 20, RequestParams(10, temperature=0.0))
    assert eng.page_pool is not None
    assert ServingEngine(tcfg, dcfg, tp, dp, **KW).page_pool is not None  # the default
    assert ServingEngine(tcfg, dcfg, tp, dp, kv_layout="slots", **KW).page_pool is None
    with pytest.raises(ConfigError, match="both size the page pool"):
        ServingEngine(tcfg, dcfg, tp, dp, num_pages=8, kv_memory_gib=1.0, **KW)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_other_drafters_paged_with_preemption_equal_plain_decoding(kind, refs):
    """Eagle3's context (one K/V array and its `g` rows) and DFlash's in pages, with a pool small
    enough to preempt: plain greedy decoding's tokens, drafts really accepted."""
    tcfg, tp, dcfg, dp = trained_pair(kind, gamma=G)
    eng = ServingEngine(
        tcfg, dcfg, tp, dp, num_slots=2, max_len=96, prompt_buckets=(8,), token_buckets=(4, 10),
        modes=("greedy",), kv_layout="paged", page_size=8, num_pages=10,
    )  # fmt: skip
    eng.set_policy("fixed", gamma=G)
    outs = eng.generate(PROMPTS, max_new_tokens=40, temperature=0.0, seeds=[1, 2, 3, 4, 5])
    for i, o in enumerate(outs):
        assert len(o.tokens) == 40 and o.tokens[: len(refs[i])] == refs[i], (kind, i)
    assert np.mean([o.stats.mean_accepted_length for o in outs]) > 2.5
    assert eng.page_pool.preemptions > 0
    eng.page_pool.check()
    assert eng.page_pool.used_pages == 0


@pytest.mark.parametrize("num_pages", [0, 12])
def test_paged_device_rounds_equal_plain_decoding(pair, refs, num_pages):
    """K = 3 device-resident rounds per call on pages (the host reserves K rounds' pages; 12
    pages of 8 force preemptions): plain greedy decoding's tokens, no compile after warm-up."""
    eng = _engine(pair, rounds_per_call=3, num_pages=num_pages)
    eng.warmup()
    n = eng.compilations
    for policy in ("fixed", "threshold"):
        eng.set_policy(policy, threshold=0.4)
        outs = _run_staggered(eng, [0, 1, 2, 3, 4])
        for i, ref in enumerate(refs):
            assert outs[i].tokens == ref, (policy, num_pages, i)
    assert eng.compilations == n
    assert (eng.page_pool.preemptions > 0) == (num_pages == 12)
    eng.page_pool.check()
    assert eng.page_pool.used_pages == 0


def test_pages_all_free_after_1000_mixed_requests_with_cancellations(pair, refs):
    """1000 short requests (prefixes of the reference prompts' outputs, 1..12 new tokens, one in
    ten up to 40), about one in six cancelled while queued or running, on a pool small enough to preempt:
    every other request gets plain greedy decoding's tokens and every page comes back."""
    eng = _engine(pair, num_pages=12)
    rng = np.random.default_rng(0)
    handles, cancel_at, step = [], {}, 0
    while len(handles) < 1000 or eng.has_work():
        for _ in range(int(rng.integers(0, 3)) if len(handles) < 1000 else 0):
            i = int(rng.integers(len(PROMPTS)))
            m = MAX_NEW[i] if rng.random() < 0.1 else int(rng.integers(1, 13))  # some grow
            h = eng.submit(PROMPTS[i], RequestParams(m, temperature=0.0))
            handles.append((h, i, m))
            if rng.random() < 1 / 6:
                cancel_at.setdefault(step + int(rng.integers(0, 3)), []).append(h.id)
        for rid in cancel_at.pop(step, []):
            eng.cancel(rid)
        eng.step()
        step += 1
    cancelled = 0
    for h, i, m in handles:
        out = h.result()
        if out.finish_reason == "cancelled":
            cancelled += 1
        else:
            assert out.tokens == refs[i][:m], (h.id, i, m)
    assert 50 < cancelled < 300
    assert eng.page_pool.preemptions > 0
    eng.page_pool.check()
    assert eng.page_pool.used_pages == 0
