"""Losslessness, tested by distribution (docs/ARCHITECTURE.md §5) - and shown able to fail.

1. Exact enumeration of one round on tiny vocabularies: the law of (round output + target
   continuation) equals the target's joint law, TV <= 1e-6, for greedy / temperature / top-k /
   top-p / min-p, with true draft distributions and with one-hot (deterministic) drafts. Two
   deliberately biased verifiers run through the same check and are caught.
2. Multi-round Monte Carlo with a toy Markov drafter whose confidences depend on the token it
   just sampled, scheduled by Algorithm 1, the asynchronous variant and the static threshold:
   chi-square of 1e5 generated sequences against the exact target law, p > 1e-3.
3. Paper Appendix A: a retrospective scheduler (global search on the current round, no early stop;
   it exists only here) turns a (0.7, 0.3) target into (0.85, 0.15) and the same chi-square test
   rejects it, while Algorithm 1 and the asynchronous variant pass in the same setup.
"""

import dataclasses
import itertools
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dspark_jax.sched import (
    AsyncTopK,
    CausalGreedy,
    CostProfile,
    StaticThreshold,
    global_capacity,
    top_k_lengths,
)
from dspark_jax.spec import (
    RequestRng,
    SamplingConfig,
    probs_from_logits,
    validate_sampling_params,
    verify_distributions,
)
from dspark_jax.spec.verify import verify

# ------------------------------------------------------------------------------------------------
# 1. Exact enumeration of one round
# ------------------------------------------------------------------------------------------------


class ToyLM:
    """A deterministic prefix -> logits table (depends on the whole prefix, not just the last
    token); ``base`` mixes in another model's logits so draft and target overlap."""

    def __init__(self, vocab, seed, scale=1.5, base=None, mix=0.0):
        self.vocab, self.seed, self.scale, self.base, self.mix = vocab, seed, scale, base, mix

    def logits(self, prefix):
        rng = np.random.default_rng([self.seed, len(prefix), *prefix])
        z = rng.normal(size=self.vocab) * self.scale
        if self.base is not None:
            z = self.mix * self.base.logits(prefix) + (1 - self.mix) * z
        return z.astype(np.float32)


def _prefixes(vocab, max_len):
    return [p for n in range(max_len + 1) for p in itertools.product(range(vocab), repeat=n)]


