"""The speculative engine end to end: greedy equals greedy decoding token for token, and sampled
output follows the target's distribution (chi-square), which a drafter-only decoder fails."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dspark_jax import drafters
from dspark_jax.config import DrafterConfig
from dspark_jax.engine.speculative import SpeculativeDecoder
from dspark_jax.models import forward, init_params
from dspark_jax.models.generate import generate
from dspark_jax.testing import tiny_target_config

KINDS = ("dspark", "dflash", "eagle3")


def _drafter_cfg(kind, tcfg, gamma=3):
    if kind == "eagle3":
        return DrafterConfig.eagle3(tcfg, block_size=gamma)
    common = dict(num_layers=1, block_size=gamma, mask_token_id=3, num_anchors=8)
    if kind == "dflash":
        return DrafterConfig.dflash(tcfg, **common)
    return DrafterConfig.dspark(tcfg, markov_rank=8, **common)


def _peaky(params, scale):
    """Scale the (tied) embedding so the random target's distributions are far from uniform."""
    params = jax.tree.map(lambda x: x, params)
    params["embed_tokens"] = params["embed_tokens"].replace(params["embed_tokens"][...] * scale)
    return params


@pytest.fixture(scope="module")
def tiny():
    tcfg = tiny_target_config()
    return tcfg, init_params(tcfg, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_greedy_decoding(tiny, kind):
    tcfg, tp = tiny
    tp = _peaky(tp, 20.0)
    dcfg = _drafter_cfg(kind, tcfg, gamma=4)
    dp = drafters.init_params(dcfg, target_params=tp)
    dec = SpeculativeDecoder(tcfg, dcfg, tp, dp, max_len=128, length_buckets=(16,))
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46]]
    res = dec.generate(prompts, max_new_tokens=24, temperature=0.0)
    total_acc = 0
    for p, r in zip(prompts, res):
        assert r.tokens == generate(tcfg, tp, [p], max_new_tokens=24)[0]  # plain greedy
        total_acc += sum(r.num_accepted)
        assert all(0 <= a <= n for a, n in zip(r.num_accepted, r.proposed))
    # fewer rounds than tokens whenever anything was accepted
    assert sum(len(r.num_accepted) for r in res) <= sum(len(r.tokens) for r in res)


def test_stop_tokens_end_requests(tiny):
    tcfg, tp = tiny
    tp = _peaky(tp, 20.0)
    dcfg = _drafter_cfg("dflash", tcfg)
    dp = drafters.init_params(dcfg, target_params=tp)
    dec = SpeculativeDecoder(tcfg, dcfg, tp, dp, max_len=128, length_buckets=(16,))
    ref = generate(tcfg, tp, [[5, 6, 7]], max_new_tokens=20)[0]
    stop = ref[6]
    cut = ref.index(stop) + 1
    (r,) = dec.generate([[5, 6, 7]], max_new_tokens=20, temperature=0.0, stop_ids=[stop])
    assert r.tokens == ref[:cut]


def test_sampled_independent_of_batch_composition(tiny):
    tcfg, tp = tiny
    dcfg = _drafter_cfg("dspark", tcfg)
    dp = drafters.init_params(dcfg, target_params=tp)
    dec = SpeculativeDecoder(tcfg, dcfg, tp, dp, max_len=128, length_buckets=(16,))
    alone = dec.generate([[5, 6, 7]], max_new_tokens=16, temperature=1.0, top_p=0.9, seeds=[7])
    mixed = dec.generate(
        [[9, 9], [5, 6, 7], [1, 2, 3, 4, 5, 6]],
        max_new_tokens=16,
        temperature=[0.5, 1.0, 1.3],
        top_p=[1.0, 0.9, 0.8],
        seeds=[1, 7, 3],
    )
    assert mixed[1].tokens == alone[0].tokens


def _exact_pair_law(tcfg, tp, prompt):
    """Exact P(t1, t2, t3) of plain sampling at T=1 (t1 from the prompt), by enumeration."""
    v = tcfg.vocab_size
    seqs = np.array([prompt + list(c) for c in itertools.product(range(v), repeat=2)], np.int32)
    pos = jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape)
    out, _ = forward(tcfg, tp, jnp.asarray(seqs), pos)
    lp = jax.nn.log_softmax(out.logits, -1)  # [V*V, T, V]
    n = len(prompt)
    p1 = np.exp(np.asarray(lp[0, n - 1]))  # [V]
    t1, t2 = seqs[:, n], seqs[:, n + 1]
    p2 = np.exp(np.asarray(lp[np.arange(len(seqs)), n, t2]))  # P(t2 | t1)
    p3 = np.exp(np.asarray(lp[:, n + 1]))  # [V*V, V] P(t3 | t1, t2)
    joint = p1[t1][:, None] * p2[:, None] * p3  # [V*V, V] over (t1, t2) x t3
    # marginal over t1 -> law of (t2, t3)
    law = np.zeros((v, v))
    for i in range(len(seqs)):
        law[t2[i]] += joint[i]
    return law


