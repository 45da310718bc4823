"""The drafter context in pages (through the target's block tables, read and written in place)
== the dense context: extend + propose over several rounds of mixed lengths, DSpark and Eagle3,
with and without a context window; the pages hold exactly the dense cache's K/V."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import drafters
from dspark_jax.drafters.paged_context import init_paged_context, with_tables
from dspark_jax.models.paged_attention import gather_pages
from dspark_jax.testing import random_params, tiny_drafter_config, tiny_target_config

PAGE, B, P, R = 4, 8, 40, 3


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_paged_context_equals_dense(kind, window):
    tcfg = tiny_target_config()
    cfg = tiny_drafter_config(kind, tcfg).replace(context_window=window)
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
        pc = extend(cfg, params, with_tables(pc, tables), feats, nxt, num_new)
        key, seeds = jax.random.key(step), jnp.arange(R)
        a = propose(cfg, params, dense, anchor, key, seeds)
        b = propose(cfg, params, pc, anchor, key, seeds)
        np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
        worst = max(worst, float(jnp.abs(a.probs - b.probs).max()))
        np.testing.assert_array_equal(np.asarray(pc.lengths), dense.lengths)
        if kind == "eagle3":
            np.testing.assert_allclose(np.asarray(pc.rows.g), np.asarray(dense.g), atol=1e-5)
        pc = with_tables(pc, None)  # as the engine stores it
    n = int(dense.lengths.max())
    for kd, kp in zip(jax.tree.leaves(dense.k), jax.tree.leaves(pc.k)):
        got = gather_pages(kp, tables)
        for r in range(R):
            m = int(dense.lengths[r])
            np.testing.assert_allclose(np.asarray(got[r, :, :m]), np.asarray(kd[r, :, :m]),
                                       atol=1e-6)  # fmt: skip
    assert n > 12 and worst <= 1e-5, (n, worst)
