"""The public drafter batch builder (`train.batches`): the loss contract's fields, collated as the
trainer's loader does, padding that changes no real token, one-line errors."""

import numpy as np
import pytest
from toy_train import make_samples, tiny_target

from dspark_jax import testing
from dspark_jax.train.batches import batch_from_samples, drafter_batch
from dspark_jax.train.loader import InMemorySource, MicroBatch, load_rows


def test_batch_from_samples_pads_like_the_loader_and_padding_changes_nothing():
    tcfg, tparams = tiny_target()
    samples = make_samples(3, tcfg.vocab_size, lengths=(6, 12), seed=3)
    b = batch_from_samples(tcfg, tparams, samples, length=16, pad_id=7)
    rows = load_rows(InMemorySource(samples), MicroBatch(np.arange(3), 16), pad_id=7)
    for k in ("input_ids", "loss_mask", "attention_mask"):
        np.testing.assert_array_equal(np.asarray(b[k]), rows[k])
    assert b["target_features"].shape == (3, 16, tcfg.feature_size)
    assert b["target_hidden"].shape == (3, 16, tcfg.hidden_size)
    s = samples[0]  # alone and unpadded: the same features on its real tokens
    one = drafter_batch(tcfg, tparams, s.input_ids[None], s.loss_mask[None])
    n = len(s)
    for k in ("target_features", "target_hidden"):
        np.testing.assert_allclose(b[k][0, :n], one[k][0], rtol=1e-5, atol=1e-5)
    t = testing.drafter_batch(tcfg, tparams, batch=2, length=8, prompt=3)  # the tests' builder
    assert set(t) == set(b) and not np.asarray(t["loss_mask"])[:, :3].any()


def test_bad_input_is_one_line_naming_the_fix():
    tcfg, tparams = tiny_target()
    ids = np.zeros((2, 8), np.int64)
    cases = [
        (dict(input_ids_BxL=ids + 256, loss_mask_BxL=ids), "outside the target's vocabulary"),
        (dict(input_ids_BxL=ids, loss_mask_BxL=ids[:, :4]), "loss_mask has shape"),
        (dict(input_ids_BxL=ids[0], loss_mask_BxL=ids[0]), r"integer \[B, L\]"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match) as e:
            drafter_batch(tcfg, tparams, **kw)
        assert "\n" not in str(e.value)
    samples = make_samples(2, tcfg.vocab_size, lengths=(12, 12))
    with pytest.raises(ValueError, match="a sample has 12 tokens, more than length=8"):
        batch_from_samples(tcfg, tparams, samples, length=8)
