"""Chain verification: greedy rule, key convention, masking, batch independence, sampler law."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dspark_jax.spec import rng as R
from dspark_jax.spec import sampling as S
from dspark_jax.spec import verify as V

GREEDY = S.SamplingConfig(greedy=True)


def make_round(batch=24, num_slots=3, vocab=6, seed=0, temperature=1.0, **knobs):
    """Random target logits, draft distributions and drafts drawn from them."""
    rng = np.random.default_rng(seed)
    target = rng.normal(size=(batch, num_slots + 1, vocab)).astype(np.float32) * 1.5
    draft_logits = 0.6 * target[:, :num_slots] + rng.normal(size=(batch, num_slots, vocab))
    params = S.validate_sampling_params(temperature, batch_size=batch, **knobs)
    cfg = S.SamplingConfig.for_params(params)
    draft_probs = np.asarray(S.probs_from_logits(jnp.asarray(draft_logits), params, cfg))
    cdf = np.cumsum(draft_probs.astype(np.float64), -1)
    u = rng.random((batch, num_slots, 1)) * cdf[..., -1:]
    drafts = np.minimum((u > cdf).sum(-1), vocab - 1).astype(np.int32)
    lengths = rng.integers(0, num_slots + 1, size=batch).astype(np.int32)
    rng_ = R.RequestRng(
        jax.random.key(seed),
        jnp.asarray(rng.integers(0, 2**31, size=batch), jnp.int32),
        jnp.asarray(rng.integers(0, 1000, size=batch), jnp.int32),
    )
    return dict(
        target_logits=target,
        draft_tokens=drafts,
        draft_probs=draft_probs,
        lengths=lengths,
        rng=rng_,
        params=params,
        cfg=cfg,
    )


def run(r, **over):
    r = {**r, **over}
    out = V.verify(
        r["target_logits"],
        r["draft_tokens"],
        r["draft_probs"],
        r["lengths"],
        r["rng"],
        r["params"],
        r["cfg"],
    )
    return tuple(np.asarray(x) for x in out)


def test_greedy_accepts_iff_argmax():
    r = make_round(seed=1)
    top = r["target_logits"].argmax(-1)
    drafts = np.where(np.random.default_rng(2).random((24, 3)) < 0.7, top[:, :3], 0)
    r["lengths"] = np.full(24, 3, np.int32)
    acc, nxt = run(r, draft_tokens=drafts.astype(np.int32), cfg=GREEDY, params=None, rng=None)
    for b in range(24):
        a = 0
        while a < 3 and drafts[b, a] == top[b, a]:
            a += 1
        assert acc[b] == a and nxt[b] == top[b, a]


def test_accept_decisions_follow_key_convention():
    """Recompute the decisions from the documented keys and formulas."""
    r = make_round(seed=3)
    acc, nxt = run(r)
    alpha, dist = V.verify_distributions(
        jnp.asarray(r["target_logits"]),
        jnp.asarray(r["draft_tokens"]),
        jnp.asarray(r["draft_probs"]),
        jnp.asarray(r["lengths"]),
        r["params"],
        r["cfg"],
    )
    key, seeds, pos = r["rng"]

    @jax.jit
    def uniforms(key, seeds, pos):
        slot_pos = pos[:, None] + 1 + jnp.arange(3)[None, :]
        keys = R.position_keys(key, R.ACCEPT, seeds, slot_pos)
        return jax.vmap(jax.vmap(lambda k: jax.random.uniform(k)))(keys)

    u = np.asarray(uniforms(key, seeds, pos))
    ok = (u < np.asarray(alpha)) & (np.arange(3)[None, :] < r["lengths"][:, None])
    want_acc = np.cumprod(ok, axis=1).sum(1)
    np.testing.assert_array_equal(acc, want_acc)
    law = jnp.asarray(np.asarray(dist)[np.arange(24), acc])
    draw = jax.jit(lambda p: S.sample_from_probs(R.position_keys(key, R.SAMPLE, seeds, p), law))
    np.testing.assert_array_equal(nxt, np.asarray(draw(pos + 1 + jnp.asarray(acc))))


def test_zero_length_round_equals_plain_sampling():
    """lengths = 0: the next token is exactly plain decoding's draw at position pos + 1."""
    r = make_round(seed=4)
    r["lengths"] = np.zeros(24, np.int32)
    acc, nxt = run(r)
    key, seeds, pos = r["rng"]
    probs = S.probs_from_logits(jnp.asarray(r["target_logits"][:, 0]), r["params"], r["cfg"])
    keys = jax.jit(R.position_keys, static_argnums=1)(key, R.SAMPLE, seeds, pos + 1)
    plain = S.sample_from_probs(keys, probs)
    assert np.all(acc == 0)
    np.testing.assert_array_equal(nxt, np.asarray(plain))


@pytest.mark.parametrize("mode", ["probs", "one_hot", "greedy"])
def test_masked_positions_are_never_read(mode):
    r = make_round(seed=5, top_k=4)
    if mode == "one_hot":
        r["draft_probs"] = None
    if mode == "greedy":
        r.update(cfg=GREEDY, params=None, rng=None, draft_probs=None)
    clean = run(r)
    lengths = r["lengths"]
    slot = np.arange(3)[None, :]
    dirty = dict(r)
    t = r["target_logits"].copy()
    t[np.arange(4)[None, :] > lengths[:, None]] = np.nan
    dirty["target_logits"] = t
    d = r["draft_tokens"].copy()
    masked = slot >= lengths[:, None]
    d[masked] = np.random.default_rng(0).choice([-3, 2, 99, 10**6], size=masked.sum())
    dirty["draft_tokens"] = d
    if r["draft_probs"] is not None:
        p = r["draft_probs"].copy()
        p[slot >= lengths[:, None]] = np.nan
        dirty["draft_probs"] = p
    got = run(dirty)
    np.testing.assert_array_equal(got[0], clean[0])
    np.testing.assert_array_equal(got[1], clean[1])


