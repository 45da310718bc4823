"""Device-resident rounds (ServingEngine(rounds_per_call=K), engine.rounds): greedy output equals
plain greedy decoding, sampled output is bit-identical to one round per call, stop ids and
max_new_tokens are honoured on the device, several rounds run per call, no retrace."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax.engine import RequestParams, ServingEngine
from dspark_jax.engine.config import sampling_rows
from dspark_jax.engine.device import RoundInputs
from dspark_jax.engine.rounds import RoundsInputs, threshold_cuts
from dspark_jax.models.generate import generate
from dspark_jax.sched.sts import STS
from dspark_jax.testing import CompileCounter
from tests.engine_models import agreeing_pair

G = 4
PROMPTS = [[3, 9, 1], [5, 6, 7, 8, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48], [1, 2], [7] * 20]
MAX_NEW = [40, 25, 33, 12, 30]
# two cache buckets here, two token buckets in the sampled test: the device picks each round's
# (T, S) among the compiled verify forwards exactly as the host does
# the slot layout's resident rounds (its state and forms are inspected below); the paged
# layout's are tests/test_engine_paged.py's
KW = dict(
    num_slots=3, max_len=96, prompt_buckets=(16,), token_buckets=(15,), cache_buckets=(48, 96),
    kv_layout="slots",
)  # fmt: skip


def _drain(eng, handles):
    calls = 0
    while eng.has_work():
        eng.step()
        calls += 1
    return [h.result() for h in handles], calls


def test_greedy_equals_plain_decoding_with_rounds_on_device():
    tcfg, tp, dcfg, dp = agreeing_pair(vocab=64, gamma=G)
    refs = [generate(tcfg, tp, [p], max_new_tokens=m)[0] for p, m in zip(PROMPTS, MAX_NEW)]
    eng = ServingEngine(tcfg, dcfg, tp, dp, rounds_per_call=4, modes=("greedy",), **KW)
    eng.warmup()
    stop = refs[0][10]
    cut = refs[0].index(stop) + 1
    with CompileCounter() as cc:
        for policy in ("fixed", "threshold", "mtp1"):
            eng.set_policy(policy, threshold=0.4)
            rounds0 = eng.metrics().rounds
            hs = [
                eng.submit(p, RequestParams(m, temperature=0.0)) for p, m in zip(PROMPTS, MAX_NEW)
            ]
            hs.append(eng.submit(PROMPTS[0], RequestParams(40, temperature=0.0, stop_ids=(stop,))))
            outs, calls = _drain(eng, hs)
            for o, ref in zip(outs, refs):
                assert o.tokens == ref and o.finish_reason == "length", policy
            assert outs[-1].tokens == refs[0][:cut] and outs[-1].finish_reason == "stop"
            rounds = eng.metrics().rounds - rounds0
            assert calls < rounds, policy  # several rounds per jitted call
            if policy == "fixed":  # drafts really are accepted
                tokens = sum(len(o.tokens) for o in outs)
                assert tokens / sum(o.stats.rounds for o in outs) > 2.0
            if policy == "threshold":  # the device policy varies the lengths
                assert len({n for o in outs for n in o.proposed}) > 1
    assert cc.count == 0, cc.names


@pytest.mark.bitwise
def test_sampled_output_bit_identical_to_one_round_per_call():
    tcfg, tp, dcfg, dp = agreeing_pair(vocab=64, gamma=G, head_scale=1.0, markov_bias=3.0)
    kw = dict(KW, token_buckets=(6, 15), cache_buckets=(96,), modes=("filtered",))
    one = ServingEngine(tcfg, dcfg, tp, dp, rounds_per_call=1, **kw)
    many = ServingEngine(tcfg, dcfg, tp, dp, rounds_per_call=5, **kw)
    for e in (one, many):
        e.warmup()
    reqs = [
        RequestParams(20, temperature=0.9, top_p=0.95, seed=11),
        RequestParams(15, temperature=1.3, top_k=5, seed=1),
        RequestParams(9, temperature=0.0),
        RequestParams(30, temperature=0.7, min_p=0.1, seed=2, stop_ids=(5, 17)),
        RequestParams(25, temperature=1.0, seed=3),
    ]
    with CompileCounter() as cc:
        for policy in ("fixed", "threshold"):
            res = []
            for e in (one, many):
                e.set_policy(policy, threshold=0.3)
                hs = [e.submit(p, q) for p, q in zip(PROMPTS, reqs)]
                res.append(_drain(e, hs))
            (a, calls_a), (b, calls_b) = res
            for x, y in zip(a, b):
                assert x.tokens == y.tokens, policy
                assert x.finish_reason == y.finish_reason
                assert (x.num_accepted, x.proposed, x.eos) == (y.num_accepted, y.proposed, y.eos)
                assert np.array_equal(np.asarray(x.conf_logits), np.asarray(y.conf_logits))
            assert calls_b < calls_a
    assert cc.count == 0, cc.names
    assert one.metrics().rounds == many.metrics().rounds


def test_one_verify_program_runs_in_place_with_the_same_tokens():
    """With one (T, S) verify program (batch-1 decoding at fixed γ, as the report's speed section
    runs it) the loop calls it directly, writing the cache before reading it: no copy of a cache
    layer in the K-round program (read-only + write afterwards copied it twice per round at one
    slot), and the same tokens as one round per call, sampled and greedy."""
    import re

    from dspark_jax.engine.rounds import MAX_STOP_IDS

    tcfg, tp, dcfg, dp = agreeing_pair(vocab=64, gamma=G, head_scale=1.0, markov_bias=3.0)
    kw = dict(KW, num_slots=1, token_buckets=(G + 1,), cache_buckets=(96,), modes=("filtered",))
    one = ServingEngine(tcfg, dcfg, tp, dp, rounds_per_call=1, **kw)
    many = ServingEngine(tcfg, dcfg, tp, dp, rounds_per_call=4, **kw)
    reqs = [
        RequestParams(30, temperature=0.9, top_p=0.95, seed=5),
        RequestParams(20, temperature=0.0),
    ]
    for p, q in zip(PROMPTS, reqs):
        (a, calls_a), (b, calls_b) = (_drain(e, [e.submit(p, q)]) for e in (one, many))
        assert a[0].tokens == b[0].tokens and a[0].num_accepted == b[0].num_accepted
        assert calls_b < calls_a
        if q.temperature == 0.0:
            assert b[0].tokens == generate(tcfg, tp, [p], max_new_tokens=q.max_new_tokens)[0]
    stop = np.full((1, MAX_STOP_IDS), -1, np.int32)
    progs = many.programs
    inputs = RoundsInputs(np.ones(1, bool), np.zeros(1, np.uint32),
                          sampling_rows([reqs[0]], "filtered"), progs.key,
                          np.full(1, 50, np.int32), stop, np.int32(G), np.bool_(False),
                          np.zeros(G, np.float32), np.int32(4))  # fmt: skip
    lowered = progs.lower_rounds(progs.state, inputs, mode="filtered")
    layer = ",".join(map(str, progs.state.cache.k[0].shape))
    text = lowered.compile().as_text()
    assert re.search(rf"= f32\[{layer}\]", text)
    assert not re.findall(rf"= f32\[{layer}\]\S* copy\(", text)


def test_the_engine_picks_one_verify_form_for_all_its_round_programs():
    """One (T, S) program on one device: own K/V read back from the cache; several programs: not.
    The one-round and K-round programs of an engine run the same form."""
    tcfg, tp, dcfg, dp = agreeing_pair(vocab=64, gamma=G)
    one = dict(KW, num_slots=1, token_buckets=(G + 1,), cache_buckets=(96,))

    def form(**kw):
        progs = ServingEngine(tcfg, dcfg, tp, dp, rounds_per_call=4, **kw).programs
        t, s = progs.config.token_buckets[0], progs.config.cache_buckets[0]
        a, b = progs.round_spec("greedy", t, s).one_set, progs.rounds_spec("greedy").one_set
        assert a == b == progs.one_set
        return progs.one_set

    assert form(**one) is True
    assert form(**KW) is False


def test_threshold_cuts_match_the_host_policy():
    sts = STS((0.5, 1.0, 2.0, 3.7))
    rng = np.random.default_rng(0)
    for theta in (0.0, 0.3, 0.5, 0.77, 1.0):
        cuts = threshold_cuts(sts, 4, theta)
        rho = rng.normal(0, 4, (2000, 4)).astype(np.float32)
        # plus the floats right next to each cut, where a float32 comparison could slip
        near = np.stack([np.nextafter(cuts, -np.inf), cuts, np.nextafter(cuts, np.inf)])
        rho = np.concatenate([rho, np.nan_to_num(near, posinf=1e30, neginf=-1e30)])
        host = sts.probs(rho) >= theta
        assert np.array_equal(rho >= cuts[None, :], host), theta


def test_rounds_update_the_cache_in_place():
    """Neither the one-round program nor the K-round loop (a `lax.switch` over (T, S) verify
    programs) copies a cache layer: the verify forward writes each layer's K/V before reading
    it, the switch's branches only read the cache and return the tokens' K/V. (A write after
    the reads, or a branch returning the cache, made XLA copy the whole cache every round: a
    batch-8 round 16 -> 36 ms, benchmarks/round_loop.py.)"""
    import re

    from dspark_jax.engine.rounds import MAX_STOP_IDS

    tcfg, tp, dcfg, dp = agreeing_pair(vocab=64, gamma=G)
    kw = dict(KW, token_buckets=(6, 15), modes=("greedy",))
    eng = ServingEngine(tcfg, dcfg, tp, dp, rounds_per_call=4, **kw)
    n, progs = eng.num_slots, eng.programs
    active, seeds = np.ones(n, bool), np.zeros(n, np.uint32)
    full = np.full(n, G, np.int32)
    inputs = RoundInputs(full, active, seeds, None, progs.key)
    one = progs.lower_round(progs.state, inputs, mode="greedy", num_tokens=15, cache_len=96)
    stop = np.full((n, MAX_STOP_IDS), -1, np.int32)
    inputs = RoundsInputs(active, seeds, None, progs.key, np.full(n, 50, np.int32), stop,
                          np.int32(G), np.bool_(False), np.zeros(G, np.float32), np.int32(4))  # fmt: skip
    many = progs.lower_rounds(progs.state, inputs, mode="greedy")
    layer = ",".join(map(str, progs.state.cache.k[0].shape))  # [N, n_kv, max_len, d]
    for name, lowered in (("one round", one), ("K rounds", many)):
        text = lowered.compile().as_text()
        copies = re.findall(rf"= f32\[{layer}\]\S* copy\(", text)
        assert not copies, (name, len(copies))
        assert re.search(rf"= f32\[{layer}\]", text)  # the pattern does match the cache's shape
