"""Drafters: anchor-bounded attention, training path == inference path, sequential heads,
Eagle3 TTT == inference, exact recorded draft distributions, overfitting a small batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

from dspark_jax.config import DrafterConfig
from dspark_jax.drafters import api
from dspark_jax.drafters.dspark import (
    extend_block_context,
    init_block_context,
    propose_block,
    teacher_forced,
)
from dspark_jax.drafters.eagle3 import (
    extend_eagle3_context,
    init_eagle3_context,
    propose_eagle3,
    ttt_hidden,
)
from dspark_jax.errors import ConfigError
from dspark_jax.models import layers
from dspark_jax.models import transformer as T
from dspark_jax.spec.sampling import SamplingConfig, SamplingParams
from dspark_jax.testing import drafter_batch, tiny_drafter_config, tiny_target_config
from dspark_jax.train.anchors import make_blocks
from dspark_jax.train.losses import loss_fn


@pytest.fixture(scope="module")
def target():
    cfg = tiny_target_config()
    return cfg, T.init_params(cfg, seed=0)


@pytest.fixture(scope="module")
def batch(target):
    return drafter_batch(*target, batch=2, length=24)


def _model(kind, target, **kw):
    cfg = tiny_drafter_config(kind, target=target[0], **kw)
    params = api.init_params(cfg, seed=3, target_params=target[1])
    return cfg, params, api.build(cfg, params)


def _positions(b, n):
    return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))


# ---------------------------------------------------------------------------------------------
# the one attention softmax (models.layers.joint_softmax): its custom VJP is the softmax's


def test_joint_softmax_gradient_is_the_softmax_gradient_of_the_concatenated_sets():
    """Two score sets merged by `joint_softmax` equal one softmax over their concatenation with
    masked entries at -inf, in value and in gradient (the custom VJP); a row with no visible
    entry gives zeros with a zero, finite gradient."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    s1, s2 = jax.random.normal(k1, (3, 5)), jax.random.normal(k2, (3, 4))
    m1 = jnp.array([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], bool)
    m2 = jnp.array([[1, 0, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]], bool)
    w = jax.random.normal(k3, (3, 9))  # a generic cotangent

    def ours(s1, s2):
        return jnp.concatenate(layers.joint_softmax([s1, s2], [m1, m2]), -1)

    def reference(s1, s2):
        s, m = jnp.concatenate([s1, s2], -1), jnp.concatenate([m1, m2], -1)
        return m * jax.nn.softmax(jnp.where(m, s, -1e30), axis=-1)

    np.testing.assert_allclose(ours(s1, s2), reference(s1, s2), rtol=1e-6, atol=1e-7)
    g = jax.grad(lambda a, b: (ours(a, b) * w).sum(), argnums=(0, 1))(s1, s2)
    g_ref = jax.grad(lambda a, b: (reference(a, b) * w).sum(), argnums=(0, 1))(s1, s2)
    for got, want in zip(g, g_ref):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(g[0][1]) == 0) and np.all(np.asarray(g[1][1]) == 0)
    assert np.any(np.abs(np.asarray(g[0][0])) > 1e-3)  # the test is not vacuous


