"""ServingEngine: greedy == plain greedy decoding for every policy, slot, admission time and
bucket (with drafts that are really accepted), request lifecycle, errors, no retrace."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest

from dspark_jax.engine import QueueFull, RequestParams, ServingEngine
from dspark_jax.errors import ConfigError, PolicyError, RequestError
from dspark_jax.models.generate import generate
from dspark_jax.sched import CostProfile, FixedGamma
from dspark_jax.testing import CompileCounter
from tests.engine_models import agreeing_pair, trained_pair

G = 4
PROMPTS = [[3, 9, 1], [5, 6, 7, 8, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48], [1, 2], [7] * 20]
MAX_NEW = [40, 25, 33, 12, 30]
COST = CostProfile.from_step_time(1.0, 0.08, max_tokens=64)


@pytest.fixture(scope="module")
def pair():
    return agreeing_pair(vocab=64, gamma=G)


@pytest.fixture(scope="module")
def refs(pair):
    tcfg, tp, _, _ = pair
    return [generate(tcfg, tp, [p], max_new_tokens=m)[0] for p, m in zip(PROMPTS, MAX_NEW)]


@pytest.fixture(scope="module")
def engine(pair):
    tcfg, tp, dcfg, dp = pair
    eng = ServingEngine(
        tcfg, dcfg, tp, dp, num_slots=3, max_len=96, prompt_buckets=(8, 16),
        token_buckets=(4, 8, 15), cache_buckets=(48, 96), modes=("greedy",),
    )  # fmt: skip
    eng.warmup()
    assert eng.compilations <= 2 * 2 + 3 * 2  # (2 prompt + 3 token) x 2 cache buckets
    return eng


def _run_staggered(eng, order):
    """Submit in `order`, a few at a time with rounds in between (arrivals mid-flight)."""
    handles = {}
    for k, i in enumerate(order):
        handles[i] = eng.submit(PROMPTS[i], RequestParams(MAX_NEW[i], temperature=0.0))
        if k % 2 == 1:
            eng.step()
    while eng.has_work():
        eng.step()
    return {i: h.result() for i, h in handles.items()}


@pytest.mark.parametrize("policy", ["mtp1", "fixed", "threshold", "alg1", "async"])
def test_greedy_equals_plain_decoding_every_policy(engine, refs, policy):
    engine.set_policy(policy, cost_profile=COST, threshold=0.4)
    before = engine.compilations
    with CompileCounter() as cc:
        outs = _run_staggered(engine, [0, 1, 2, 3, 4])
        outs2 = _run_staggered(engine, [4, 2, 0, 3, 1])  # other slots and admission times
    assert cc.count == 0, cc.names
    assert engine.compilations == before
    for i, ref in enumerate(refs):
        assert outs[i].tokens == ref, (policy, i)
        assert outs2[i].tokens == ref, (policy, i)
        assert outs[i].finish_reason == "length"
        assert all(0 <= a <= n <= G for a, n in zip(outs[i].num_accepted, outs[i].proposed))
    rounds = sum(o.stats.rounds for o in outs.values())
    tokens = sum(len(o.tokens) for o in outs.values())
    if policy == "fixed":  # drafts really are accepted: several tokens per round
        assert tokens / rounds > 2.5
        assert all(o.stats.mean_accepted_length > 2.0 for o in outs.values())
    if policy in ("alg1", "async", "threshold"):  # the scheduler varies the lengths
        lens = {n for o in outs.values() for n in o.proposed}
        assert len(lens) > 1, lens


def test_stop_ids_cancel_and_lifecycle(engine, refs):
    engine.set_policy("fixed")
    ref = refs[0]
    stop = ref[10]
    cut = ref.index(stop) + 1
    h = engine.submit(PROMPTS[0], RequestParams(40, temperature=0.0, stop_ids=(stop,)))
    h2 = engine.submit(PROMPTS[1], RequestParams(25, temperature=0.0))
    h3 = engine.submit(PROMPTS[2], RequestParams(33, temperature=0.0))
    h4 = engine.submit(PROMPTS[3], RequestParams(12, temperature=0.0))  # queued: 3 slots
    engine.step()
    h2.cancel()
    h4.cancel()  # cancelled while waiting
    while engine.has_work():
        engine.step()
    out = h.result()
    assert out.tokens == ref[:cut] and out.finish_reason == "stop"
    assert h2.result().finish_reason == "cancelled"
    assert h4.result().finish_reason == "cancelled" and h4.result().tokens == []
    assert h3.result().tokens == refs[2]
    streamed = [t for d in h3.stream(timeout=1) for t in d.tokens]
    assert streamed == refs[2]
    m = engine.metrics()
    assert m.running == 0 and m.queue_len == 0
    assert m.requests_finished_by_reason["cancelled"] >= 2
    assert sum(m.accepted_per_position) <= m.accepted_tokens


def test_request_errors(engine):
    bad = [
        ([], RequestParams(4)),
        ([1, 64], RequestParams(4, temperature=0.0)),  # out of vocabulary
        ([1, -1], RequestParams(4, temperature=0.0)),
        ([1, 2], RequestParams(0, temperature=0.0)),
        ([1, 2], RequestParams(-3, temperature=0.0)),
        ([1] * 90, RequestParams(10, temperature=0.0)),  # can never fit max_len=96
        ([1, 2], RequestParams(4, temperature=-1.0)),
        ([1, 2], RequestParams(4, temperature=0.0, top_p=0.0)),
        ([1, 2], RequestParams(4, temperature=0.0, stop_ids=(999,))),
        ([1, 2], RequestParams(4, temperature=0.0, seed=-5)),
        ([1, 2], RequestParams(4, temperature=0.7)),  # greedy-only engine
    ]
    for prompt, params in bad:
        with pytest.raises(RequestError):
            engine.submit(prompt, params)
    assert not engine.has_work()


def test_policy_outputs_are_checked(engine):
    class TooLong:
        def __call__(self, conf, *, max_len=None, stale_conf=None):
            return np.full(conf.shape[0], G + 1)

    engine.set_policy(TooLong())
    h = engine.submit([1, 2, 3], RequestParams(8, temperature=0.0))
    with pytest.raises(PolicyError, match="outside"):
        engine.step()
    engine.cancel(h.id)
    engine.step()
    assert h.result().finish_reason == "cancelled"
    engine.set_policy(FixedGamma(G))


@pytest.mark.parametrize("rounds_per_call", [1, 4])
def test_one_slot_engine_equals_plain_decoding(pair, refs, rounds_per_call):
    """Batch-1 decoding (one slot: the packed forward reads the slot's cache without the
    per-token gather), one round or several device-resident rounds per call."""
    tcfg, tp, dcfg, dp = pair
    eng = ServingEngine(
        tcfg, dcfg, tp, dp, num_slots=1, max_len=96, prompt_buckets=(8, 16), token_buckets=(5,),
        modes=("greedy",), rounds_per_call=rounds_per_call,
    )  # fmt: skip
    outs = eng.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
    for out, ref in zip(outs, refs):
        assert out.tokens == ref
    assert sum(map(len, refs)) / sum(o.stats.rounds for o in outs) > 2.5  # drafts accepted


def test_queue_full(pair):
    tcfg, tp, dcfg, dp = pair
    eng = ServingEngine(tcfg, dcfg, tp, dp, num_slots=1, max_len=96, max_queue=2)
    eng.submit([1], RequestParams(2, temperature=0.0))
    eng.submit([1], RequestParams(2, temperature=0.0))
    with pytest.raises(QueueFull):
        eng.submit([1], RequestParams(2, temperature=0.0))


def test_a_config_object_builds_the_same_engine_as_its_keywords(pair, refs):
    """`config=EngineConfig.build(...)` and the constructor's keywords give the same config and
    the same tokens; both at once is a TypeError; the config is frozen."""
    import dataclasses

    from dspark_jax.engine import EngineConfig

    tcfg, tp, dcfg, dp = pair
    kw = dict(num_slots=2, max_len=96, prompt_buckets=(16,), token_buckets=(10,), modes=("greedy",))
    cfg = EngineConfig.build(tcfg, dcfg, **kw)
    a = ServingEngine(tcfg, dcfg, tp, dp, config=cfg)
    b = ServingEngine(tcfg, dcfg, tp, dp, **kw)
    # the engines resolve the page pool's size (`paged_engine.plan_pool`)
    assert a.config == b.config == dataclasses.replace(cfg, num_pages=a.pool_plan.num_pages)
    assert cfg.cache_buckets == (96,) and cfg.gamma == G
    for eng in (a, b):
        out = eng.generate(PROMPTS[:2], max_new_tokens=MAX_NEW[:2], temperature=0.0)
        assert [o.tokens for o in out] == refs[:2]
    with pytest.raises(TypeError, match="not both"):
        ServingEngine(tcfg, dcfg, tp, dp, config=cfg, num_slots=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_slots = 3
    with pytest.raises(ConfigError, match="max_position_embeddings"):  # checked like keywords
        too_long = tcfg.max_position_embeddings + G + 2  # the context + γ + 1 lookahead fits
        ServingEngine(tcfg, dcfg, tp, dp, config=dataclasses.replace(cfg, max_len=too_long))


def test_background_thread_streams_and_shutdown(engine, refs):
    engine.set_policy("fixed")
    engine.start()
    got = {}

    def client(i):
        h = engine.submit(PROMPTS[i], RequestParams(MAX_NEW[i], temperature=0.0))
        got[i] = [t for d in h.stream(timeout=60) for t in d.tokens]

    async def aclient(i):
        h = engine.submit(PROMPTS[i], RequestParams(MAX_NEW[i], temperature=0.0))
        toks = []
        async for d in h.astream():
            toks += d.tokens
        return toks

    async def many():
        return await asyncio.gather(*(aclient(i) for i in (2, 3, 4)))

    threads = [threading.Thread(target=client, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    aouts = asyncio.run(many())
    for t in threads:
        t.join(60)
    engine.shutdown(drain=True, timeout=60)
    assert got[0] == refs[0] and got[1] == refs[1]
    assert aouts == [refs[2], refs[3], refs[4]]
    with pytest.raises(RuntimeError):
        engine.submit([1], RequestParams(2, temperature=0.0))


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_other_drafters_greedy_exact_and_accepted(kind, refs):
    """DFlash / Eagle3 drafters trained briefly on the agreeing target (tests/engine_models.py)
    are really accepted (mean accepted length > 2), and greedy output equals plain greedy
    decoding token for token through slot prefill (prompts longer than the bucket are chunked),
    packed rounds at two fixed γ and the evaluator's keyword interface of generate()."""
    tcfg, tp, dcfg, dp = trained_pair(kind, gamma=G)
    eng = ServingEngine(
        tcfg, dcfg, tp, dp, num_slots=2, max_len=96, prompt_buckets=(8,), token_buckets=(4, 10),
        modes=("greedy",),
    )  # fmt: skip
    for gamma in (G, 2):
        eng.set_policy("fixed", gamma=gamma)
        outs = eng.generate(PROMPTS, max_new_tokens=40, temperature=0.0, seeds=[1, 2, 3, 4, 5])
        for i, o in enumerate(outs):
            assert len(o.tokens) == 40 and o.tokens[: len(refs[i])] == refs[i], (kind, gamma, i)
        assert outs[0].tokens == refs[0]  # refs[0] is 40 tokens long
        acc = [o.stats.mean_accepted_length for o in outs]
        assert np.mean(acc) > (2.5 if gamma == G else 1.8), (kind, gamma, acc)
    with pytest.raises(ConfigError, match="confidence head"):
        eng.set_policy("alg1", cost_profile=COST)


