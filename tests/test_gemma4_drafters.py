"""Drafters for Gemma 4 targets (issue 41 item 4, docs/METHOD.md §0, §2.10, §5.1).

On the tiny Gemma 4 target of `tests/test_gemma4_engine.py` (sliding and global layers, K = V,
KV-shared layers, per-layer inputs, experts, soft-capped logits): the three drafter kinds take
the Gemma layer in the global geometry (no experts, no per-layer inputs), train with the
project's loss, soft-cap their logits and the recomputed target logits, and serve: the engine's
greedy output equals plain greedy decoding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dspark_jax.config import DrafterConfig
from dspark_jax.drafters import api, common
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
from dspark_jax.engine import RequestParams, ServingEngine
from dspark_jax.models.generate import generate
from dspark_jax.testing import drafter_batch, random_params
from dspark_jax.train import losses
from dspark_jax.train.anchors import make_blocks
from dspark_jax.train.losses import loss_fn
from tests.test_gemma4_engine import V, gemma_config

TCFG = gemma_config(tie=False)
CAP = TCFG.gemma.final_logit_softcapping
KINDS = ("dspark", "dflash", "eagle3")


def drafter(kind: str, target=TCFG, **kw) -> DrafterConfig:
    if kind == "eagle3":
        return DrafterConfig.eagle3(target, block_size=3, **kw)
    base = dict(num_layers=2, block_size=3, mask_token_id=V - 1, num_anchors=6)
    if kind == "dspark":
        base.update(markov_rank=8)
    base.update(kw)
    return getattr(DrafterConfig, kind)(target, **base)


def uncapped(cfg: DrafterConfig) -> DrafterConfig:
    g = dataclasses.replace(cfg.target.gemma, final_logit_softcapping=None)
    return cfg.replace(target=cfg.target.replace(gemma=g))


@pytest.fixture(scope="module")
def target():
    tp = jax.tree.map(lambda x: x, random_params(TCFG, 0))
    head = tp["lm_head"]["kernel"]  # sharp: raw logits well past the cap
    tp["lm_head"]["kernel"] = head.replace(head[...] * 40.0)
    return tp, drafter_batch(TCFG, tp, batch=2, length=20, prompt=4)


@pytest.mark.parametrize("kind", KINDS)
def test_drafter_layers_take_the_gemma_geometry(kind):
    """Every draft layer is a Gemma layer in the global geometry (K = V: no v projection, the
    global K/V heads and head size), sandwich norms and layer scalar, no experts, no per-layer
    inputs; the context cache has that geometry too."""
    cfg = drafter(kind)
    g = TCFG.gemma
    tr = api.init_params(cfg, seed=0).trainable
    for layer in tr["layers"].values():
        attn = layer["self_attn"]
        assert "v_proj" not in attn and "v_norm" not in attn
        d_in = 2 * TCFG.hidden_size if kind == "eagle3" else TCFG.hidden_size
        assert attn["k_proj"]["kernel"].shape == (d_in, g.global_kv_heads * g.global_head_dim)
        assert attn["q_proj"]["kernel"].shape == (d_in, TCFG.num_heads * g.global_head_dim)
        assert {"post_feedforward_layernorm", "layer_scalar"} <= set(layer)
        assert not {"experts", "router", "per_layer_input_gate"} & set(layer)
    assert cfg.kv_geometry == (g.global_kv_heads, g.global_head_dim)
    assert api.init_context(cfg, 2, 16).k[0].shape[-3:] == (1, 16, 32)


@pytest.mark.parametrize("kind", KINDS)
def test_training_steps_compile_once_and_decrease_the_loss(kind, target):
    tp, batch = target
    cfg = drafter(kind)
    params = api.init_params(cfg, seed=1, target_params=tp)
    opt = optax.adam(3e-3)

    @jax.jit
    def step(tr, st):
        grad_fn = jax.value_and_grad(loss_fn, argnums=1, has_aux=True)
        (loss, _), grads = grad_fn(cfg, tr, params.frozen, batch, jax.random.key(0))
        upd, st = opt.update(grads, st, tr)
        return optax.apply_updates(tr, upd), st, loss, optax.global_norm(grads)

    tr, st = params.trainable, opt.init(params.trainable)
    losses = []
    for _ in range(8):
        tr, st, loss, gnorm = step(tr, st)
        assert np.isfinite(float(loss)) and np.isfinite(float(gnorm)) and float(gnorm) > 0
        losses.append(float(loss))
    assert step._cache_size() == 1
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("kind", KINDS)
def test_soft_capping_is_applied_to_draft_and_target_logits(kind, target, monkeypatch):
    """Draft logits lie within the cap (DSpark: the base logits, before the Markov bias) though
    the raw head products exceed it; the loss without the cap (the same parameters) differs, and
    so do the loss and L1 term (DFlash's CE reads hard labels only, Eagle3 logs no L1) when the
    recomputed target logits alone go uncapped (the target side)."""
    tp, batch = target
    cfg = drafter(kind)
    params = api.init_params(cfg, seed=1, target_params=tp)
    model = api.build(cfg, params)
    z = jax.random.normal(jax.random.key(2), (4, TCFG.hidden_size))
    if kind == "eagle3":
        capped, raw = model.logits(z), api.build(uncapped(cfg), params).logits(z)
    else:
        capped, raw = model.base_logits(z), api.build(uncapped(cfg), params).base_logits(z)
    assert float(jnp.abs(capped).max()) <= CAP and float(jnp.abs(raw).max()) > 2 * CAP
    np.testing.assert_allclose(capped, CAP * jnp.tanh(raw / CAP), rtol=1e-5, atol=1e-5)

    key = jax.random.key(0)
    loss = lambda c: float(loss_fn(c, params.trainable, params.frozen, batch, key)[0])
    with_cap, without = loss(cfg), loss(uncapped(cfg))
    assert np.isfinite(with_cap) and abs(with_cap - without) > 1e-3 * abs(with_cap)
    # the losses' own head product (the target logits) without its cap
    monkeypatch.setattr(losses, "lm_logits", lambda w, z, cap=None: common.lm_logits(w, z))

    def loss_l1():
        out, m = loss_fn(cfg, params.trainable, params.frozen, batch, key)
        return np.array([float(out), float(m["l1"])])

    target_uncapped = loss_l1()
    monkeypatch.undo()
    assert not np.allclose(loss_l1(), target_uncapped, rtol=1e-3, atol=0)


def test_dspark_inference_matches_training(target):
    """The Gemma block drafter's serving path (context cache, one block) records exactly the
    teacher-forced distributions of the training path (soft cap and Markov bias included)."""
    tp, batch = target
    cfg = drafter("dspark")
    params = api.init_params(cfg, seed=3, target_params=tp)
    model = api.build(cfg, params)
    ids, feats = batch["input_ids"][:1], batch["target_features"][:1]
    g, a = cfg.block_size, 9
    pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    blk = make_blocks(ids, batch["loss_mask"][:1], jnp.array([[a]]), jnp.ones((1, 1), bool), g,
                      cfg.mask_token_id)  # fmt: skip
    z = model.blocks(model.context_kv(feats, pos), blk.anchors, blk.keep, blk.block_ids,
                     blk.positions)  # fmt: skip
    train = teacher_forced(model, z, blk.prev_ids)
    ctx = extend_block_context(model, init_block_context(cfg, 1, 24), feats, jnp.array([a]))
    forced = ids[:, a + 1 : a + 1 + g]
    prop = propose_block(model, ctx, ids[:, a], jax.random.key(0), jnp.array([0]),
                         forced_BxG=forced)  # fmt: skip
    np.testing.assert_allclose(prop.probs, jax.nn.softmax(train.logits[0], -1), atol=2e-6)
    np.testing.assert_allclose(prop.conf_logits, train.conf_logits[0], atol=2e-5)


def test_eagle3_inference_matches_ttt(target):
    """The Gemma Eagle3 drafter's serving path (cache extension, autoregressive steps) records
    exactly the training-time test's distributions at the same positions."""
    tp, batch = target
    cfg = drafter("eagle3")
    model = api.build(cfg, api.init_params(cfg, seed=3, target_params=tp))
    ids, feats = batch["input_ids"][:1], batch["target_features"][:1]
    g, t = cfg.block_size, 8
    steps = ttt_hidden(model, feats, ids, jnp.array([ids.shape[1]]))  # [γ, 1, L, H]
    p_ttt = jax.nn.softmax(model.logits(steps[:, 0, t]), -1)  # [γ, V]
    nxt = jnp.concatenate([ids[:, 1:], ids[:, :1]], axis=1)
    ctx = extend_eagle3_context(model, init_eagle3_context(cfg, 1, 24), feats, nxt,
                                jnp.array([t + 1]))  # fmt: skip
    forced = ids[:, t + 2 : t + 2 + g]
    prop = propose_eagle3(model, ctx, jax.random.key(0), jnp.array([0]), forced_BxG=forced)
    np.testing.assert_allclose(prop.probs[0], p_ttt, atol=2e-6)


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_engine_greedy_equals_plain_decoding(kind, target):
    """The serving engine with a (random) Gemma-style drafter: greedy output equals
    `models.generate` token for token (DSpark: tests/test_gemma4_engine.py's `gemma_pair`)."""
    tp, _ = target
    cfg = drafter(kind)
    dp = api.init_params(cfg, seed=4, target_params=tp)
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, V - 1, size=n)] for n in (11, 19)]
    refs = [generate(TCFG, tp, [p], max_new_tokens=9)[0] for p in prompts]
    eng = ServingEngine(
        TCFG, cfg, tp, dp, num_slots=2, max_len=40, prompt_buckets=(16,), token_buckets=(8,),
        cache_buckets=(40,), modes=("greedy",),
    )  # fmt: skip
    outs = eng.generate(prompts, RequestParams(9, temperature=0.0))
    assert [o.tokens for o in outs] == refs
