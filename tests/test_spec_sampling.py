"""Sampling transforms vs a plain-numpy reference, greedy rows, validation, no retraces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dspark_jax.spec import sampling as S


def ref_probs(z_row, temperature, top_k, top_p, min_p):
    """Row-by-row reference written from the definitions (float64, loops)."""
    z_row = np.asarray(z_row, np.float64)
    vocab = z_row.size
    if temperature == 0:
        out = np.zeros(vocab)
        out[int(np.argmax(z_row))] = 1.0
        return out
    z = z_row / temperature
    keep = np.ones(vocab, bool)
    if 0 < top_k < vocab:
        kth = np.sort(z)[::-1][top_k - 1]
        keep &= z >= kth

    def probs_of(mask):
        e = np.where(mask, np.exp(z - z[mask].max()), 0.0)
        return e / e.sum()

    if top_p < 1:
        p = probs_of(keep)
        mass, last = 0.0, None
        for i in sorted(np.flatnonzero(keep), key=lambda i: -z[i]):
            if mass < top_p:
                last = z[i]
                mass += p[i]
        keep &= z >= last
    if min_p > 0:
        p = probs_of(keep)
        keep &= p >= min_p * p.max()
    return probs_of(keep)


def _cases():
    rng = np.random.default_rng(0)
    batch, vocab = 12, 9
    logits = rng.normal(size=(batch, vocab)) * 2.0
    logits[3] = np.round(logits[3])  # ties at top-k / top-p boundaries
    logits[4] = np.array([2, 2, 2, 1, 1, 0, 0, 0, -1.0])
    temperature = np.array([1.0, 0.5, 2.0, 1.0, 1.0, 0.0, 0.7, 1.3, 1.0, 1.0, 0.9, 1.0])
    top_k = np.array([0, 3, 1, 2, 4, 0, 5, 0, 9, 20, 2, 0])
    top_p = np.array([1.0, 1.0, 0.5, 0.8, 0.6, 1.0, 0.9, 0.3, 1.0, 0.95, 1.0, 1e-6])
    min_p = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.1, 0.0, 0.2, 0.0, 0.0, 0.0])
    return logits, temperature, top_k, top_p, min_p


def test_transform_matches_reference():
    logits, t, k, p, m = _cases()
    params = S.validate_sampling_params(t, k, p, m)
    cfg = S.SamplingConfig.for_params(params)
    assert cfg == S.SamplingConfig(top_k=True, top_p=True, min_p=True)
    got = np.asarray(S.probs_from_logits(jnp.asarray(logits, jnp.float32), params, cfg))
    for b in range(logits.shape[0]):
        want = ref_probs(logits[b].astype(np.float32), t[b], k[b], p[b], m[b])
        np.testing.assert_allclose(got[b], want, atol=2e-6, err_msg=f"row {b}")
        assert np.all((got[b] > 0) == (want > 0)), f"row {b} support differs"


def test_params_broadcast_over_positions():
    """[B] knobs apply to every position of [B, L, V] logits."""
    logits, t, k, p, m = _cases()
    params = S.validate_sampling_params(t, k, p, m)
    cfg = S.SamplingConfig.for_params(params)
    stacked = jnp.asarray(np.stack([logits, logits[:, ::-1]], axis=1), jnp.float32)  # [B, 2, V]
    got = S.probs_from_logits(stacked, params, cfg)
    one = S.probs_from_logits(jnp.asarray(logits, jnp.float32), params, cfg)
    np.testing.assert_array_equal(np.asarray(got[:, 0]), np.asarray(one))


def test_disabled_stages_are_identity():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(3, 50)), jnp.float32)
    params = S.validate_sampling_params(1.0, 0, 1.0, 0.0, batch_size=3)
    full = S.SamplingConfig(top_k=True, top_p=True, min_p=True)
    np.testing.assert_allclose(
        S.probs_from_logits(logits, params, full), jax.nn.softmax(logits), rtol=1e-6
    )


def test_greedy_mode_and_temperature_zero_rows_are_point_masses():
    logits = jnp.asarray([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 0.0, 0.0]])
    greedy = S.probs_from_logits(logits, None, S.SamplingConfig(greedy=True))
    np.testing.assert_array_equal(greedy, [[0, 1, 0, 0], [1, 0, 0, 0]])  # first max on ties
    params = S.validate_sampling_params([0.0, 1.0])
    mixed = S.probs_from_logits(logits, params, S.SamplingConfig())
    np.testing.assert_array_equal(mixed[0], greedy[0])
    assert float(mixed[1, 1]) > 0
    assert S.SamplingConfig.for_params(S.validate_sampling_params([0.0, 0.0])).greedy


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=1e-9), "temperature"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_p=1.5), "top_p"),
        (dict(temperature=1.0, top_k=-1), "top_k"),
        (dict(temperature=1.0, top_k=2.5), "top_k"),
        (dict(temperature=1.0, min_p=1.5), "min_p"),
        (dict(temperature=[1.0, 1.0], top_k=[1, 2, 3]), "batch"),
    ],
)
def test_validation_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        S.validate_sampling_params(**kwargs)


def test_validation_names_rows():
    with pytest.raises(ValueError, match=r"rows \[2\]"):
        S.validate_sampling_params([1.0, 0.5, -2.0])


def test_check_logits():
    x = np.zeros((2, 3, 4), np.float32)
    x[1, 2, 0] = -np.inf
    S.check_logits(x)  # -inf is a masked token, allowed
    x[1, 2, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        S.check_logits(x)
    S.check_logits(x, valid=np.array([[True, True, True], [True, True, False]]))
    x[0, 0, 0] = np.inf
    with pytest.raises(ValueError, match=r"\+inf"):
        S.check_logits(x)


def test_config_conflicts_and_coverage():
    with pytest.raises(ValueError, match="greedy"):
        S.SamplingConfig(greedy=True, top_k=True)
    params = S.validate_sampling_params([1.0, 1.0], top_k=[0, 5])
    assert "top_k" in S.SamplingConfig().covers(params)
    assert S.SamplingConfig(top_k=True).covers(params) is None
    assert "greedy" in S.SamplingConfig(greedy=True).covers(params)
    hash(S.SamplingConfig.for_params(params))  # static jit argument


def test_no_retrace_when_values_change():
    f = jax.jit(S.probs_from_logits, static_argnames="cfg")
    cfg = S.SamplingConfig(top_k=True, top_p=True, min_p=True)
    logits = jnp.zeros((4, 16))
    f(logits, S.validate_sampling_params([1.0, 0.5, 0.0, 2.0], 3, 0.9, 0.1), cfg=cfg)
    f(logits + 1, S.validate_sampling_params([0.2, 0.1, 1.0, 0.0], 0, 1.0, 0.0), cfg=cfg)
    assert f._cache_size() == 1


def test_sampler_matches_distribution():
    probs = np.array([0.5, 0.0, 0.2, 0.25, 0.05], np.float32)
    n = 40000
    keys = jax.random.split(jax.random.key(7), n)
    draws = np.asarray(S.sample_from_probs(keys, jnp.broadcast_to(probs, (n, 5))))
    counts = np.bincount(draws, minlength=5)
    assert counts[1] == 0
    keep = probs > 0
    assert stats.chisquare(counts[keep], n * probs[keep] / probs.sum()).pvalue > 1e-3


def test_noise_made_ahead_draws_what_categorical_draws():
    """Drafters make a block's Gumbel noise before their sequential loop: per key, the draw must
    be `jax.random.categorical`'s, bit for bit (the same tokens as drawing inside the loop)."""
    keys = jax.random.split(jax.random.key(5), 12).reshape(3, 4)
    logits = jnp.log(jax.random.dirichlet(jax.random.key(6), jnp.ones(50), (3, 4)))
    noise = S.gumbel_noise(keys, 50)
    assert noise.shape == (3, 4, 50)
    ahead = np.asarray(S.sample_with_noise(noise, logits))
    one_by_one = np.array(
        [[jax.random.categorical(keys[i, j], logits[i, j]) for j in range(4)] for i in range(3)]
    )
    np.testing.assert_array_equal(ahead, one_by_one)
    rows = S.sample_from_logits(keys.reshape(-1), logits.reshape(-1, 50))
    np.testing.assert_array_equal(np.asarray(rows).reshape(3, 4), ahead)