def _chisquare(obs, expected, keep):
    """Chi-square with the cells of expected count <= 5 pooled into one."""
    o, e = obs[keep], expected[keep]
    if expected[~keep].sum() > 0:
        o, e = np.append(o, obs[~keep].sum()), np.append(e, expected[~keep].sum())
    return stats.chisquare(o, e * o.sum() / e.sum())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_sampled_output_follows_target_distribution(kind):
    """(t2, t3) come out of speculative rounds (accepted drafts, residuals or bonus tokens); their
    empirical law matches the exact target law, while the drafter's own samples do not."""
    tcfg = tiny_target_config(vocab_size=8)
    tp = _peaky(init_params(tcfg, 1), 2.5)
    dcfg = _drafter_cfg(kind, tcfg, gamma=2)
    if kind != "eagle3":
        dcfg = dcfg.replace(mask_token_id=3)
    dp = drafters.init_params(dcfg, seed=5, target_params=tp)
    dp = dp._replace(frozen=jax.tree.map(lambda x: x, dp.frozen))
    prompt = [1, 2, 3]
    law = _exact_pair_law(tcfg, tp, prompt)
    n = 6000
    dec = SpeculativeDecoder(tcfg, dcfg, tp, dp, max_len=32, length_buckets=(8,))
    res = dec.generate([prompt] * n, max_new_tokens=3, temperature=1.0, seeds=np.arange(n))
    counts = np.zeros_like(law)
    accepted = 0
    for r in res:
        counts[r.tokens[1], r.tokens[2]] += 1
        accepted += sum(r.num_accepted)
    assert accepted > n // 10, "drafts must actually be accepted for the test to mean anything"
    expected = law.reshape(-1) / law.sum() * n
    keep = expected > 5
    obs = counts.reshape(-1)
    chi = _chisquare(obs, expected, keep)
    assert chi.pvalue > 1e-3, chi

    # the same test rejects a decoder that emits the drafter's own samples (no verification)
    props = jax.jit(drafters.propose, static_argnames=("cfg", "scfg"))
    from dspark_jax.engine.speculative import prefill
    from dspark_jax.spec.sampling import SamplingConfig, validate_sampling_params

    scfg = SamplingConfig()
    sp = validate_sampling_params(1.0, batch_size=n)
    toks = jnp.asarray([prompt] * n, jnp.int32)
    st = prefill(
        tcfg, dcfg, scfg, 32, tp, dp, toks, jnp.full((n,), 3, jnp.int32), jax.random.key(0),
        jnp.arange(n, dtype=jnp.uint32), sp,
    )  # fmt: skip
    prop = props(dcfg, dp, st.ctx, st.anchor, jax.random.key(0), jnp.arange(n), sp, scfg)
    d = np.asarray(prop.tokens)
    bad = np.zeros_like(law)
    np.add.at(bad, (d[:, 0], d[:, 1]), 1)
    obs = bad.reshape(-1)
    chi_bad = _chisquare(obs, expected, keep)
    assert chi_bad.pvalue < 1e-6, chi_bad


def test_no_retrace_after_warmup(tiny):
    """New prompts (same length bucket), seeds and per-request knobs reuse the compiled rounds."""
    from dspark_jax.testing import CompileCounter

    tcfg, tp = tiny
    dcfg = _drafter_cfg("dspark", tcfg)
    dp = drafters.init_params(dcfg, target_params=tp)
    dec = SpeculativeDecoder(tcfg, dcfg, tp, dp, max_len=128, length_buckets=(16,))
    kw = dict(max_new_tokens=12, top_k=[0, 5], top_p=[1.0, 0.9])
    dec.generate([[5, 6, 7], [8, 9]], temperature=[1.0, 0.7], seeds=[0, 1], **kw)
    with CompileCounter() as cc:
        dec.generate([[1, 2, 3, 4, 5, 6], [7]], temperature=[0.3, 1.2], seeds=[5, 9], **kw)
        dec.generate([[9] * 12, [4, 4]], temperature=[1.0, 0.9], seeds=[2, 3], stop_ids=[17], **kw)
    assert cc.count == 0, cc.names
