"""`eval.anchors`: the teacher-forced acceptance it computes at given anchors is the drafters
stage's training metric (the loss's `accept_num`), and rounds are placed where the decode put
them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import drafters as dr
from dspark_jax.eval.anchors import round_anchors, teacher_forced_acceptance
from dspark_jax.models import init_params
from dspark_jax.testing import drafter_batch, tiny_drafter_config, tiny_target_config
from dspark_jax.train.anchors import anchor_candidates, make_blocks
from dspark_jax.train.losses import loss_fn


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_acceptance_at_every_anchor_is_the_training_metric(kind):
    tcfg = tiny_target_config()
    tp = init_params(tcfg, 0)
    seq = 24
    # DSpark / DFlash: as many anchor blocks as there are candidates, so the loss uses them all
    kw = {} if kind == "eagle3" else dict(num_anchors=seq)
    dcfg = tiny_drafter_config(kind, target=tcfg, **kw)
    dp = dr.init_params(dcfg, seed=3, target_params=tp)
    batch = drafter_batch(tcfg, tp, batch=2, length=seq)
    _, m = jax.jit(loss_fn, static_argnums=0)(
        dcfg, dp.trainable, dp.frozen, batch, jax.random.key(0)
    )
    ids, lm = batch["input_ids"], batch["loss_mask"]
    g = dcfg.block_size
    if kind == "eagle3":
        # row t of the training-time test drafts from anchor t + 1; its step-k slot is supervised
        # where the loss mask (last token cleared) is set at t + k
        anchors = jnp.broadcast_to(jnp.arange(1, seq, dtype=jnp.int32), (2, seq - 1))
        acc = teacher_forced_acceptance(tcfg, tp, dcfg, dp, ids, anchors)
        sup = np.asarray(lm).copy()
        sup[:, -1] = 0
        mk = np.stack([np.pad(sup[:, k:], ((0, 0), (0, k)))[:, : seq - 1] for k in range(g)], -1)
    else:
        cand = np.asarray(anchor_candidates(lm))
        anchors = jnp.asarray([np.flatnonzero(c) for c in cand], jnp.int32)
        acc = teacher_forced_acceptance(tcfg, tp, dcfg, dp, ids, anchors)
        keep = jnp.ones(anchors.shape, bool)
        mk = np.asarray(make_blocks(ids, lm, anchors, keep, g, dcfg.mask_token_id).eval_mask)
    got = (np.asarray(acc) * mk).sum((0, 1))
    np.testing.assert_allclose(got, np.asarray(m["accept_num"]), rtol=1e-5, atol=1e-4)
    assert np.asarray(m["accept_num"]).min() > 0  # the comparison covers every slot


@dataclasses.dataclass
class _Out:
    tokens: list
    num_accepted: list
    eos: list


def test_round_anchors_follow_the_decode():
    g = 3
    # prompt of 4; rounds accept 3 (all), 1, 0, then 2 ending on a stop draft
    out = _Out(tokens=list(range(4 + 3 + 2 + 1 + 2)), num_accepted=[3, 1, 0, 2],
               eos=[False, False, False, True])  # fmt: skip
    rounds = round_anchors([4], [out], g)
    # anchors: 4, 4 + 3 + 1 = 8, 8 + 1 + 1 = 10 (10 + 3 < 16), the stop round is left out
    assert rounds == [(0, 4, 3, "first"), (0, 8, 1, "after_full"), (0, 10, 0, "after_reject")]
    short = _Out(tokens=[7, 8], num_accepted=[1], eos=[False])  # block past the text's end
    assert round_anchors([5], [short], g) == []
