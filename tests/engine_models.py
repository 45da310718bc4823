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
    return tcfg, tp, dcfg, dp._replace(trainable=tr)