def exact_round_tv(vocab, num_slots, knobs, cfg, one_hot, dist_fn=verify_distributions, seed=0):
    """Max over n = 0..L of the TV between (round + continuation) and the target's law.

    Every admissible length n and every draft sequence of length n is one row of a single batch
    (static L = num_slots); slots >= n and target positions > n hold NaN / out-of-range garbage.
    """
    target = ToyLM(vocab, seed)
    drafter = ToyLM(vocab, seed + 1, base=target, mix=0.6)
    greedy = cfg.greedy
    prefixes = _prefixes(vocab, num_slots)
    table_params = None if greedy else validate_sampling_params(batch_size=len(prefixes), **knobs)
    table = np.asarray(
        probs_from_logits(
            jnp.asarray(np.stack([target.logits(p) for p in prefixes])), table_params, cfg
        ),
        np.float64,
    )
    p_target = {p: table[i] for i, p in enumerate(prefixes)}

    # The drafter samples with the same transform; under greedy verification it samples at T=1.
    draft_cfg = SamplingConfig() if greedy else cfg
    draft_knobs = {"temperature": 1.0} if greedy else knobs
    rows = []
    for n in range(num_slots + 1):
        if one_hot:
            d = ()
            for _ in range(n):
                d += (int(np.argmax(drafter.logits(d))),)
            rows.append((n, d))
        else:
            rows += [(n, d) for d in itertools.product(range(vocab), repeat=n)]
    batch = len(rows)
    t_logits = np.full((batch, num_slots + 1, vocab), np.nan, np.float32)
    d_logits = np.zeros((batch, num_slots, vocab), np.float32)
    tokens = np.full((batch, num_slots), -7, np.int32)
    for b, (n, d) in enumerate(rows):
        for i in range(n + 1):
            t_logits[b, i] = target.logits(d[:i])
        for i in range(n):
            d_logits[b, i] = drafter.logits(d[:i])
            tokens[b, i] = d[i]
    lengths = np.array([n for n, _ in rows], np.int32)
    masked = np.arange(num_slots)[None, :] >= lengths[:, None]
    params = validate_sampling_params(
        batch_size=batch, **(knobs if not greedy else {"temperature": 0})
    )
    d_params = validate_sampling_params(batch_size=batch, **draft_knobs)
    d_probs = np.array(probs_from_logits(jnp.asarray(d_logits), d_params, draft_cfg))
    weights = np.ones(batch)
    for b, (n, d) in enumerate(rows):
        if not one_hot:
            weights[b] = np.prod([d_probs[b, i, d[i]] for i in range(n)], dtype=np.float64)
    d_probs[masked] = np.nan
    alpha, dist = dist_fn(
        jnp.asarray(t_logits),
        jnp.asarray(tokens),
        None if one_hot else jnp.asarray(d_probs),
        jnp.asarray(lengths),
        None if greedy else params,
        cfg,
    )
    alpha, dist = np.asarray(alpha, np.float64), np.asarray(dist, np.float64)

    worst = 0.0
    for n in range(num_slots + 1):
        stop = defaultdict(float)  # law of the round's output y_0..y_A (A accepted + 1 token)
        for b in np.flatnonzero(lengths == n):
            d, reach = rows[b][1], weights[b]
            for a in range(n + 1):
                p_a = reach * (1.0 - alpha[b, a]) if a < n else reach
                for z in range(vocab):
                    stop[d[:a] + (z,)] += p_a * dist[b, a, z]
                if a < n:
                    reach *= alpha[b, a]
        tv = 0.0
        for y in itertools.product(range(vocab), repeat=n + 1):
            want = np.prod([p_target[y[:i]][y[i]] for i in range(n + 1)])
            got = sum(
                stop.get(y[: a + 1], 0.0)
                * np.prod([p_target[y[:i]][y[i]] for i in range(a + 1, n + 1)])
                for a in range(n + 1)
            )
            tv += 0.5 * abs(got - want)
        worst = max(worst, tv)
    return worst


SAMPLED = SamplingConfig()
CASES = {
    "greedy": (dict(temperature=0.0), SamplingConfig(greedy=True)),
    "t1": (dict(temperature=1.0), SAMPLED),
    "t1.4_topk3": (dict(temperature=1.4, top_k=3), SamplingConfig(top_k=True)),
    "t0.7_topp0.75": (dict(temperature=0.7, top_p=0.75), SamplingConfig(top_p=True)),
    "t0.8_topk4_topp0.9_minp0.05": (
        dict(temperature=0.8, top_k=4, top_p=0.9, min_p=0.05),
        SamplingConfig(top_k=True, top_p=True, min_p=True),
    ),
    "t0_row_in_sampled_mode": (dict(temperature=0.0), SAMPLED),
}


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("case", list(CASES))
def test_exact_enumeration(case, one_hot):
    knobs, cfg = CASES[case]
    tv = exact_round_tv(5, 3, knobs, cfg, one_hot)
    assert tv <= 1e-6, tv


def test_exact_enumeration_wider_vocab():
    knobs, cfg = CASES["t1.4_topk3"]
    assert exact_round_tv(6, 2, knobs, cfg, one_hot=False, seed=3) <= 1e-6


def _resample_from_target(target_logits, tokens, d_probs, lengths, params, cfg):
    """Bug: after a rejection, draw from p_t instead of the residual."""
    alpha, dist = verify_distributions(target_logits, tokens, d_probs, lengths, params, cfg)
    pt = probs_from_logits(target_logits, params, cfg)
    rows = jnp.arange(pt.shape[1])[None, :, None]
    return alpha, jnp.where(rows < lengths[:, None, None], pt, dist)


def _accept_if_more_likely(target_logits, tokens, d_probs, lengths, params, cfg):
    """Bug: accept deterministically iff p_t(d) >= p_d(d) (no uniform)."""
    alpha, dist = verify_distributions(target_logits, tokens, d_probs, lengths, params, cfg)
    pt = probs_from_logits(target_logits, params, cfg)[:, :-1]
    pt_d = jnp.take_along_axis(pt, jnp.clip(tokens, 0)[..., None], -1)[..., 0]
    pd_d = jnp.take_along_axis(d_probs, jnp.clip(tokens, 0)[..., None], -1)[..., 0]
    return jnp.where(alpha > 0, (pt_d >= pd_d).astype(alpha.dtype), 0.0), dist