@pytest.mark.parametrize("filters", [True, False])
def test_one_reduction_draw_and_its_probs_equal_the_transforms(filters):
    """`sample_transformed` (greedy rows: the argmax, no point mass built) draws the token that
    Gumbel-max over `transform_logits` draws, for every noise draw, and `probs_of_draws` of those
    tokens is `probs_from_logits` exactly: sampled rows, greedy rows (ties: the first index)."""
    logits, t, k, p, m = _cases()
    t = t.copy()
    t[[3, 4, 9]] = 0.0  # greedy rows with ties (3: rounded logits, 4: a three-way tie at the top)
    if not filters:
        k, p, m = 0 * k, np.ones_like(p), 0 * m
    params = S.validate_sampling_params(t, k, p, m)
    cfg = S.SamplingConfig.for_params(params)
    x = jnp.asarray(logits, jnp.float32)
    keys = jax.random.split(jax.random.key(11), 64 * x.shape[0]).reshape(64, -1)
    noise = S.gumbel_noise(keys, x.shape[-1])  # [64, B, V]
    want = S.sample_with_noise(noise, S.transform_logits(x, params, cfg)[None])
    got = jax.vmap(lambda n: S.sample_transformed(n, x, params, cfg))(noise)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.all(np.asarray(got)[:, 4] == 0)  # the first of the tied maxima
    assert len(set(np.asarray(got)[:, 0].tolist())) > 1  # a sampled row varies with the noise
    for toks in np.asarray(got)[:4]:
        np.testing.assert_array_equal(
            np.asarray(S.probs_of_draws(x, jnp.asarray(toks), params, cfg)),
            np.asarray(S.probs_from_logits(x, params, cfg)),
        )
    greedy = S.SamplingConfig(greedy=True)
    top = S.sample_transformed(None, x, None, greedy)
    np.testing.assert_array_equal(np.asarray(top), np.argmax(logits.astype(np.float32), -1))
    np.testing.assert_array_equal(
        np.asarray(S.probs_of_draws(x, top, None, greedy)),
        np.asarray(S.probs_from_logits(x, None, greedy)),
    )
