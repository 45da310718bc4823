"""Engine test models: `agreeing_pair` (a target and a DSpark drafter that agree often, but not
always; it lives in `dspark_jax.testing`, which benchmarks/serving_frontier.py uses too) and
`trained_pair` (the same target with a briefly trained DFlash or Eagle3 drafter).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import drafters
from dspark_jax.config import DrafterConfig
from dspark_jax.testing import agreeing_pair, markov_drafter

__all__ = ["agreeing_pair", "markov_drafter", "trained_pair"]


def trained_pair(kind: str, vocab=64, gamma=4, steps=120, lr=1e-2, n_seqs=16, seed=0, **pair_kw):
    """(tcfg, tparams, dcfg, dparams): the `agreeing_pair` target with a DFlash or Eagle3
    drafter (no sequential head to hand-wire) trained briefly with the project's own loss
    (`train.losses.loss_fn`, Adam) on the target's greedy continuations of random prompts — the
    distribution the greedy-equality tests draft on — so its drafts are really accepted."""
    import optax

    from dspark_jax.models.generate import generate
    from dspark_jax.models.transformer import forward_jit
    from dspark_jax.testing import positions_like
    from dspark_jax.train.losses import loss_fn

    tcfg, tp, _, _ = agreeing_pair(vocab=vocab, gamma=gamma, seed=seed, **pair_kw)
    if kind == "eagle3":
        dcfg = DrafterConfig.eagle3(tcfg, block_size=gamma)
    else:
        dcfg = DrafterConfig.dflash(
            tcfg, num_layers=1, block_size=gamma, mask_token_id=vocab - 1, num_anchors=16
        )
    rng = np.random.default_rng(seed + 7)
    prompts = [
        list(rng.integers(0, vocab - 1, size=int(rng.integers(2, 8)))) for _ in range(n_seqs)
    ]
    length = 40
    seqs = [
        (p + generate(tcfg, tp, [p], max_new_tokens=length)[0])[:length] for p in prompts
    ]  # fmt: skip
    ids = jnp.asarray(seqs, jnp.int32)
    out, _ = forward_jit(tcfg, tp, ids, positions_like(ids), compute_logits=False)
    batch = dict(
        input_ids=ids,
        loss_mask=jnp.ones(ids.shape, jnp.float32),
        target_features=out.features,
        target_hidden=out.hidden,
    )
    dp = drafters.init_params(dcfg, seed=seed + 1, target_params=tp)
    opt = optax.adam(lr)

    @jax.jit
    def step(trainable, state, key):
        (loss, _), g = jax.value_and_grad(
            lambda t: loss_fn(dcfg, t, dp.frozen, batch, key), has_aux=True
        )(trainable)
        upd, state = opt.update(g, state, trainable)
        return optax.apply_updates(trainable, upd), state, loss

    trainable, state = dp.trainable, opt.init(dp.trainable)
    for i in range(steps):
        trainable, state, _ = step(trainable, state, jax.random.key(i))
    return tcfg, tp, dcfg, dp._replace(trainable=trainable)