@pytest.mark.parametrize("biased", [_resample_from_target, _accept_if_more_likely])
def test_biased_verifier_fails_enumeration(biased):
    knobs, cfg = CASES["t1"]
    tv = exact_round_tv(5, 3, knobs, cfg, one_hot=False, dist_fn=biased)
    assert tv > 1e-3, f"the enumeration check did not catch {biased.__name__}: TV {tv}"


# ------------------------------------------------------------------------------------------------
# 2./3. Multi-round Monte Carlo with schedulers
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MarkovSetup:
    target: np.ndarray  # [V, V]: p_t(next | previous token)
    draft: np.ndarray  # [V, V]: p_d(next | previous token)
    conf: np.ndarray  # [γ, V]: c_k = conf[k, token sampled just before slot k]
    cost: CostProfile
    group_size: int  # requests scheduled together
    start: int = 0

    def sequence_law(self, n_tokens):
        law = np.ones([self.target.shape[0]] * n_tokens)
        for y in itertools.product(range(self.target.shape[0]), repeat=n_tokens):
            prev = (self.start,) + y[:-1]
            law[y] = np.prod([self.target[p, t] for p, t in zip(prev, y)])
        return law.reshape(-1)


def simulate(setup, schedule, n_samples, n_tokens, seed):
    """Generate ``n_samples`` sequences of ``n_tokens`` tokens by speculative rounds.

    ``schedule(conf [groups, R, γ], history) -> lengths [groups, R]``; history holds the
    confidences of earlier rounds (oldest first). Returns (sequences [N, n_tokens], lengths seen).
    """
    vocab, gamma = setup.target.shape[0], setup.conf.shape[0]
    groups = n_samples // setup.group_size
    n = groups * setup.group_size
    rng = np.random.default_rng(seed)
    out = np.zeros((n, n_tokens + gamma + 1), np.int64)
    length = np.zeros(n, np.int64)
    anchor = np.full(n, setup.start)
    key = jax.random.key(seed)
    seeds = jnp.arange(n, dtype=jnp.int32)
    params = validate_sampling_params(1.0, batch_size=n)
    draft_cdf = np.cumsum(setup.draft, axis=1)
    history, seen = [], []
    for _ in range(n_tokens):  # each round emits >= 1 token
        drafts = np.zeros((n, gamma), np.int64)
        conf = np.zeros((n, gamma))
        prev = anchor
        for k in range(gamma):
            conf[:, k] = setup.conf[k, prev]
            u = rng.random(n)[:, None]
            drafts[:, k] = np.minimum((u >= draft_cdf[prev]).sum(1), vocab - 1)
            prev = drafts[:, k]
        before = np.concatenate([anchor[:, None], drafts], axis=1)  # [N, γ+1]
        conf_g = conf.reshape(groups, setup.group_size, gamma)
        lengths = np.asarray(schedule(conf_g, history)).reshape(n)
        history.append(conf_g)
        seen.append(lengths)
        acc, nxt = verify(
            np.log(setup.target[before]).astype(np.float32),
            drafts.astype(np.int32),
            setup.draft[before[:, :-1]].astype(np.float32),
            lengths.astype(np.int32),
            RequestRng(key, seeds, jnp.asarray(length, jnp.int32)),
            params,
            SamplingConfig(),
        )
        acc, nxt = np.asarray(acc), np.asarray(nxt)
        slot = np.arange(gamma + 1)[None, :]
        emitted = np.where(slot < acc[:, None], np.pad(drafts, ((0, 0), (0, 1))), nxt[:, None])
        write = slot <= acc[:, None]
        cols = np.minimum(length[:, None] + slot, out.shape[1] - 1)
        rows = np.broadcast_to(np.arange(n)[:, None], cols.shape)
        out[rows[write], cols[write]] = emitted[write]
        length = length + acc + 1
        anchor = nxt.astype(np.int64)
    return out[:, :n_tokens], np.concatenate(seen)