def test_alg1_fills_the_token_bucket_with_next_ranked_drafts():
    from dspark_jax.engine.scheduler import Scheduler
    from dspark_jax.sched import causal_greedy_lengths, top_k_lengths

    steep = CostProfile.from_step_time(1.0, 5.0, max_tokens=64)  # Algorithm 1 admits little
    sch = Scheduler(
        "alg1", 4, policy_gamma=None, threshold=0.5, cost=steep, sts=None,
        token_buckets=(4, 8, 16), has_confidence=True,
    )  # fmt: skip
    rho = np.random.default_rng(0).normal(1.0, 1.0, (3, 4))
    caps = np.full(3, 4)
    flat = dataclasses.replace(sch.policy.cost, token_buckets=())  # the curve Algorithm 1 walks
    base = causal_greedy_lengths(sch.calibrate(rho), flat, caps)
    got = sch.lengths(rho, caps)
    total = 3 + int(base.sum())
    bucket = next(b for b in (4, 8, 16) if b >= total)
    assert int(got.sum()) + 3 == bucket  # the padding is used
    assert np.all(got >= base)  # Algorithm 1's choice is kept
    assert np.array_equal(got, top_k_lengths(sch.calibrate(rho), bucket - 3, caps))


def test_no_retrace_with_committed_params_and_single_buckets(pair):
    """Checkpoint-loaded parameters are committed device arrays; the first prefill after warmup
    must hit the cache warmup() filled (regression: the initial slot state was uncommitted)."""
    import jax

    tcfg, tp, dcfg, dp = pair
    tp, dp = jax.device_put((tp, dp), jax.devices()[0])
    eng = ServingEngine(
        tcfg, dcfg, tp, dp, num_slots=2, max_len=48, prompt_buckets=(8,), token_buckets=(10,),
        modes=("greedy",),
    )  # fmt: skip
    eng.warmup()
    n = eng.compilations
    with CompileCounter() as cc:
        eng.generate([[1, 2, 3], [4] * 11], RequestParams(8, temperature=0.0))
    assert cc.count == 0, cc.names
    assert eng.compilations == n


