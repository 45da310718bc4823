"""A target and a DSpark drafter that agree often (but not always), for engine exactness tests.

The target is a random Qwen2 block whose residual branches are scaled by `mix`, with an untied LM
head that maps each token's own (normalised) embedding to `perm[token]`: its next token is mostly
`perm[current]`, but attention over the context changes it now and then (so cache mistakes
change the output). The drafter's vanilla Markov head (rank V) adds `bias * onehot(perm[prev])`,
so it drafts the permutation chain: drafts are accepted for several slots, then rejected where
the context matters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import drafters
from dspark_jax.config import DrafterConfig
from dspark_jax.testing import random_params, tiny_target_config


def _set(leaf, value):
    return leaf.replace(jnp.asarray(value, jnp.float32))


def agreeing_pair(
    vocab=64, gamma=4, mix=0.2, head_scale=8.0, markov_bias=500.0, seed=0, **target_kw
):
    """(tcfg, tparams, dcfg, dparams)."""
    tcfg = tiny_target_config("qwen2", vocab_size=vocab, **target_kw)
    tp = jax.tree.map(lambda x: x, random_params(tcfg, seed))
    for i in range(tcfg.num_layers):
        layer = tp["layers"][i]
        o = layer["self_attn"]["o_proj"]["kernel"]
        layer["self_attn"]["o_proj"]["kernel"] = _set(o, o[...] * mix)
        d = layer["mlp"]["down_proj"]["kernel"]
        layer["mlp"]["down_proj"]["kernel"] = _set(d, d[...] * mix)
    perm = np.random.default_rng(seed).permutation(vocab)
    emb = np.asarray(tp["embed_tokens"][...])
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    head = np.zeros((tcfg.hidden_size, vocab), np.float32)
    head[:, perm] = (unit * head_scale).T
    tp["lm_head"]["kernel"] = _set(tp["lm_head"]["kernel"], head)
    dcfg, dp = markov_drafter(tcfg, tp, perm, gamma, markov_bias, seed)
    return tcfg, tp, dcfg, dp


def markov_drafter(tcfg, tp, perm, gamma, markov_bias, seed):
    """(dcfg, dparams): a one-layer DSpark drafter for `tcfg` whose vanilla Markov head (rank V)
    adds `markov_bias * onehot(perm[prev])`: it drafts the permutation chain."""
    vocab = tcfg.vocab_size
    dcfg = DrafterConfig.dspark(
        tcfg,
        num_layers=1,
        block_size=gamma,
        mask_token_id=vocab - 1,
        num_anchors=8,
        markov_rank=vocab,
        markov_head_type="vanilla",
    )
    dp = drafters.init_params(dcfg, seed=seed + 1, target_params=tp)
    tr = jax.tree.map(lambda x: x, dp.trainable)
    w2 = np.zeros((vocab, vocab), np.float32)
    w2[np.arange(vocab), perm] = markov_bias
    mh = tr["markov_head"]
    mh["markov_w1"] = _set(mh["markov_w1"], np.eye(vocab, dtype=np.float32))
    mh["markov_w2"]["kernel"] = _set(mh["markov_w2"]["kernel"], w2)
    return dcfg, dp._replace(trainable=tr)


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
