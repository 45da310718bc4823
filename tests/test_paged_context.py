"""The drafter context in pages (through the target's block tables) == the dense context:
extend + propose over several rounds of mixed lengths, DSpark and Eagle3."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import drafters
from dspark_jax.drafters.paged_context import commit, init_paged_context, view
from dspark_jax.testing import random_params, tiny_drafter_config, tiny_target_config

PAGE, B, P, R = 4, 8, 40, 3


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_paged_context_equals_dense(kind):
    tcfg = tiny_target_config()
    cfg = tiny_drafter_config(kind, tcfg)
    params = drafters.init_params(cfg, seed=1, target_params=random_params(tcfg, 0))
    rng = np.random.default_rng(0)
    tables = jnp.asarray(rng.permutation(P)[: R * B].reshape(R, B), jnp.int32)
    dense = drafters.init_context(cfg, R, B * PAGE)
    pc = init_paged_context(cfg, R, P, PAGE)
    extend = jax.jit(drafters.extend_context, static_argnums=0)
    propose = jax.jit(drafters.propose, static_argnums=0)
    worst = 0.0
    for step, t in enumerate((9, 5, 5, 5, 5)):  # a prefill of up to 9, then rounds of <= γ+1
        num_new = jnp.asarray(rng.integers(1 if step else 2, t + 1, R), jnp.int32)
        feats = jnp.asarray(rng.normal(size=(R, t, cfg.feature_size)), jnp.float32)
        nxt = jnp.asarray(rng.integers(0, tcfg.vocab_size, (R, t)), jnp.int32)
        anchor = jnp.asarray(rng.integers(0, tcfg.vocab_size, R), jnp.int32)
        dense = extend(cfg, params, dense, feats, nxt, num_new)
        ctx = view(pc, tables)
        ctx2 = extend(cfg, params, ctx, feats, nxt, num_new)
        pc = commit(pc, ctx2, tables, ctx.lengths, num_new, t)
        key, seeds = jax.random.key(step), jnp.arange(R)
        a = propose(cfg, params, dense, anchor, key, seeds)
        b = propose(cfg, params, view(pc, tables), anchor, key, seeds)
        np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
        worst = max(worst, float(jnp.abs(a.probs - b.probs).max()))
        np.testing.assert_array_equal(np.asarray(view(pc, tables).lengths), dense.lengths)
    n = int(dense.lengths.max())
    got = view(pc, tables)
    for kd, kp in zip(jax.tree.leaves(dense.k), jax.tree.leaves(got.k)):
        for r in range(R):
            m = int(dense.lengths[r])
            np.testing.assert_array_equal(np.asarray(kp[r, :, :m]), np.asarray(kd[r, :, :m]))
    assert n > 12 and worst <= 1e-5, (n, worst)