@pytest.mark.parametrize("t", [2, 4, 12])  # t·r < d takes the few-query (keys-first) layout
def test_attend_equals_one_softmax_per_query_in_both_layouts(t):
    """`layers.attend` over a shared set [B, K, S, d] and a grouped set [B, U, K, S2, d] (GQA:
    4 query heads on 2 key heads) equals, per query, one softmax over the keys it may see."""
    b, n, nkv, d, s, s2, u = 2, 4, 2, 16, 7, 3, 2
    ks = jax.random.split(jax.random.key(1), 7)
    q = jax.random.normal(ks[0], (b, t, n, d))
    k, v = jax.random.normal(ks[1], (b, nkv, s, d)), jax.random.normal(ks[2], (b, nkv, s, d))
    kg, vg = (jax.random.normal(ks[3], (b, u, nkv, s2, d)),
              jax.random.normal(ks[4], (b, u, nkv, s2, d)))  # fmt: skip
    m = jax.random.bernoulli(ks[5], 0.6, (b, t, s)).at[:, :, 0].set(True)
    mg = jax.random.bernoulli(ks[6], 0.6, (b, u, t // u, s2))
    attend = jax.jit(layers.attend)  # one program, not op-by-op dispatch
    got = np.asarray(attend(q, [(k, v, m), (kg, vg, mg)])).reshape(b, t, n, d)
    shared_only = np.asarray(attend(q, [(k, v, m)])).reshape(b, t, n, d)
    q, k, v, kg, vg, m, mg = map(np.asarray, (q, k, v, kg, vg, m, mg))  # host loops below
    for bi in range(b):
        for i in range(t):
            for h in range(n):
                kv, g = h // (n // nkv), i // (t // u)
                keys = np.concatenate([k[bi, kv], kg[bi, g, kv]])
                vals = np.concatenate([v[bi, kv], vg[bi, g, kv]])
                vis = np.concatenate([m[bi, i], mg[bi, g, i % (t // u)]])
                sc = np.where(vis, keys @ np.asarray(q[bi, i, h]) / np.sqrt(d), -np.inf)
                p = np.exp(sc - sc.max())
                np.testing.assert_allclose(got[bi, i, h], p @ vals / p.sum(), atol=2e-5)
                sc = sc[:s]
                p = np.exp(sc - sc.max())
                np.testing.assert_allclose(
                    shared_only[bi, i, h], p @ v[bi, kv] / p.sum(), atol=2e-5
                )


# ---------------------------------------------------------------------------------------------
# anchor-bounded attention (docs/METHOD.md §2.5): exact zeros in the gradient


def test_block_gradients_are_anchor_bounded(target, batch):
    cfg, params, model = _model("dspark", target, markov_head_type="rnn")
    feats = batch["target_features"][:1]
    ids = batch["input_ids"][:1]
    seq = ids.shape[1]
    anchors = jnp.array([[3, 9, 9, 17, 0]], jnp.int32)  # two blocks share an anchor
    keep = jnp.array([[True, True, True, True, False]])  # the last one is a dummy block
    blk = make_blocks(ids, batch["loss_mask"][:1], anchors, keep, cfg.block_size, 255)
    x0 = jnp.take(params.frozen["embed_tokens"][...], blk.block_ids, axis=0)

    def block_out(f, x, sel_n):
        kv = model.context_kv(f, _positions(1, seq))
        z = model.blocks_from_embeddings(kv, blk.anchors, blk.keep, x, blk.positions)
        out = teacher_forced(model, z, blk.prev_ids)
        w = jax.random.normal(jax.random.key(7), out.logits.shape[2:])
        per_block = (out.logits[0] * w).sum((1, 2)) + out.conf_logits[0].sum(-1)  # [N]
        return (per_block * sel_n).sum()

    n = anchors.shape[1]
    # one gradient per block j (vmapped over the one-hot selector of block j)
    g_f, g_x = jax.jit(jax.vmap(jax.grad(block_out, argnums=(0, 1)), in_axes=(None, None, 0)))(
        feats, x0, jnp.eye(n)
    )
    g_f, g_x = np.asarray(g_f), np.asarray(g_x)
    for j in range(n):
        a = int(anchors[0, j])
        assert np.all(g_f[j, 0, a:] == 0.0), f"block {j} sees context >= its anchor"
        others = [i for i in range(n) if i != j]
        assert np.all(g_x[j, 0, others] == 0.0), f"block {j} sees another block"
        if keep[0, j]:
            assert np.abs(g_f[j, 0, :a]).sum(-1).min() > 0, "block j sees every earlier position"
            assert np.abs(g_x[j, 0, j]).sum() > 0
        else:
            assert np.all(g_f[j] == 0.0) and np.all(np.isfinite(g_x[j]))


def test_loss_is_nan_safe_with_dummy_blocks_and_unsupervised_rows(target, batch):
    cfg, params, _ = _model("dspark", target, num_layers=1)
    lm = jnp.zeros_like(batch["loss_mask"]).at[0, 10:13].set(1.0)  # 2 candidates < 8 anchors
    lm0 = jnp.zeros_like(lm)  # nothing supervised anywhere
    both = jax.tree.map(
        lambda *x: jnp.stack(x), dict(batch, loss_mask=lm), dict(batch, loss_mask=lm0)
    )
    f = jax.vmap(
        jax.value_and_grad(loss_fn, argnums=1, has_aux=True), in_axes=(None, None, None, 0, None)
    )
    (loss, m), g = jax.jit(f, static_argnums=0)(
        cfg, params.trainable, params.frozen, both, jax.random.key(0)
    )
    assert np.isfinite(float(loss[0])) and float(m["n_blocks"][0]) == 2
    assert all(bool(jnp.isfinite(x[0]).all()) for x in jax.tree.leaves(g))
    assert float(loss[1]) == 0.0 and float(m["n_blocks"][1]) == 0
    assert all(bool((x[1] == 0).all()) for x in jax.tree.leaves(g))


# ---------------------------------------------------------------------------------------------
# training path == inference path


@pytest.mark.parametrize(
    "kind,kw",
    [
        ("dspark", dict(markov_head_type="vanilla")),
        ("dspark", dict(markov_head_type="gated", confidence_with_markov=False)),
        ("dspark", dict(markov_head_type="rnn")),
        ("dflash", {}),
    ],
)
def test_inference_matches_training(target, batch, kind, kw):
    cfg, params, _ = _model(kind, target, **kw)
    g = cfg.block_size
    anchors = jnp.array([[6, 13]], jnp.int32)
    first = (4, 9)  # the inference context arrives in two pieces: first[r], then the rest

    @jax.jit
    def run(params, feats, ids, lm):
        model = api.build(cfg, params)
        seq = ids.shape[1]
        blk = make_blocks(ids, lm, anchors, jnp.ones((1, 2), bool), g, cfg.mask_token_id)
        kv = model.context_kv(feats, _positions(1, seq))
        z = model.blocks(kv, blk.anchors, blk.keep, blk.block_ids, blk.positions)
        train = teacher_forced(model, z, blk.prev_ids)
        # inference: row r proposes from anchor anchors[r] under teacher-forced drafts
        feats2 = jnp.concatenate([feats, feats])
        ctx = extend_block_context(model, init_block_context(cfg, 2, 32), feats2, jnp.array(first))
        rest = jnp.stack([jnp.roll(feats[0], -n, axis=0) for n in first])
        ctx = extend_block_context(model, ctx, rest, anchors[0] - jnp.array(first))
        forced = jnp.stack([ids[0, a + 1 : a + 1 + g] for a in (6, 13)])
        prop = propose_block(
            model, ctx, ids[0, anchors[0]], jax.random.key(0), jnp.array([0, 1]), forced_BxG=forced
        )
        return jax.nn.softmax(train.logits[0], -1), train.conf_logits, prop, ctx.lengths

    p_train, conf_train, prop, lengths = run(
        params, batch["target_features"][:1], batch["input_ids"][:1], batch["loss_mask"][:1]
    )
    assert list(lengths) == [6, 13]
    np.testing.assert_allclose(prop.probs, p_train, atol=2e-6)
    if cfg.confidence_head:
        np.testing.assert_allclose(prop.conf_logits, conf_train[0], atol=2e-5)
    else:
        assert prop.conf_logits is None and conf_train is None


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_markov_heads_parallel_equals_sequential(target, head):
    cfg, params, _ = _model("dspark", target, markov_head_type=head)
    b, n, g, h = 2, 3, cfg.block_size, cfg.hidden_size
    z = jax.random.normal(jax.random.key(1), (b, n, g, h))
    prev = jax.random.randint(jax.random.key(2), (b, n, g), 0, cfg.vocab_size)

    @jax.jit
    def run(params, z, prev):
        mh = api.build(cfg, params).markov_head
        bias, e = mh.teacher_forced(prev, z)
        state, seq = mh.init_state((b, n), z.dtype), []
        for k in range(g):
            state, bk, ek = mh.step(state, prev[..., k], z[..., k, :])
            seq.append((bk, ek))
        return bias, e, seq, mh.teacher_forced(prev, z + 1.0)[0]

    bias, e, seq, bias_z2 = run(params, z, prev)
    assert bias.shape == (b, n, g, cfg.vocab_size) and bias.dtype == jnp.float32
    assert e.shape == (b, n, g, cfg.markov_rank)
    for k, (bk, ek) in enumerate(seq):
        np.testing.assert_allclose(bias[..., k, :], bk, atol=1e-6)
        np.testing.assert_allclose(e[..., k, :], ek)
    # the bias depends on z exactly when the head reads it
    assert np.allclose(bias_z2, bias) == (head == "vanilla")


def test_eagle3_ttt_matches_inference(target, batch):
    cfg, params, _ = _model("eagle3", target)
    g = cfg.block_size
    ts = [5, 12]  # the anchor x_{t+1} follows the last committed feature t

    @jax.jit
    def run(params, feats, ids):
        model = api.build(cfg, params)
        seq = ids.shape[1]
        steps = ttt_hidden(model, feats, ids, jnp.array([seq]))  # [γ, 1, L, H]
        p_ttt = jax.nn.softmax(model.logits(steps[:, 0]), -1)  # [γ, L, V]
        feats2 = jnp.concatenate([feats, feats])
        nxt = jnp.concatenate([ids[:, 1:], ids[:, :1]], axis=1)
        nxt2 = jnp.concatenate([nxt, nxt])
        lens = jnp.array([t + 1 for t in ts])
        ctx = extend_eagle3_context(model, init_eagle3_context(cfg, 2, 32), feats2, nxt2, lens)
        forced = jnp.stack([ids[0, t + 2 : t + 2 + g] for t in ts])
        prop = propose_eagle3(model, ctx, jax.random.key(0), jnp.array([0, 1]), forced_BxG=forced)
        # extending in two calls gives the same context as one
        half = extend_eagle3_context(
            model, init_eagle3_context(cfg, 2, 32), feats2, nxt2, jnp.array([3, 3])
        )
        rest_f, rest_n = jnp.roll(feats2, -3, axis=1), jnp.roll(nxt2, -3, axis=1)
        two = extend_eagle3_context(model, half, rest_f, rest_n, lens - 3)
        return p_ttt, prop, ctx, two

    p_ttt, prop, ctx, two = run(params, batch["target_features"][:1], batch["input_ids"][:1])
    for r, t in enumerate(ts):
        np.testing.assert_allclose(prop.probs[r], p_ttt[:, t], atol=2e-6)
    np.testing.assert_allclose(two.g, ctx.g, atol=1e-5)
    np.testing.assert_allclose(two.k, ctx.k, atol=1e-5)
    np.testing.assert_array_equal(two.lengths, ctx.lengths)


# ---------------------------------------------------------------------------------------------
# propose(): the recorded distribution is the one each token was drawn from


def test_dspark_propose_records_exact_distribution(target, batch):
    cfg, params, model = _model("dspark", target, markov_head_type="rnn", num_layers=1)
    rows = 3000
    feats = jnp.broadcast_to(
        batch["target_features"][:1], (rows, *batch["target_features"].shape[1:])
    )
    ctx = api.prefill_context(
        cfg, params, feats, feats[..., 0].astype(jnp.int32), jnp.full((rows,), 10), 16
    )
    anchor = jnp.full((rows,), batch["input_ids"][0, 10])
    sp = SamplingParams(
        temperature=jnp.full((rows,), 0.05),
        top_k=jnp.full((rows,), 5, jnp.int32),
        top_p=jnp.ones((rows,)),
        min_p=jnp.zeros((rows,)),
    )
    scfg = SamplingConfig(top_k=True)
    seeds = jnp.arange(rows) % (rows // 2)  # row i and row i + rows/2 are the same request
    prop = api.propose_jit(cfg, params, ctx, anchor, jax.random.key(3), seeds, sp, scfg)
    toks, probs = np.asarray(prop.tokens), np.asarray(prop.probs)
    # every drawn token has positive recorded probability; top-k keeps at most 5 per slot
    assert np.all(np.take_along_axis(probs, toks[..., None], -1) > 0)
    assert np.all((probs > 0).sum(-1) <= 5)
    # recomputing under the drawn tokens reproduces the recorded distributions exactly
    again = propose_block(
        model, ctx, anchor, jax.random.key(9), jnp.arange(rows), sp, scfg, forced_BxG=prop.tokens
    )
    np.testing.assert_allclose(again.probs, probs, atol=1e-6)
    np.testing.assert_allclose(again.conf_logits, prop.conf_logits, atol=1e-6)
    # slot 0 (same prefix in every row) and slot 1 given the most common slot-0 token
    for slot, sel in (
        (0, np.ones(rows, bool)),
        (1, toks[:, 0] == np.bincount(toks[:, 0]).argmax()),
    ):
        p = probs[sel, slot][0]
        assert np.allclose(probs[sel, slot], p, atol=1e-6)
        support = np.flatnonzero(p > 0)
        counts = np.array([(toks[sel, slot] == v).sum() for v in support])
        assert counts.sum() == sel.sum()
        p64 = p[support].astype(np.float64)
        expected = p64 / p64.sum() * sel.sum()
        assert stats.chisquare(counts, expected).pvalue > 1e-3
    # a request's draft depends on its seed and position, not on its row in the batch
    np.testing.assert_array_equal(toks[: rows // 2], toks[rows // 2 :])


# ---------------------------------------------------------------------------------------------
# a drafter can learn: overfit one sequence to near-zero TV


def test_dspark_overfits_a_small_batch():
    tcfg = tiny_target_config(tie_word_embeddings=False)
    tparams = T.init_params(tcfg, seed=0)
    # a sharper-than-random target (scaled head) makes TV a demanding metric
    head = tparams["lm_head"]["kernel"]
    tparams["lm_head"]["kernel"] = head.replace(head[...] * 8.0)
    b = drafter_batch(tcfg, tparams, batch=1, length=20, prompt=2)
    # pure distillation (L1 + confidence BCE): CE would pull p_d towards the sampled tokens of
    # this random sequence instead of towards p_t, leaving a TV floor
    cfg = tiny_drafter_config("dspark", target=tcfg, num_layers=1, num_anchors=16, ce_alpha=0.0)
    params = api.init_params(cfg, seed=0, target_params=tparams)
    opt = optax.adam(1e-2)
    state = opt.init(params.trainable)

    @jax.jit
    def step(tr, st, key):
        (_, m), grads = jax.value_and_grad(loss_fn, argnums=1, has_aux=True)(
            cfg, tr, params.frozen, b, key
        )
        upd, st = opt.update(grads, st, tr)
        return optax.apply_updates(tr, upd), st, m

    tr = params.trainable
    _, _, m0 = step(tr, state, jax.random.key(0))
    for i in range(300):
        tr, state, m = step(tr, state, jax.random.key(i))
    first, last = np.asarray(m0["accept_rate"]), np.asarray(m["accept_rate"])
    assert first.max() < 0.6, first
    assert last.min() > 0.97, last  # 1 − TV at every position
    assert float(m["tau"]) > 0.97 * (1 + cfg.block_size) - 0.5
    assert float(m["conf_abs_error"]) < 0.02  # the confidence head learns c* = 1 − TV


# ---------------------------------------------------------------------------------------------
# configs


def test_drafter_config_errors():
    t = tiny_target_config()
    with pytest.raises(ConfigError, match="mask_token_id"):
        DrafterConfig.dspark(t)  # no mask token
    with pytest.raises(ConfigError, match="mask_token_id=999"):
        DrafterConfig.dspark(t, mask_token_id=999)
    with pytest.raises(ConfigError, match="exactly one decoder layer"):
        DrafterConfig.eagle3(t, num_layers=2)
    with pytest.raises(ConfigError, match="confidence_with_markov"):
        DrafterConfig.dspark(t, mask_token_id=1, markov_rank=0)
    with pytest.raises(ConfigError, match="anchor_chunk"):
        DrafterConfig.dspark(t, mask_token_id=1, num_anchors=8, anchor_chunk=3)
    with pytest.raises(ConfigError, match="markov_head_type"):
        DrafterConfig.dspark(t, mask_token_id=1, markov_head_type="lstm")
    with pytest.raises(ConfigError, match="has no field"):
        tiny_drafter_config().replace(gamma=3)
    c = tiny_drafter_config("dspark", loss_decay_gamma=None)
    assert c.decay_g == c.block_size and hash(c) == hash(
        tiny_drafter_config("dspark", loss_decay_gamma=None)
    )
