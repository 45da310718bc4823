"""A drafter's context window (`DrafterConfig.context_window`): a DSpark/DFlash block anchored at
position a sees only the context positions a - W .. a - 1 (Eagle3: position t sees t - W + 1 ..
t), in training and on both KV layouts of the engine; a window wider than every context changes
nothing; greedy speculative output still equals plain greedy decoding; the window survives save
/ load; serving may narrow it, never widen it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import drafters
from dspark_jax.compat import check_trained_window
from dspark_jax.config import DrafterConfig
from dspark_jax.drafters import paged_context
from dspark_jax.drafters.dspark import extend_block_context, init_block_context, single_block
from dspark_jax.drafters.eagle3 import (
    extend_eagle3_context,
    init_eagle3_context,
    propose_eagle3,
    ttt_hidden,
)
from dspark_jax.drafters.hf import load_hf_drafter, save_hf_drafter
from dspark_jax.engine import RequestParams, ServingEngine
from dspark_jax.errors import ConfigError
from dspark_jax.models.generate import generate
from dspark_jax.testing import drafter_batch
from dspark_jax.train.losses import loss_fn
from dspark_jax.train.trainer_setup import _drafter_json
from tests.engine_models import agreeing_pair

G = 4
CTX = 30  # committed context positions in the drafter-level tests
W = 5


@pytest.fixture(scope="module")
def pair():
    return agreeing_pair(vocab=64, gamma=G)


def _windowed(dcfg, w):
    return dcfg.replace(context_window=w)


def _context(dcfg, dp, n=CTX, rows=2, max_len=48):
    """A BlockContext of `n` committed positions per row (random features)."""
    feats = jax.random.normal(jax.random.key(7), (rows, n, dcfg.feature_size), jnp.float32)
    model = drafters.build(dcfg, dp)
    ctx = init_block_context(dcfg, rows, max_len)
    return extend_block_context(model, ctx, feats, jnp.full((rows,), n, jnp.int32))


def _reference_z(dcfg, dp, ctx, anchor, w):
    """The block run on only the last `w` context positions: the cache sliced to them (their
    K/V carry their absolute RoPE positions), the block at its absolute positions."""
    model = drafters.build(dcfg, dp)  # no window
    a = int(ctx.lengths[0])
    kv = [(k[:, :, a - w : a], v[:, :, a - w : a]) for k, v in zip(ctx.k, ctx.v)]
    b = anchor.shape[0]
    ids = jnp.full((b, 1, G), dcfg.mask_token_id, jnp.int32).at[:, 0, 0].set(anchor)
    pos = ctx.lengths[:, None, None] + jnp.arange(G, dtype=jnp.int32)[None, None, :]
    z = model.blocks(kv, jnp.full((b, 1), w, jnp.int32), jnp.ones((b, 1), bool), ids, pos)
    return z[:, 0]


def test_a_window_wider_than_every_context_is_bit_identical(pair):
    _, _, dcfg, dp = pair
    ctx = _context(dcfg, dp)
    anchor = jnp.array([3, 11], jnp.int32)
    key, seeds = jax.random.key(0), jnp.array([1, 2], jnp.uint32)
    base = drafters.propose(dcfg, dp, ctx, anchor, key, seeds)
    wide = drafters.propose(_windowed(dcfg, CTX), dp, ctx, anchor, key, seeds)
    for x, y in zip(base, wide):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # and the training loss (the same mask through `BlockDrafter.blocks`)
    tcfg = dcfg.target
    tp = pair[1]
    batch = drafter_batch(tcfg, tp, batch=2, length=24)
    loss = jax.jit(loss_fn, static_argnums=0)
    la, _ = loss(dcfg, dp.trainable, dp.frozen, batch, jax.random.key(1))
    lb, _ = loss(_windowed(dcfg, 24), dp.trainable, dp.frozen, batch, jax.random.key(1))
    lc, _ = loss(_windowed(dcfg, 2), dp.trainable, dp.frozen, batch, jax.random.key(1))
    assert float(la) == float(lb)
    assert float(la) != float(lc)  # a narrow window does reach the training loss


def test_a_small_window_sees_only_the_last_w_positions_on_both_layouts(pair):
    _, _, dcfg, dp = pair
    wcfg = _windowed(dcfg, W)
    ctx = _context(dcfg, dp)
    anchor = jnp.array([3, 11], jnp.int32)
    ref = _reference_z(dcfg, dp, ctx, anchor, W)
    dense = single_block(drafters.build(wcfg, dp), ctx, anchor)
    np.testing.assert_allclose(np.asarray(dense), np.asarray(ref), rtol=1e-5, atol=1e-5)
    full = single_block(drafters.build(dcfg, dp), ctx, anchor)
    assert not np.allclose(np.asarray(full), np.asarray(ref), atol=1e-3)  # the window matters

    # the paged layout: the same context written to pages in a shuffled order, the block
    # attending over them in place (`paged_attention` with the block's window)
    page, rows = 8, 2
    pc = paged_context.init_paged_context(dcfg, rows=rows, num_pages=12, page_size=page)
    tables = jnp.asarray(np.random.default_rng(0).permutation(12)[:8].reshape(rows, 4), jnp.int32)
    feats = jax.random.normal(jax.random.key(7), (rows, CTX, dcfg.feature_size), jnp.float32)
    pc = drafters.extend_context(dcfg, dp, paged_context.with_tables(pc, tables), feats,
                                 jnp.zeros((rows, CTX), jnp.int32), ctx.lengths)  # fmt: skip
    paged = paged_context.paged_block(drafters.build(wcfg, dp), pc, anchor)
    np.testing.assert_allclose(np.asarray(paged), np.asarray(ref), rtol=1e-5, atol=1e-5)
    prop_dense = drafters.propose(wcfg, dp, ctx, anchor, jax.random.key(0), jnp.array([1, 2]))
    prop_paged = drafters.propose(wcfg, dp, pc, anchor, jax.random.key(0), jnp.array([1, 2]))
    np.testing.assert_array_equal(np.asarray(prop_dense.tokens), np.asarray(prop_paged.tokens))


PROMPTS = [[3, 9, 1] * 9, [5, 6, 7, 8, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48] * 3]
MAX_NEW = [24, 20, 24]


@pytest.fixture(scope="module")
def refs(pair):
    tcfg, tp, _, _ = pair
    return [generate(tcfg, tp, [p], max_new_tokens=m)[0] for p, m in zip(PROMPTS, MAX_NEW)]


@pytest.mark.parametrize("layout", ["slots", "paged"])
@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_greedy_with_a_windowed_drafter_equals_plain_greedy(pair, refs, layout, kind):
    tcfg, tp, dcfg, dp = pair
    if kind == "eagle3":  # untrained: exactness holds whatever the drafter proposes
        dcfg = DrafterConfig.eagle3(tcfg, block_size=G)
        dp = drafters.init_params(dcfg, seed=1, target_params=tp)
    eng = ServingEngine(tcfg, dcfg, tp, dp, num_slots=2, max_len=80, prompt_buckets=(32,),
                        token_buckets=(2 * (G + 1),), modes=("greedy",), kv_layout=layout,
                        page_size=8, context_window=3)  # fmt: skip
    assert eng.dcfg.context_window == 3
    hs = [eng.submit(p, RequestParams(m, temperature=0.0)) for p, m in zip(PROMPTS, MAX_NEW)]
    while eng.has_work():
        eng.step()
    assert [h.result().tokens for h in hs] == refs


def test_the_window_survives_save_and_load(pair, tmp_path):
    _, _, dcfg, dp = pair
    wcfg = _windowed(dcfg, 64)
    # the trainer's checkpoint records the drafter config; loading checks the window against it
    assert _drafter_json(wcfg)["context_window"] == 64
    check_trained_window(64, 64)
    check_trained_window(0, None)  # a checkpoint written before the field: the whole context
    with pytest.raises(ConfigError, match="trained with context_window=64"):
        check_trained_window(0, 64)
    save_hf_drafter(wcfg, dp, tmp_path / "w")
    cfg2, _ = load_hf_drafter(tmp_path / "w", wcfg.target)
    assert cfg2.context_window == 64
    save_hf_drafter(dcfg, dp, tmp_path / "full")  # no window: the released layout, no new key
    cfg3, _ = load_hf_drafter(tmp_path / "full", dcfg.target)
    assert cfg3.context_window == 0
    assert "context_window" not in (tmp_path / "full" / "config.json").read_text()


def test_serving_narrows_the_window_and_refuses_to_widen_it(pair):
    tcfg, tp, dcfg, dp = pair
    wcfg = _windowed(dcfg, 8)
    assert drafters.narrow_context_window(wcfg, None) is wcfg
    assert drafters.narrow_context_window(wcfg, 4).context_window == 4
    assert drafters.narrow_context_window(dcfg, 100).context_window == 100  # trained on all
    with pytest.raises(ConfigError, match="wider than the 8 positions.*<= 8"):
        drafters.narrow_context_window(wcfg, 16)
    with pytest.raises(ConfigError, match="wider than the 8 positions"):
        ServingEngine(tcfg, wcfg, tp, dp, num_slots=1, max_len=64, context_window=9)
    with pytest.raises(ConfigError, match=">= 1"):
        drafters.narrow_context_window(wcfg, 0)
    with pytest.raises(ConfigError, match="context_window"):
        DrafterConfig.eagle3(tcfg, context_window=-1)


def test_eagle3_window_training_equals_inference_and_a_wide_window_changes_nothing(pair):
    tcfg, tp, _, _ = pair
    batch = drafter_batch(tcfg, tp, batch=1, length=24)
    feats, ids = batch["target_features"], batch["input_ids"]
    ts = [5, 12]  # the anchor x_{t+1} follows the last committed feature t

    def run(cfg, params):
        model = drafters.build(cfg, params)
        steps = ttt_hidden(model, feats, ids, jnp.array([ids.shape[1]]))  # [γ, 1, L, H]
        p_ttt = jax.nn.softmax(model.logits(steps[:, 0]), -1)  # [γ, L, V]
        nxt = jnp.concatenate([ids[:, 1:], ids[:, :1]], axis=1)
        f2, n2 = jnp.concatenate([feats, feats]), jnp.concatenate([nxt, nxt])
        ctx = init_eagle3_context(cfg, 2, 32)
        ctx = extend_eagle3_context(model, ctx, f2, n2, jnp.array([t + 1 for t in ts]))
        forced = jnp.stack([ids[0, t + 2 : t + 2 + G] for t in ts])
        prop = propose_eagle3(model, ctx, jax.random.key(0), jnp.array([0, 1]), forced_BxG=forced)
        return p_ttt, prop

    base = DrafterConfig.eagle3(tcfg, block_size=G)
    params = drafters.init_params(base, seed=3, target_params=tp)
    p0, prop0 = run(base, params)
    p_wide, prop_wide = run(_windowed(base, 24), params)
    np.testing.assert_array_equal(np.asarray(p0), np.asarray(p_wide))
    np.testing.assert_array_equal(np.asarray(prop0.probs), np.asarray(prop_wide.probs))
    p3, prop3 = run(_windowed(base, 3), params)
    for r, t in enumerate(ts):  # training (TTT) and inference agree under the window
        np.testing.assert_allclose(prop3.probs[r], p3[:, t], atol=2e-6)
    assert not np.allclose(np.asarray(prop3.probs[1]), np.asarray(prop0.probs[1]), atol=1e-4)
