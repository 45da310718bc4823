"""Batched generation: greedy == naive argmax loop, seed/batch independence, stop tokens,
the sampled first-token distribution (chi-square), no retrace after warm-up, input errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dspark_jax.errors import RequestError
from dspark_jax.models import transformer as tf
from dspark_jax.models.generate import generate
from dspark_jax.spec.sampling import SamplingConfig, validate_sampling_params
from dspark_jax.testing import CompileCounter, tiny_target_config

# Untied head: a tied random model mostly predicts its own input token, which would make the
# greedy equivalence test weak.
CFG = tiny_target_config(tie_word_embeddings=False)
BUCKETS = dict(batch_buckets=(1, 4), length_buckets=(32, 64))  # most calls share one shape
SCFG = SamplingConfig(top_k=True, top_p=True)  # one static sampling mode shared by the tests
PROMPTS = [[5, 17, 3], list(range(40, 52)), [200], list(range(100, 119))]


@pytest.fixture(scope="module")
def params():
    return tf.init_params(CFG, seed=1)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _full_logits(cfg, params, tokens_1xT):
    t = tokens_1xT.shape[1]
    out, _ = tf.forward(cfg, params, tokens_1xT, jnp.arange(t)[None], None)
    return out.logits[0]


def naive_greedy(cfg, params, prompt, n, width=64):
    """Recompute the full sequence for every token (right-padded to `width`: causal masking
    makes the padding invisible to earlier positions)."""
    seq = list(prompt)
    for _ in range(n):
        padded = np.zeros((1, width), np.int32)
        padded[0, : len(seq)] = seq
        seq.append(int(np.argmax(_full_logits(cfg, params, padded)[len(seq) - 1])))
    return seq[len(prompt) :]


def test_greedy_equals_naive_recompute(params):
    max_new = [8, 5, 8, 3]
    out = generate(CFG, params, PROMPTS, max_new_tokens=max_new, **BUCKETS)
    want = [naive_greedy(CFG, params, p, n) for p, n in zip(PROMPTS, max_new)]
    assert out == want
    assert [len(o) for o in out] == max_new
    assert len({tuple(o) for o in out}) > 1 and any(len(set(o)) > 1 for o in out)
    # The host-driven loop computes the same thing.
    assert generate(CFG, params, PROMPTS, max_new_tokens=max_new, loop="host", **BUCKETS) == out


def test_sampled_independent_of_batch_composition(params):
    sampling = dict(temperature=[1.3, 0.8, 1.0, 2.0], top_k=[0, 50, 0, 7], top_p=[1.0, 1.0, 0.9, 1])
    seeds = [11, 22, 33, 44]
    run = functools.partial(
        generate,
        CFG,
        params,
        max_new_tokens=6,
        sampling_config=SCFG,
        **BUCKETS,
    )
    batch = run(PROMPTS, sampling=sampling, seeds=seeds)
    for i in range(4):
        alone = run(
            [PROMPTS[i]], seeds=[seeds[i]], sampling={k: [v[i]] for k, v in sampling.items()}
        )
        assert alone[0] == batch[i]
    # Same requests at other rows of another batch, next to a different padding length.
    pick = [2, 0]
    shuffled = run(
        [PROMPTS[i] for i in pick],
        seeds=[seeds[i] for i in pick],
        sampling={k: [v[i] for i in pick] for k, v in sampling.items()},
    )
    assert shuffled == [batch[i] for i in pick]
    assert run(PROMPTS, sampling=sampling, seeds=[1, 2, 3, 4]) != batch


def test_stop_tokens_end_a_row(params):
    free = generate(CFG, params, PROMPTS, max_new_tokens=8, **BUCKETS)
    stop = {free[0][2], free[1][4]}
    out = generate(CFG, params, PROMPTS, max_new_tokens=8, stop_ids=sorted(stop), **BUCKETS)
    for row, full in zip(out, free):
        hits = [j for j, t in enumerate(full) if t in stop]
        assert row == (full[: hits[0] + 1] if hits else full)
    assert len(out[0]) <= 3 and len(out[1]) <= 5


def _reference_probs(z, temperature, top_k, top_p):
    """softmax(z / T) restricted to the top-k, then to the smallest top-p nucleus (float64)."""
    z = np.asarray(z, np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(z.size, bool)
    keep[order[:top_k]] = True
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    mass, nucleus = 0.0, np.zeros(z.size, bool)
    for i in order[:top_k]:
        if mass < top_p:
            nucleus[i] = True
            mass += p[i]
    p = np.where(nucleus, p, 0.0)
    return p / p.sum()


def test_sampled_first_token_distribution(params):
    # Spread the logits so that temperature, top-k and top-p all shape the distribution.
    scaled = jax.tree.map(lambda x: x, params)
    scaled["lm_head"]["kernel"].set_value(params["lm_head"]["kernel"][...] * 10.0)
    prompt = [3, 1, 4, 1, 5]
    padded = np.zeros((1, 64), np.int32)
    padded[0, : len(prompt)] = prompt
    z = np.asarray(_full_logits(CFG, scaled, padded)[len(prompt) - 1])
    n, temperature, top_k, top_p = 2048, 1.5, 6, 0.85
    out = generate(
        CFG,
        scaled,
        [prompt] * n,
        max_new_tokens=1,
        seeds=range(n),
        sampling=dict(temperature=temperature, top_k=top_k, top_p=top_p),
        sampling_config=SCFG,
        batch_buckets=(1024,),
        length_buckets=(32,),
    )
    counts = np.bincount([o[0] for o in out], minlength=CFG.vocab_size)
    want = _reference_probs(z, temperature, top_k, top_p)
    assert 2 <= np.count_nonzero(want) < top_k, "the test needs top-p to bind inside top-k"
    assert counts[want == 0].sum() == 0
    support = want > 0
    _, p_value = stats.chisquare(counts[support], n * want[support])
    assert p_value > 1e-3, (counts[support], n * want[support])
    # The test has power: the top-k-only distribution (no nucleus cut) is clearly rejected.
    top_k_only = _reference_probs(z, temperature, top_k, 1.0)
    keep = top_k_only > 0
    _, p_wrong = stats.chisquare(counts[keep], n * top_k_only[keep])
    assert p_wrong < 1e-6


def test_no_retrace_after_warmup(params):
    # Warm-up: one greedy and one sampled call (batch bucket 4, prompt bucket 32, cache 32).
    generate(CFG, params, [[1, 2, 3], [4]], max_new_tokens=5, **BUCKETS)
    generate(
        CFG,
        params,
        [[1, 2], [3, 4, 5], [6]],
        max_new_tokens=[4, 6, 2],
        sampling=dict(temperature=[0.7, 1.0, 1.2], top_k=[0, 20, 5], top_p=[0.9, 1.0, 0.8]),
        sampling_config=SCFG,
        stop_ids=[7],
        **BUCKETS,
    )
    with CompileCounter() as cc:
        generate(CFG, params, [[9, 9, 9, 9, 9], [8], [7, 6]], max_new_tokens=[7, 3, 9], **BUCKETS)
        generate(
            CFG,
            params,
            [list(range(20)), [8, 8], [5], [1, 2, 3]],
            max_new_tokens=[2, 9, 5, 1],
            sampling=dict(
                temperature=[1.5, 0.3, 0.0, 1.0],
                top_k=[3, 0, 0, 100],
                top_p=[1.0, 0.5, 0.95, 0.7],
            ),
            sampling_config=SCFG,
            seeds=[5, 6, 7, 8],
            stop_ids=[1, 2, 3],
            key=jax.random.key(42),
            **BUCKETS,
        )
    assert (cc.count, cc.traces) == (0, 0), cc.names
    # ... and the guard can fail.
    with CompileCounter() as cc:
        jax.jit(lambda x: x + 1)(np.zeros(3, np.float32))
    assert (cc.count, cc.traces) == (1, 1)


def test_large_batch_is_split(params):
    prompts = [[i, i + 1] for i in range(6)]  # 6 > largest batch bucket 4: runs as 4 + 2
    out = generate(CFG, params, prompts, max_new_tokens=3, **BUCKETS)
    one_bucket = dict(batch_buckets=(4,), length_buckets=(32,))
    assert out == [generate(CFG, params, [p], max_new_tokens=3, **one_bucket)[0] for p in prompts]


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        ([[1, 2], []], {}, "empty prompt"),
        ([list(range(60))], dict(max_new_tokens=10), "cache"),
        ([[1, 2, CFG.vocab_size]], {}, "token ids"),
        ([[1, 2]], dict(max_new_tokens=0), "max_new_tokens"),
        ([[1, 2]], dict(sampling=dict(temperature=1.0, top_p=0.0)), "top_p"),
        ([[1, 2]], dict(sampling=dict(temperature=-1.0)), "temperature"),
        ([[1, 2]], dict(sampling=dict(temperature=1.0, top_k=1.5)), "top_k"),
        ([[1, 2]], dict(stop_ids=[-1]), "stop_ids"),
        ([[1], [2]], dict(seeds=[1]), "seeds"),
        (
            [[1]],
            dict(sampling=dict(temperature=1.0, top_k=3), sampling_config=SamplingConfig()),
            "top_k",
        ),
    ],
)
def test_bad_input_raises_before_work(params, prompts, kwargs, match):
    kwargs = {"max_new_tokens": 4, **kwargs}
    with CompileCounter() as cc, pytest.raises(ValueError, match=match):
        generate(CFG, params, prompts, **kwargs, **BUCKETS)
    assert cc.count == 0, cc.names
    assert issubclass(RequestError, ValueError)


def test_validated_sampling_params_are_accepted(params):
    sp = validate_sampling_params([0.0, 0.0], batch_size=2)
    greedy = generate(CFG, params, PROMPTS[:2], max_new_tokens=4, **BUCKETS)
    # All-zero temperatures select the static greedy mode: identical to sampling=None.
    assert generate(CFG, params, PROMPTS[:2], max_new_tokens=4, sampling=sp, **BUCKETS) == greedy


@pytest.mark.bitwise
def test_packed_forward_slot_major_attention_equals_the_per_token_gather(params):
    """The engine's batched verify layout (`slot_tokens`: queries slot-major, each slot's cache
    read in place) gives the logits and cache of the per-token gather layout and of each slot's
    own one-slot forward: ragged slots, an idle slot, bucket padding, a filled cache; the
    read-only forward (`packed_forward_kv`, the device-resident rounds') followed by `write_kv`
    gives the same logits and cache as the forward that writes as it goes; so does the writing
    forward that reads the tokens' own K/V back from the cache (`one_set`: the single-program
    engine's form, equal up to float reassociation) in every layout."""
    from dspark_jax.models.packed import SLOT_MAJOR_PAD, packed_forward, packed_forward_kv, write_kv

    rng = np.random.default_rng(3)
    n, s_max, g, s_b = 3, 40, 5, 32
    assert n * g <= SLOT_MAJOR_PAD * 10  # T = 10 below: the slot-major layout is the one run
    cache = tf.init_cache(CFG, n, s_max)
    fill = lambda kv: tuple(jnp.asarray(rng.standard_normal(x.shape), x.dtype) for x in kv)
    lengths = jnp.asarray([7, 12, 20], jnp.int32)
    cache = cache._replace(k=fill(cache.k), v=fill(cache.v), lengths=lengths)
    per_slot = [3, 0, 5]  # slot 1 idle; T = 10 with 2 padding tokens
    slot = np.concatenate([np.full(c, i) for i, c in enumerate(per_slot)] + [np.zeros(2)])
    off = np.concatenate([np.arange(c) for c in per_slot] + [np.zeros(2)])
    valid = np.arange(len(slot)) < sum(per_slot)
    slot, off = jnp.asarray(slot, jnp.int32), jnp.asarray(off, jnp.int32)
    pos = lengths[slot] + off
    toks = jnp.asarray(rng.integers(1, CFG.vocab_size, len(slot)), jnp.int32)
    valid = jnp.asarray(valid)

    @functools.partial(jax.jit, static_argnums=(0, 1, 8))
    def run(by_slot, read_only, cache, toks, slot, pos, valid, off, one_set=False):
        if read_only:
            out, c = packed_forward_kv(CFG, params, toks, slot, off, pos, valid, cache, s_b,
                                       slot_tokens=g if by_slot else 0)  # fmt: skip
        else:
            out, c = packed_forward(CFG, params, toks, slot, off, pos, valid, cache, s_b,
                                    slot_tokens=g if by_slot else 0, one_set=one_set)  # fmt: skip
        c = write_kv(cache, c) if read_only else c  # the resident rounds' form: write after
        return out.logits[0], c.k, c.v

    new, gather = (
        run(True, False, cache, toks, slot, pos, valid, off),
        run(False, False, cache, toks, slot, pos, valid, off),
    )
    m = np.asarray(valid)
    np.testing.assert_allclose(new[0][m], gather[0][m], rtol=1e-5, atol=1e-5)
    for by_slot, ref in ((True, new), (False, gather)):  # read-only forward, then the write
        later = run(by_slot, True, cache, toks, slot, pos, valid, off)
        np.testing.assert_allclose(later[0][m], ref[0][m], rtol=1e-6, atol=1e-6)
        for a, b in zip(later[1] + later[2], ref[1] + ref[2]):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    for by_slot, ref in ((True, new), (False, gather)):  # own K/V read back from the cache
        one_set = run(by_slot, False, cache, toks, slot, pos, valid, off, True)
        np.testing.assert_allclose(one_set[0][m], ref[0][m], rtol=1e-5, atol=1e-5)
        for a, b in zip(one_set[1] + one_set[2], ref[1] + ref[2]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    written = np.zeros(cache.k[0].shape[0:1] + cache.k[0].shape[2:3], bool)  # [N, S]
    written[np.asarray(slot)[m], np.asarray(pos)[m]] = True
    for a, b, before in zip(new[1] + new[2], gather[1] + gather[2], cache.k + cache.v):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        # the valid tokens' K/V written where they belong, nothing else touched
        keep = np.broadcast_to(~written[:, None, :, None], a.shape)
        np.testing.assert_array_equal(np.asarray(a)[keep], np.asarray(before)[keep])
        assert not np.array_equal(np.asarray(a)[~keep], np.asarray(before)[~keep])
    for i in (0, 2):  # each active slot alone, in a one-slot cache
        one = cache._replace(
            k=tuple(x[i : i + 1] for x in cache.k), v=tuple(x[i : i + 1] for x in cache.v),
            lengths=lengths[i : i + 1],
        )  # fmt: skip
        rows = np.flatnonzero(m & (np.asarray(slot) == i))
        z = jnp.zeros(len(rows), jnp.int32)
        ref = run(False, False, one, toks[rows], z, pos[rows], z == 0, off[rows])[0]
        np.testing.assert_allclose(new[0][rows], ref, rtol=1e-5, atol=1e-5)
        one_set = run(False, False, one, toks[rows], z, pos[rows], z == 0, off[rows], True)[0]
        np.testing.assert_allclose(one_set, ref, rtol=1e-5, atol=1e-5)