def chi_square_pvalue(setup, schedule, n_samples=100_000, n_tokens=4, seed=0):
    seqs, lengths = simulate(setup, schedule, n_samples, n_tokens, seed)
    vocab = setup.target.shape[0]
    cells = np.ravel_multi_index(seqs.T, (vocab,) * n_tokens)
    counts = np.bincount(cells, minlength=vocab**n_tokens)
    law = setup.sequence_law(n_tokens)
    return stats.chisquare(counts, law * counts.sum()).pvalue, seqs, lengths


def causal(setup):
    policy = CausalGreedy(setup.cost)
    return lambda conf, history: policy(conf)


def asynchronous(setup):
    policy = AsyncTopK(setup.cost, cold_start_gamma=1)
    return lambda conf, history: policy(conf, stale_conf=history[-2] if len(history) >= 2 else None)


def retrospective(setup):
    """Paper Appendix A: global search over the *current* confidences (no early stop). Biased."""
    return lambda conf, history: top_k_lengths(conf, global_capacity(conf, setup.cost))


def threshold(setup):
    policy = StaticThreshold(0.5)
    return lambda conf, history: policy(conf)


MARKOV = MarkovSetup(
    target=np.array([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.3, 0.3, 0.4]]),
    draft=np.array([[0.5, 0.4, 0.1], [0.3, 0.3, 0.4], [0.15, 0.25, 0.6]]),
    conf=np.array([[0.9, 0.6, 0.4], [0.8, 0.3, 0.95], [0.7, 0.5, 0.2]]),
    cost=CostProfile.from_step_time(1.0, 0.12),
    group_size=4,
)


@pytest.mark.parametrize("make_schedule", [causal, asynchronous, threshold])
def test_multiround_chi_square(make_schedule):
    p, _, lengths = chi_square_pvalue(MARKOV, make_schedule(MARKOV), seed=1)
    # The schedule must really vary with the confidences for the test to mean anything.
    assert len(np.unique(lengths)) >= 3, np.bincount(lengths)
    assert p > 1e-3, p


# Appendix A. One request, two drafts, V = {0, 1}. Target (0.7, 0.3) at every step; the drafter
# proposes (0.5, 0.5). Slot 1's confidence is 0.5 whatever the anchor; slot 2's depends on the
# token just drafted: 0.9 after a 0, 0.1 after a 1. SPS(1, 2, 3 tokens) = (1, 0.6, 0.55):
#   Theta(0 drafts) = 1 x 1 = 1;  Theta(1) = 1.5 x 0.6 = 0.9;
#   Theta(2) = (1 + 0.5 + 0.45) x 0.55 = 1.0725 after d_1 = 0, (1 + 0.5 + 0.05) x 0.55 = 0.85 after 1.
# Algorithm 1 stops at 0 drafts (0.9 < 1). The retrospective search verifies both drafts exactly
# when d_1 = 0, where p_t(0) = 0.7 >= p_d(0) = 0.5 means d_1 is always accepted:
#   P(first token = 0) = 0.5 x 1 + 0.5 x 0.7 = 0.85  instead of 0.7.
APPENDIX_A = MarkovSetup(
    target=np.array([[0.7, 0.3], [0.7, 0.3]]),
    draft=np.array([[0.5, 0.5], [0.5, 0.5]]),
    conf=np.array([[0.5, 0.5], [0.9, 0.1]]),
    cost=CostProfile((1, 2, 3), (1.0, 0.6, 0.55)),
    group_size=1,
)


@pytest.mark.parametrize("make_schedule", [causal, asynchronous])
def test_appendix_a_setup_lossless_schedulers_pass(make_schedule):
    p, _, _ = chi_square_pvalue(APPENDIX_A, make_schedule(APPENDIX_A), n_tokens=3, seed=2)
    assert p > 1e-3, p


def test_appendix_a_retrospective_scheduler_is_rejected():
    p, seqs, lengths = chi_square_pvalue(APPENDIX_A, retrospective(APPENDIX_A), n_tokens=3, seed=2)
    first = np.bincount(seqs[:, 0], minlength=2) / len(seqs)
    assert abs(first[0] - 0.85) < 0.005, first  # (0.85, 0.15) where the target is (0.7, 0.3)
    assert set(np.unique(lengths)) == {0, 2}
    assert p < 1e-3, "the chi-square test failed to reject a biased scheduler"
