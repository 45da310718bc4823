"""ServingEngine, sampled: a request's output does not depend on its slot or its neighbours, no
retrace across knobs / arrivals / policies, and with a scheduler on the output follows the
target's distribution (chi-square), which a deliberately biased policy fails."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dspark_jax.engine import RequestParams, ServingEngine
from dspark_jax.models import forward
from dspark_jax.sched import CostProfile
from dspark_jax.testing import CompileCounter
from tests.engine_models import agreeing_pair

COST = CostProfile.from_step_time(1.0, 0.08, max_tokens=64)


@pytest.fixture(scope="module")
def engine():
    tcfg, tp, dcfg, dp = agreeing_pair(vocab=64, gamma=4, head_scale=1.0, markov_bias=3.0)
    eng = ServingEngine(
        tcfg, dcfg, tp, dp, num_slots=3, max_len=96, prompt_buckets=(8, 16), token_buckets=(15,),
    )  # fmt: skip
    eng.warmup()
    return eng


def _drain(eng):
    while eng.has_work():
        eng.step()


def test_sampled_output_independent_of_slot_and_neighbours(engine):
    p = RequestParams(20, temperature=0.9, top_p=0.95, seed=11)
    alone = engine.generate([[5, 6, 7]], p)[0].tokens
    others = [
        RequestParams(15, temperature=1.3, top_k=5, seed=1),
        RequestParams(9, temperature=0.0),
        RequestParams(30, temperature=0.7, min_p=0.1, seed=2),
    ]
    h = [engine.submit([9, 9, 1, 2], others[0]), engine.submit([4], others[1])]
    engine.step()
    h.append(engine.submit([1, 2, 3, 4, 5], others[2]))
    mine = engine.submit([5, 6, 7], p)  # admitted later, into whichever slot frees first
    _drain(engine)
    assert mine.result().tokens == alone
    assert all(x.result().finish_reason == "length" for x in h)


def test_no_retrace_across_knobs_arrivals_and_policies(engine):
    knobs = [
        RequestParams(12, temperature=0.0),
        RequestParams(7, temperature=1.0, seed=3),
        RequestParams(10, temperature=0.5, top_k=3, seed=4, stop_ids=(1, 2)),
        RequestParams(9, temperature=1.2, top_p=0.8, min_p=0.05),
        RequestParams(5, temperature=0.0, stop_ids=(7,)),
    ]
    prompts = [[1], [2, 3, 4, 5, 6, 7, 8, 9, 10], [11] * 14, [12, 13], [30] * 20]
    with CompileCounter() as cc:
        for pol in ("fixed", "mtp1", "threshold", "alg1", "async"):
            engine.set_policy(pol, cost_profile=COST)
            for i, (pr, kn) in enumerate(zip(prompts, knobs)):
                engine.submit(pr, kn)
                if i % 2:
                    engine.step()
            _drain(engine)
    assert cc.count == 0, cc.names
    engine.set_policy("fixed")


def _exact_pair_law(tcfg, tp, prompt):
    """Exact law of (t2, t3) of plain sampling at T=1, by enumeration over (t1, t2)."""
    v = tcfg.vocab_size
    seqs = np.array([prompt + list(c) for c in itertools.product(range(v), repeat=2)], np.int32)
    pos = jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape)
    out, _ = forward(tcfg, tp, jnp.asarray(seqs), pos)
    lp = np.asarray(jax.nn.log_softmax(out.logits, -1), np.float64)
    n = len(prompt)
    t1, t2 = seqs[:, n], seqs[:, n + 1]
    joint = (
        np.exp(lp[0, n - 1])[t1][:, None]
        * np.exp(lp[np.arange(len(seqs)), n, t2])[:, None]
        * np.exp(lp[:, n + 1])
    )
    law = np.zeros((v, v))
    np.add.at(law, t2, joint)
    return law


def _chisquare(counts, law):
    expected = law.reshape(-1) / law.sum() * counts.sum()
    obs = counts.reshape(-1)
    keep = expected > 5
    o, e = obs[keep], expected[keep]
    if (~keep).any():
        o, e = np.append(o, obs[~keep].sum()), np.append(e, expected[~keep].sum())
    return stats.chisquare(o, e * o.sum() / e.sum())


def _law_engine(tcfg, dcfg, tp, dp, token_buckets):
    """A sampled-mode engine scheduled by Algorithm 1 for the chi-square tests (warmed up)."""
    eng = ServingEngine(
        tcfg, dcfg, tp, dp, num_slots=16, max_len=32, prompt_buckets=(8,),
        token_buckets=token_buckets, modes=("sampled",), policy="alg1",
        cost_profile=CostProfile.from_step_time(1.0, 0.003, max_tokens=64),
    )  # fmt: skip
    eng.warmup()
    return eng


def _pair_counts(eng, prompt, law, n, seed0):
    """Counts of (t2, t3) over n seeded T = 1 requests of 3 tokens, and their outputs."""
    params = [RequestParams(3, temperature=1.0, seed=seed0 + i) for i in range(n)]
    outs = eng.generate([prompt] * n, params)
    counts = np.zeros_like(law)
    for o in outs:
        counts[o.tokens[1], o.tokens[2]] += 1
    return counts, outs


def _pvalues(counts, law):
    """Chi-square p-values of the joint law of (t2, t3) and of the marginal of t2 (more power on
    one round's output)."""
    return [_chisquare(c, lw).pvalue for c, lw in ((counts, law), (counts.sum(1), law.sum(1)))]


class UnlikelyOnly:
    """Biased on purpose: verifies the drafts only when the first draft is NOT the drafter's own
    most likely token (admission looks at the draft's value), none otherwise."""

    def __init__(self, engine):
        self.engine = engine

    def __call__(self, conf, *, max_len=None, stale_conf=None):
        eng = self.engine
        slots = [r.slot for r in eng.slots.running()]
        state = eng.programs.state
        toks = np.asarray(state.prop_tokens)[slots, 0]
        fav = np.asarray(state.prop_probs)[slots, 0].argmax(-1)
        return np.where(toks != fav, np.minimum(max_len, eng.gamma), 0).astype(np.int32)


@pytest.mark.slow
def test_sampled_follows_target_law_with_scheduler_and_rejects_biased_policy():
    tcfg, tp, dcfg, dp = agreeing_pair(vocab=8, gamma=2, head_scale=0.4, markov_bias=0.0)
    prompt = [1, 2, 3, 4, 5, 6]
    law = _exact_pair_law(tcfg, tp, prompt)
    eng = _law_engine(tcfg, dcfg, tp, dp, (16, 20, 24, 32, 48))
    n = 6000
    counts, outs = _pair_counts(eng, prompt, law, n, 0)
    accepted = sum(sum(o.num_accepted) for o in outs)
    verified = [n for o in outs for n in o.proposed]
    assert accepted > n // 5, "drafts must be accepted for the test to mean anything"
    assert 0 < np.mean(verified) < 2, "the scheduler must actually vary the lengths"
    assert min(_pvalues(counts, law)) > 1e-3
    eng.set_policy(UnlikelyOnly(eng))
    bad, _ = _pair_counts(eng, prompt, law, n, 10**6)
    assert min(_pvalues(bad, law)) < 1e-6


@pytest.mark.slow
def test_eagle3_sampled_follows_target_law():
    """Eagle3's autoregressive drafts (a draft cache extended with the committed tokens) through
    slot prefill and packed rounds keep the target's law (chi-square on (t2, t3))."""
    from dspark_jax import drafters
    from dspark_jax.config import DrafterConfig
    from dspark_jax.models import init_params
    from dspark_jax.testing import tiny_target_config

    tcfg = tiny_target_config(vocab_size=8)
    tp = jax.tree.map(lambda x: x, init_params(tcfg, 1))
    tp["embed_tokens"] = tp["embed_tokens"].replace(tp["embed_tokens"][...] * 2.5)
    dcfg = DrafterConfig.eagle3(tcfg, block_size=2)
    dp = drafters.init_params(dcfg, seed=5, target_params=tp)
    prompt = [1, 2, 3, 4, 5, 6]
    law = _exact_pair_law(tcfg, tp, prompt)
    eng = ServingEngine(
        tcfg, dcfg, tp, dp, num_slots=16, max_len=32, prompt_buckets=(8,), token_buckets=(48,),
        modes=("sampled",),
    )  # fmt: skip
    eng.warmup()
    n = 6000
    outs = eng.generate([prompt] * n, [RequestParams(3, temperature=1.0, seed=i) for i in range(n)])
    counts = np.zeros_like(law)
    for o in outs:
        counts[o.tokens[1], o.tokens[2]] += 1
    assert sum(sum(o.num_accepted) for o in outs) > n // 10, "drafts must be accepted"
    for c, lw in ((counts, law), (counts.sum(1), law.sum(1))):
        chi = _chisquare(c, lw)
        assert chi.pvalue > 1e-3, chi


@pytest.mark.slow
def test_gemma4_sampled_follows_target_law_and_rejects_biased_policy():
    """A Gemma 4 target (every feature of tests/test_gemma4_engine.py's config, a sliding window
    of 2, soft-capped logits) through the slot engine at T = 1 with Algorithm 1, its sliding
    layers on rings of 2 + γ + 1 = 5 entries that the 8-token sequences wrap: chi-square of
    (t2, t3) against its exact law; the biased policy is caught by the same test."""
    import dataclasses

    from dspark_jax.config import TargetConfig
    from dspark_jax.testing import random_params
    from tests.engine_models import markov_drafter
    from tests.test_gemma4_engine import gemma_config

    base = gemma_config(sliding_window=2)
    v = 8
    tcfg = dataclasses.replace(
        base, vocab_size=v, gemma=dataclasses.replace(base.gemma, vocab_size_per_layer_input=v)
    )
    tp = random_params(tcfg, 3)
    # a Qwen3-shaped drafter reading the Gemma target's features (as tests/test_gemma4_engine.py)
    fields = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
              "head_dim", "rope_theta", "tie_word_embeddings", "max_position_embeddings",
              "target_layer_ids", "dtype")  # fmt: skip
    stand_in = TargetConfig(vocab_size=v, **{f: getattr(tcfg, f) for f in fields})
    perm = np.random.default_rng(0).permutation(v)
    dcfg, dp = markov_drafter(stand_in, tp, perm, 2, 1.5, 0)  # peaked drafts: the bias shows
    prompt = [1, 2, 3, 4, 5, 6]
    law = _exact_pair_law(tcfg, tp, prompt)
    assert law.max() < 0.5  # a law worth testing, not one token
    eng = _law_engine(tcfg, dcfg, tp, dp, (16, 24, 48))
    n = 6000
    counts, outs = _pair_counts(eng, prompt, law, n, 0)
    assert sum(sum(o.num_accepted) for o in outs) > n // 10, "drafts must be accepted"
    assert min(_pvalues(counts, law)) > 1e-3
    eng.set_policy(UnlikelyOnly(eng))
    bad, _ = _pair_counts(eng, prompt, law, n, 10**6)
    assert min(_pvalues(bad, law)) < 1e-6