@pytest.mark.parametrize("cfg_name", ["sampled", "greedy"])
def test_result_independent_of_batch_composition(cfg_name):
    r = make_round(seed=6, temperature=0.8, top_k=4)
    if cfg_name == "greedy":
        r.update(cfg=GREEDY, params=None, rng=None)
    full = run(r)

    def subset(idx, pad_to=None):
        sub = {}
        for name in ("target_logits", "draft_tokens", "draft_probs", "lengths"):
            sub[name] = r[name][idx]
        if r["rng"] is not None:
            key, seeds, pos = r["rng"]
            sub["rng"] = R.RequestRng(key, seeds[idx], pos[idx])
            sub["params"] = S.SamplingParams(*(f[idx] for f in r["params"]))
        if pad_to:
            extra = pad_to - len(idx)
            junk = make_round(batch=extra, seed=99, temperature=0.8, top_k=4)
            for name in ("target_logits", "draft_tokens", "draft_probs", "lengths"):
                sub[name] = np.concatenate([sub[name], junk[name]])
            if r["rng"] is not None:
                sub["rng"] = R.RequestRng(
                    key, *(jnp.concatenate([a, b]) for a, b in zip(sub["rng"][1:], junk["rng"][1:]))
                )
                sub["params"] = S.SamplingParams(
                    *(jnp.concatenate([a, b]) for a, b in zip(sub["params"], junk["params"]))
                )
        return run(r, **sub)

    perm = np.random.default_rng(0).permutation(24)
    for idx, pad in ((perm, None), (np.array([3]), None), (np.array([6, 1, 17]), 24)):
        acc, nxt = subset(idx, pad)
        np.testing.assert_array_equal(acc[: len(idx)], full[0][idx])
        np.testing.assert_array_equal(nxt[: len(idx)], full[1][idx])


def test_one_hot_flag_equals_explicit_one_hot_probs():
    r = make_round(seed=7)
    explicit = np.eye(6, dtype=np.float32)[r["draft_tokens"]]
    a = run(r, draft_probs=None)
    b = run(r, draft_probs=explicit)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_no_draft_slots():
    r = make_round(num_slots=0, seed=8)
    acc, nxt = run(r)
    assert acc.shape == (24,) and np.all(acc == 0) and np.all((0 <= nxt) & (nxt < 6))


def test_sampler_matches_exact_round_law():
    """Many seeds of one request: the (A, next token) counts follow verify_distributions."""
    base = make_round(batch=1, num_slots=2, vocab=4, seed=9, temperature=1.0)
    base["lengths"] = np.array([2], np.int32)
    n = 30000
    rep = {k: np.repeat(base[k], n, axis=0) for k in ("target_logits", "draft_tokens")}
    rep["draft_probs"] = np.repeat(base["draft_probs"], n, axis=0)
    rep["lengths"] = np.full(n, 2, np.int32)
    rep["rng"] = R.RequestRng(jax.random.key(1), jnp.arange(n), jnp.full(n, 17))
    rep["params"] = S.validate_sampling_params(1.0, batch_size=n)
    acc, nxt = run(base, **rep)
    alpha, dist = V.verify_distributions(
        *(jnp.asarray(base[k]) for k in ("target_logits", "draft_tokens", "draft_probs")),
        jnp.asarray(base["lengths"]),
        base["params"],
        base["cfg"],
    )
    alpha, dist = np.asarray(alpha[0], np.float64), np.asarray(dist[0], np.float64)
    p_a = np.array([1 - alpha[0], alpha[0] * (1 - alpha[1]), alpha[0] * alpha[1]])
    law = (p_a[:, None] * dist).reshape(-1)
    counts = np.bincount(acc * 4 + nxt, minlength=12)
    keep = law > 0
    assert counts[~keep].sum() == 0
    assert stats.chisquare(counts[keep], n * law[keep] / law[keep].sum()).pvalue > 1e-3


def test_validation_errors():
    r = make_round(seed=10)
    with pytest.raises(ValueError, match="lengths must lie"):
        run(r, lengths=np.full(24, 4))
    with pytest.raises(ValueError, match="lengths must lie"):
        run(r, lengths=np.full(24, -1))
    bad = r["target_logits"].copy()
    bad[0, 0, 2] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        run(r, target_logits=bad)
    with pytest.raises(ValueError, match="draft_tokens must be"):
        run(r, draft_tokens=r["draft_tokens"][:, :1])
    with pytest.raises(ValueError, match="draft_probs must be"):
        run(r, draft_probs=r["draft_probs"][:, :, :4])
    with pytest.raises(ValueError, match="greedy=True"):
        run(r, rng=None)
    with pytest.raises(ValueError, match="silently"):
        run(r, cfg=GREEDY)  # temperature-1 rows must not be decoded greedily
    with pytest.raises(ValueError, match="top_k"):
        run(r, params=S.validate_sampling_params(1.0, top_k=2, batch_size=24))
    toks = r["draft_tokens"].copy()
    toks[0, 0] = 6
    with pytest.raises(ValueError, match="draft_tokens at admitted"):
        run(r, draft_tokens=toks, lengths=np.full(24, 3))


def test_no_retrace_across_rounds():
    r = make_round(seed=11, top_k=3)
    run(r)
    before = V._verify_jit._cache_size()
    r2 = make_round(seed=12, top_k=5, temperature=0.3)
    run(r2)
    assert V._verify_jit._cache_size() == before
