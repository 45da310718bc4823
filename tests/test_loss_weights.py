"""Loss weights and decay as traced arrays (`losses.LossWeights`): the defaults give the loss of
the former Python constants bit for bit, other values re-use the compiled loss and train steps,
and `jax.vmap` maps a stack of settings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from toy_train import base_config, make_samples, one_device_mesh, tiny_target

from dspark_jax.drafters import api
from dspark_jax.errors import ConfigError
from dspark_jax.testing import CompileCounter, drafter_batch, tiny_drafter_config
from dspark_jax.train.losses import (
    LossWeights,
    combine_terms,
    loss_fn,
    loss_structure,
    position_weights,
)
from dspark_jax.train.trainer import Trainer

_loss = jax.jit(loss_fn, static_argnums=0)
_value_and_grad = jax.jit(jax.value_and_grad(loss_fn, argnums=1, has_aux=True), static_argnums=0)

# The loss of each drafter below with the Python-constant weights, before they became arrays
# (main at d401c73, this machine's XLA:CPU); other CPUs may round differently, hence rtol.
BEFORE = {"dspark": float.fromhex("0x1.6e97acp+0"), "eagle3": float.fromhex("0x1.480462p+3")}


@pytest.fixture(scope="module")
def setup():
    tcfg, tparams = tiny_target()
    return tcfg, tparams, drafter_batch(tcfg, tparams, batch=2, length=16)


def _drafter(kind, tcfg, tparams, **kw):
    cfg = tiny_drafter_config(kind, target=tcfg, num_layers=1, **kw)
    return cfg, api.init_params(cfg, seed=1, target_params=tparams)


def test_default_position_weights_are_the_former_formulas():
    c = tiny_drafter_config("dspark", block_size=7)
    former = jax.jit(lambda: jnp.exp(-jnp.arange(7, dtype=jnp.float32) / 4.0))()  # in-graph
    np.testing.assert_array_equal(position_weights(c), np.asarray(former))
    e = tiny_drafter_config("eagle3", block_size=7)
    np.testing.assert_array_equal(position_weights(e), [np.float32(0.8**i) for i in range(7)])


@pytest.mark.bitwise
def test_dspark_default_weights_give_the_constant_loss_and_gradient_bit_for_bit(setup):
    tcfg, tparams, batch = setup
    cfg, p = _drafter("dspark", tcfg, tparams)
    key = jax.random.key(0)
    (l0, m0), g0 = _value_and_grad(cfg, *p, batch, key)  # weights None: constants in the jit
    w = LossWeights.of(cfg)
    (l1, _), g1 = _value_and_grad(loss_structure(cfg), *p, batch, key, w)  # traced arrays
    assert float(l1) == float(l0)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    f32 = np.float32  # α_ce·CE + α_l1·L1 + α_conf·BCE in fp32, term by term as before
    want = f32(0.1) * f32(m0["ce"]) + f32(0.9) * f32(m0["l1"]) + f32(1.0) * f32(m0["bce"])
    assert float(l0) == float(want)
    assert float(l0) == pytest.approx(BEFORE["dspark"], rel=1e-6, abs=0)


def test_eagle3_default_step_weights_give_the_constant_loss(setup):
    tcfg, tparams, batch = setup
    cfg, p = _drafter("eagle3", tcfg, tparams)
    key = jax.random.key(0)
    l0 = _loss(cfg, *p, batch, key)[0]
    l1 = _loss(loss_structure(cfg), *p, batch, key, LossWeights.of(cfg))[0]
    assert float(l1) == float(l0)
    assert float(l0) == pytest.approx(BEFORE["eagle3"], rel=1e-6, abs=0)


def test_new_weights_reuse_the_compiled_loss_and_vmap_over_settings(setup):
    tcfg, tparams, batch = setup
    cfg, p = _drafter("dspark", tcfg, tparams)
    key, structure = jax.random.key(0), loss_structure(cfg)
    settings = [
        LossWeights.of(c)
        for c in (cfg, cfg.replace(ce_alpha=1.0, l1_alpha=0.2), cfg.replace(loss_decay_gamma=1.0))
    ]
    _value_and_grad(structure, *p, batch, key, settings[0])  # compiled (or cached) here
    with CompileCounter() as cc:
        each = [float(_value_and_grad(structure, *p, batch, key, w)[0][0]) for w in settings]
    assert cc.count == 0, cc.names
    assert len(set(each)) == 3  # every setting changes the loss
    mapped = jax.jit(jax.vmap(lambda w: loss_fn(structure, *p, batch, key, w)[0]))
    np.testing.assert_allclose(mapped(LossWeights.stack(settings)), each, rtol=1e-6)
    with pytest.raises(ValueError, match=r"weights.position has shape \(3,\), expected \(4,\)"):
        loss_fn(cfg, *p, batch, key, settings[0]._replace(position=np.ones(3, np.float32)))


def test_a_loss_structure_without_weights_is_refused(setup):
    """`loss_structure(cfg)` holds stand-in weights (α = 1 for every term that is on): used
    without `weights` it would train another loss silently, so every entry point refuses it."""
    tcfg, tparams, batch = setup
    key = jax.random.key(0)
    for kind in ("dspark", "eagle3"):
        cfg, p = _drafter(kind, tcfg, tparams)
        structure = loss_structure(cfg)
        assert structure != cfg and loss_structure(structure) == structure
        with pytest.raises(TypeError, match=r"pass weights=LossWeights.of\(cfg\)"):
            loss_fn(structure, *p, batch, key)
        with pytest.raises(TypeError, match="stand-in loss weights"):
            _loss(structure, *p, batch, key)  # under jit too
        with_weights = float(_loss(structure, *p, batch, key, LossWeights.of(cfg))[0])
        assert with_weights == float(_loss(cfg, *p, batch, key)[0])  # cfg alone: its own weights
    t = {k: jnp.ones(()) for k in ("ce_num", "ce_den", "l1_num", "l1_den", "accept_num",
                                   "accept_den", "tau_num", "tau_den")}  # fmt: skip
    with pytest.raises(TypeError, match="stand-in"):
        combine_terms(loss_structure(cfg), t)


def test_trainer_steps_are_compiled_once_for_every_loss_weight(tmp_path):
    tcfg, tparams = tiny_target()
    dcfg = tiny_drafter_config("dspark", target=tcfg, num_layers=1, block_size=3)
    cfg = base_config(global_batch_size=2, total_steps=4)
    data = make_samples(8, tcfg.vocab_size)

    def trainer(d, name):
        return Trainer.for_drafter(cfg, d, tparams, train_data=data, run_dir=tmp_path / name,
                                   mesh=one_device_mesh(), seed=0)  # fmt: skip

    def steps(names):
        return [n for n in names if n in ("jit(train_micro_step)", "jit(train_apply_step)")]

    t = trainer(dcfg, "a")
    first = t.run(max_steps=1, save_at_end=False).history[0]["loss"]
    other = dcfg.replace(ce_alpha=1.0, l1_alpha=0.3, loss_decay_gamma=2.0)
    with CompileCounter() as cc:
        t.set_loss_weights(LossWeights.of(other))
        t.run(max_steps=1, save_at_end=False)
        u = trainer(other, "b")  # another drafter config that differs only in its weights
        second = u.run(max_steps=1, save_at_end=False).history[0]["loss"]
    assert steps(cc.names) == [], cc.names
    assert second != first  # same data, parameters and anchors: only the weights differ
    with pytest.raises(ConfigError, match="shaped like the ones this Trainer was built with"):
        t.set_loss_weights(LossWeights.of(dcfg.replace(block_size=4)))
    t.close()
    u.close()