def test_compilations_counts_this_engines_compiles(pair):
    """`compilations` counts the XLA compilations the engine's own calls cause (JAX's public
    compile events): a new bucket compiles and counts, the same shapes again do not, and a second
    engine over the same programs hits the cache (0)."""
    tcfg, tp, dcfg, dp = pair
    kw = dict(num_slots=2, max_len=40, prompt_buckets=(8,), token_buckets=(6, 10),
              modes=("greedy",))  # fmt: skip
    eng = ServingEngine(tcfg, dcfg, tp, dp, **kw)
    assert eng.compilations == 0
    with CompileCounter() as cc:
        eng.generate([[1, 2, 3]], RequestParams(6, temperature=0.0))
    assert eng.compilations == cc.count >= 2  # a prefill and a round at least
    n = eng.compilations
    eng.generate([[4, 5]], RequestParams(6, temperature=0.0))
    assert eng.compilations == n
    other = ServingEngine(tcfg, dcfg, tp, dp, **kw)
    other.generate([[1, 2, 3]], RequestParams(6, temperature=0.0))
    assert other.compilations == 0 and eng.compilations == n


def test_greedy_request_in_the_sampled_mode_equals_greedy_decoding(pair, refs):
    """A T = 0 request on an engine compiled for temperature sampling only (the evaluation's
    decoders, `evaluate_stage.eval_modes`) runs as a greedy row: plain greedy decoding's tokens
    and the argmax mode's acceptances, round for round."""
    from dspark_jax.config.pipeline import EvalStage
    from dspark_jax.run.evaluate_stage import eval_modes

    assert eval_modes(EvalStage(temperature=1.0, temperatures=(0.0,))) == ("sampled",)
    assert eval_modes(EvalStage(temperature=0.0, temperatures=())) == ("greedy",)
    tcfg, tp, dcfg, dp = pair
    outs = {}
    for mode in ("sampled", "greedy"):
        eng = ServingEngine(
            tcfg, dcfg, tp, dp, num_slots=3, max_len=96, prompt_buckets=(8, 16),
            token_buckets=(4, 8, 15), cache_buckets=(48, 96), modes=(mode,),
        )  # fmt: skip
        outs[mode] = eng.generate(PROMPTS, [RequestParams(m, temperature=0.0) for m in MAX_NEW])
    for o, r, ref in zip(outs["sampled"], outs["greedy"], refs):
        assert o.tokens == ref
        assert o.num_accepted == r.num_accepted and o.proposed == r.proposed
    assert sum(sum(o.num_accepted) for o in outs["sampled"]) > 0, "drafts must be accepted"
