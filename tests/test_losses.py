"""Losses and anchors: position weights, anchor sampling, labels / eval mask, the DSpark terms
against a numpy reference, the detached confidence label, chunking, Eagle3 TTT normalization."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dspark_jax.drafters import api
from dspark_jax.drafters.eagle3 import ttt_hidden
from dspark_jax.models import transformer as T
from dspark_jax.testing import (
    CompileCounter,
    drafter_batch,
    tiny_drafter_config,
    tiny_target_config,
)
from dspark_jax.train.anchors import AnchorBlocks, anchor_candidates, make_blocks, sample_anchors
from dspark_jax.train.losses import (
    block_terms,
    ce_and_l1,
    combine_terms,
    loss_fn,
    position_weights,
    simulated_tau,
)


@pytest.fixture(scope="module")
def target():
    cfg = tiny_target_config()
    return cfg, T.init_params(cfg, seed=0)


def test_position_weights_code_and_paper_variants():
    c = tiny_drafter_config(block_size=7)
    want = [1, 0.7788, 0.6065, 0.4724, 0.3679, 0.2865, 0.2231]  # docs/METHOD.md §4.1
    np.testing.assert_allclose(position_weights(c), want, atol=1e-4)
    paper = c.replace(loss_decay_gamma=None)  # exp(-(k-1)/γ), 1-indexed
    np.testing.assert_allclose(position_weights(paper), np.exp(-np.arange(7) / 7), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# anchors (docs/METHOD.md §2.7–2.8)


def test_anchor_sampling_is_uniform_sorted_without_replacement():
    mask = jnp.array([[0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0, 1]], jnp.float32)
    cands = [2, 3, 6, 7, 8]  # mask[i] and mask[i+1]; the last position never
    assert list(np.flatnonzero(anchor_candidates(mask)[0])) == cands
    draw = jax.jit(jax.vmap(lambda k: sample_anchors(k, mask, 3)))
    anchors, keep = draw(jax.random.split(jax.random.key(0), 5000))
    anchors, keep = np.asarray(anchors[:, 0]), np.asarray(keep[:, 0])
    assert keep.all()
    assert np.all(np.diff(anchors, axis=1) > 0)  # sorted, distinct
    assert np.isin(anchors, cands).all()
    subsets = {s: i for i, s in enumerate(itertools.combinations(cands, 3))}
    counts = np.bincount([subsets[tuple(a)] for a in anchors], minlength=len(subsets))
    assert stats.chisquare(counts).pvalue > 1e-3  # every 3-subset equally likely
    # fewer candidates than anchors: all of them, then dummy blocks (anchor 0, keep False)
    a, k = sample_anchors(jax.random.key(1), jnp.concatenate([mask, 0 * mask]), 8)
    assert list(a[0]) == cands + [0, 0, 0] and list(k[0]) == [True] * 5 + [False] * 3
    assert not np.asarray(k[1]).any() and not np.asarray(a[1]).any()


def _reference_blocks(ids, mask, anchors, keep, g, mask_id):
    """§2.8 written as loops."""
    seq = len(ids)
    out = {k: [] for k in ("block_ids", "positions", "target_ids", "prev_ids", "eval_mask")}
    for a, kp in zip(anchors, keep):
        row = {k: [] for k in out}
        ok = True
        for k in range(g):
            lab = a + k + 1
            safe = min(lab, seq - 1) if kp else 0
            row["block_ids"].append((ids[a] if kp else mask_id) if k == 0 else mask_id)
            row["positions"].append(a + k)
            row["target_ids"].append(ids[safe])
            row["prev_ids"].append(ids[a] if k == 0 else row["target_ids"][k - 1])
            ok = ok and kp and lab < seq and mask[safe] > 0.5
            row["eval_mask"].append(ok)
        for k in out:
            out[k].append(row[k])
    return {k: np.array(v) for k, v in out.items()}


def test_make_blocks_matches_reference():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, 16)
    mask = (rng.random(16) > 0.3).astype(np.float32)
    anchors = np.array([1, 4, 9, 13, 14, 0])
    keep = np.array([True, True, True, True, True, False])
    got = make_blocks(ids[None], mask[None], anchors[None], keep[None], 4, 99)
    want = _reference_blocks(ids, mask, anchors, keep, 4, 99)
    for k, v in want.items():
        np.testing.assert_array_equal(getattr(got, k)[0], v, err_msg=k)
    np.testing.assert_array_equal(
        got.target_pos[0][keep], (anchors[:, None] + np.arange(4))[keep].clip(max=14)
    )


# ---------------------------------------------------------------------------------------------
# the DSpark loss terms (docs/METHOD.md §4)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _random_blocks(seed, n=3, g=4, v=11):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(1, n, g, v)).astype(np.float32) * 2
    t_logits = rng.normal(size=(1, n, g, v)).astype(np.float32) * 2
    conf = rng.normal(size=(1, n, g)).astype(np.float32)
    eval_mask = np.array([[[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]]], bool)
    keep = np.array([[True, True, False]])
    tgt = rng.integers(0, v, (1, n, g))
    z = np.zeros((1, n, g), np.int32)
    blocks = AnchorBlocks(z[..., 0], keep, z, z, tgt, z, eval_mask, z)
    return logits, t_logits, conf, blocks


def test_block_terms_match_numpy_reference():
    cfg = tiny_drafter_config("dspark", block_size=4)
    logits, t_logits, conf, blocks = _random_blocks(0)
    loss, m = combine_terms(cfg, block_terms(cfg, logits, conf, t_logits, blocks))
    w = np.exp(-np.arange(4) / 4.0) * blocks.eval_mask
    pd, pt = _softmax(logits.astype(np.float64)), _softmax(t_logits.astype(np.float64))
    ce = -np.log(np.take_along_axis(pd, blocks.target_ids[..., None], -1)[..., 0])
    l1 = np.abs(pd - pt).sum(-1)
    c = np.clip(1 - l1 / 2, 0, 1)
    s = 1 / (1 + np.exp(-conf))
    bce = -(c * np.log(s) + (1 - c) * np.log(1 - s))
    mean = lambda x: (w * x).sum() / (w.sum() + 1e-6)
    want = 0.1 * mean(ce) + 0.9 * mean(l1) + 1.0 * mean(bce)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(m["ce"]), mean(ce), rtol=1e-5)
    np.testing.assert_allclose(float(m["l1"]), mean(l1), rtol=1e-5)
    mask = blocks.eval_mask
    np.testing.assert_allclose(
        m["accept_rate"], (c * mask).sum((0, 1)) / np.maximum(mask.sum((0, 1)), 1), rtol=1e-5
    )
    tau_rows = 1 + np.cumprod(c * mask, -1).sum(-1)  # valid blocks: keep and any supervision
    np.testing.assert_allclose(float(m["tau"]), tau_rows[0, :2].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["conf_abs_error"]), mean(np.abs(s - c)), rtol=1e-4)
    assert float(m["n_blocks"]) == 2 and float(m["n_supervised"]) == 7
    # DFlash: CE only
    dfl = tiny_drafter_config("dflash", block_size=4)
    loss_d, m_d = combine_terms(dfl, block_terms(dfl, logits, None, t_logits, blocks))
    np.testing.assert_allclose(float(loss_d), mean(ce), rtol=1e-5)
    assert float(m_d["bce"]) == 0.0 and "conf_abs_error" not in m_d


@pytest.mark.parametrize("soft", [False, True])
def test_ce_and_l1_values_and_gradient_equal_autodiff_of_the_plain_form(soft):
    """The fused CE + L1 (own VJP) against log_softmax / exp / abs differentiated by autodiff,
    hard labels (DSpark / DFlash) and soft ones (Eagle3), with a row where p_d = p_t exactly
    (sign 0), weights that differ per row, and each output alone carrying the gradient."""
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(0, 2, (3, 5, 37)), jnp.float32)
    t_logits = jnp.asarray(rng.normal(0, 2, (3, 5, 37)), jnp.float32).at[1, 2].set(logits[1, 2])
    p_t = jax.nn.softmax(t_logits, -1)
    ids = None if soft else jnp.asarray(rng.integers(0, 37, (3, 5)), jnp.int32)
    a, b = (jnp.asarray(rng.uniform(0.1, 1, (3, 5)), jnp.float32) for _ in range(2))

    def plain(lg, pt):
        logp = jax.nn.log_softmax(lg, -1)
        pt = jax.lax.stop_gradient(pt)
        if soft:
            ce = -(pt * logp).sum(-1)
        else:
            ce = -jnp.take_along_axis(logp, ids[..., None], -1)[..., 0]
        return ce, jnp.abs(jnp.exp(logp) - pt).sum(-1)

    def fused(lg, pt):
        return ce_and_l1(lg, pt, ids)

    for want, got in zip(plain(logits, p_t), fused(logits, p_t)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert float(fused(logits, p_t)[1][1, 2]) < 1e-6

    other = np.ones((3, 5), bool)
    other[1, 2] = False  # |p_d − p_t| at 0: a subgradient, which rounding picks in the plain form
    y = p_t[1, 2] if soft else (jnp.arange(37) == ids[1, 2])
    ce_grad_12 = a[1, 2] * (jax.nn.softmax(logits[1, 2]) - y)
    for wa, wb in [(a, b), (a, None), (None, b)]:  # None: that output is detached

        def weighted(f, wa=wa, wb=wb):
            def loss(lg, pt):
                ce, l1 = f(lg, pt)
                ce = ce if wa is not None else jax.lax.stop_gradient(ce)
                l1 = l1 if wb is not None else jax.lax.stop_gradient(l1)
                return (ce * (1 if wa is None else wa)).sum() + (
                    l1 * (1 if wb is None else wb)
                ).sum()

            return loss

        g_plain = jax.grad(weighted(plain), argnums=(0, 1))(logits, p_t)
        g_fused = jax.grad(weighted(fused), argnums=(0, 1))(logits, p_t)
        np.testing.assert_allclose(g_fused[0][other], g_plain[0][other], rtol=1e-5, atol=1e-7)
        assert np.all(np.asarray(g_fused[1]) == 0)
        g_jit = jax.jit(jax.grad(weighted(fused)))(logits, p_t)
        np.testing.assert_allclose(g_jit[other], g_plain[0][other], rtol=1e-5, atol=1e-7)
        if wb is None:  # sign 0 row: with only CE carrying gradient it is exactly CE's
            np.testing.assert_allclose(g_fused[0][1, 2], ce_grad_12, rtol=1e-5, atol=1e-7)


def test_confidence_label_is_detached_and_target_gets_no_gradient():
    cfg = tiny_drafter_config("dspark", block_size=4, ce_alpha=0.0, l1_alpha=0.0)
    logits, t_logits, conf, blocks = _random_blocks(1)

    def f(lg, cf, tl):
        return combine_terms(cfg, block_terms(cfg, lg, cf, tl, blocks))[0]

    g_logits, g_conf, g_target = jax.grad(f, argnums=(0, 1, 2))(logits, conf, t_logits)
    assert np.all(np.asarray(g_logits) == 0) and np.all(np.asarray(g_target) == 0)
    assert np.abs(np.asarray(g_conf)).sum() > 0
    full = tiny_drafter_config("dspark", block_size=4)
    g = jax.grad(lambda tl: combine_terms(full, block_terms(full, logits, conf, tl, blocks))[0])
    assert np.all(np.asarray(g(t_logits)) == 0)


def test_simulated_tau_is_mask_aware():
    acc = jnp.array([[0.9, 0.5, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    mask = jnp.array([[1, 1, 0, 0], [1, 1, 1, 1]], jnp.float32)
    np.testing.assert_allclose(simulated_tau(acc, mask), [1 + 0.9 + 0.45, 5.0], rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# loss_fn end to end


def test_chunked_anchors_equal_unchunked_and_no_retrace(target):
    batch = drafter_batch(*target, batch=2, length=20)
    cfg = tiny_drafter_config("dspark", target=target[0], num_layers=1, markov_head_type="rnn")
    params = api.init_params(cfg, seed=1, target_params=target[1])
    f = jax.jit(jax.value_and_grad(loss_fn, argnums=1, has_aux=True), static_argnums=0)
    l0, m0 = jax.jit(loss_fn, static_argnums=0)(
        cfg, params.trainable, params.frozen, batch, jax.random.key(0)
    )
    chunked = cfg.replace(anchor_chunk=2)
    (l1, m1), g1 = f(chunked, params.trainable, params.frozen, batch, jax.random.key(0))
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    np.testing.assert_allclose(m1["accept_rate"], m0["accept_rate"], rtol=1e-5)
    assert all(bool(jnp.isfinite(x).all()) and bool((x != 0).any()) for x in jax.tree.leaves(g1))
    with CompileCounter() as cc:  # a new step (new anchors) must not recompile
        (l2, _), _ = f(chunked, params.trainable, params.frozen, batch, jax.random.key(5))
        jax.block_until_ready(l2)
    assert cc.count == 0
    assert float(l2) != float(l1)  # fresh anchors


def test_loss_fn_rejects_bad_batches(target):
    cfg = tiny_drafter_config("dflash", target=target[0])
    params = api.init_params(cfg)
    b = drafter_batch(*target, batch=1, length=8)
    with pytest.raises(KeyError, match="target_hidden"):
        loss_fn(
            cfg, *params, {k: v for k, v in b.items() if k != "target_hidden"}, jax.random.key(0)
        )
    bad = dict(b, target_features=b["target_features"][..., :64])
    with pytest.raises(ValueError, match="target_features.*m=3 feature layers"):
        loss_fn(cfg, *params, bad, jax.random.key(0))


def test_eagle3_loss_weights_shift_and_normalization(target):
    cfg = tiny_drafter_config("eagle3", target=target[0])
    params = api.init_params(cfg, seed=2, target_params=target[1])
    b = drafter_batch(*target, batch=1, length=16)
    seq, t0, pad = 16, 9, 3
    b["loss_mask"] = jnp.zeros((1, seq)).at[0, t0].set(1.0).at[0, seq - pad - 1].set(1.0)
    b["attention_mask"] = jnp.ones((1, seq)).at[0, seq - pad :].set(0.0)  # 3 padding tokens

    @jax.jit
    def run(params, b):
        loss, m = loss_fn(cfg, params.trainable, params.frozen, b, jax.random.key(0))
        model = api.build(cfg, params)
        steps = ttt_hidden(model, b["target_features"], b["input_ids"], jnp.array([seq - pad]))
        return loss, m, jax.nn.log_softmax(model.logits(steps[:, 0]), -1)

    loss, m, logq = run(params, b)  # logq [γ, L, V]
    t_logits = b["target_hidden"][0] @ params.frozen["lm_head"][...]
    p_t = jax.nn.softmax(t_logits, -1)
    # only loss_mask[t0] counts (the last real token's entry is cleared); at step k it
    # supervises position t0 − k, whose target is the target's prediction at t0 + 1
    want = sum(0.8**k * -(p_t[t0 + 1] * logq[k, t0 - k]).sum() for k in range(cfg.block_size)) / (
        seq - pad
    )
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    assert float(m["n_supervised"]) == 1 and float(m["n_tokens"]) == seq - pad
    assert np.all(np.asarray(m["accept_den"]) == 1)


def test_eagle3_loss_is_a_mean_over_sequences_of_per_sequence_losses(target):
    """docs/METHOD.md §5.2: each sequence's loss is normalised by its own length, then sequences are
    averaged with equal weight (a short sequence weighs as much as a long one)."""
    cfg = tiny_drafter_config("eagle3", target=target[0])
    params = api.init_params(cfg, seed=3, target_params=target[1])
    b = drafter_batch(*target, batch=2, length=16, prompt=3)
    b["attention_mask"] = jnp.ones((2, 16)).at[1, 7:].set(0.0)  # row 1: 7 real tokens
    b["loss_mask"] = b["loss_mask"] * b["attention_mask"]
    f = jax.jit(lambda p, x: loss_fn(cfg, p.trainable, p.frozen, x, jax.random.key(0))[0])
    both = float(f(params, b))
    rows = [float(f(params, {k: v[i : i + 1] for k, v in b.items()})) for i in range(2)]
    np.testing.assert_allclose(both, np.mean(rows), rtol=1e-5)
    assert abs(rows[0] - rows[1]) > 1e-3  # the test distinguishes this from token weighting


def test_training_tau_is_the_mean_of_per_block_survival_products(target):
    """The best-checkpoint metric `tau` (docs/METHOD.md §4.5 tau_probabilistic) averages per-block
    survival products; the product of per-position means (`sim_tau`) differs from it."""
    from dspark_jax.config.pipeline import DrafterStage
    from dspark_jax.spec.metrics import simulated_tau as product_of_means

    assert DrafterStage().train_config(seed=0).best_metric == "tau"
    rng = np.random.default_rng(0)
    # per-block, per-position 1 - TV; easy and hard blocks (acceptance correlated along a block,
    # as in real text), where the two criteria part most
    acc = np.repeat(rng.uniform(0, 1, (50, 1)), 4, axis=1)
    per_block = np.mean(1 + np.cumprod(acc, -1).sum(-1))
    got = simulated_tau(jnp.asarray(acc), jnp.ones((50, 4))).mean()
    np.testing.assert_allclose(float(got), per_block, rtol=1e-6)
    assert per_block - product_of_means(acc.mean(0)) > 0.2
