"""Trainer: schedule, data order, accumulation, logging/eval/best, compile count, resume, bad input,
and a few steps of the real DSpark / DFlash / Eagle3 drafters on the tiny target."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
from toy_train import (
    GAMMA,
    base_config,
    make_samples,
    one_device_mesh,
    tiny_target,
    toy_trainer,
)

from dspark_jax import parallel
from dspark_jax.config import DrafterConfig, MeshConfig, TrainConfig
from dspark_jax.drafters.compat import check_fits
from dspark_jax.errors import ConfigError, DatasetError
from dspark_jax.spec.metrics import simulated_tau
from dspark_jax.testing import CompileCounter, tiny_target_config
from dspark_jax.train import trainer as trainer_mod
from dspark_jax.train.checkpoint import abstract_like, load_best_params
from dspark_jax.train.data import TokenizedSample
from dspark_jax.train.loader import DataLoader, InMemorySource, load_rows
from dspark_jax.train.optimizer import lr_schedule


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------------------
# Pure pieces


def test_lr_schedule_is_the_reference_formula():
    cfg = TrainConfig(learning_rate=6e-4, warmup_ratio=0.04, total_steps=100)
    s = np.arange(0, 110)
    got = np.asarray(lr_schedule(cfg, 100)(s))
    w, total = 4, 100
    want = np.where(
        s < w,
        6e-4 * (s + 1) / w,
        6e-4 * 0.5 * (1 + np.cos(np.pi * np.clip((s - w) / (total - w), 0, 1))),
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-10)  # fp32 cos near -1
    assert got[0] == pytest.approx(1.5e-4) and got[3] == pytest.approx(6e-4)
    assert got[100] == 0.0 and got[109] == 0.0


def test_simulated_tau():
    assert simulated_tau([1.0, 1.0, 1.0]) == 4.0
    assert simulated_tau([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)


def test_loader_order_rounding_epochs_and_buckets():
    samples = make_samples(11, 256, lengths=(5, 40), seed=3)
    dl = DataLoader(InMemorySource(samples), global_batch=4, micro_batch=2, buckets=(16, 32, 64))
    assert dl.samples_per_epoch == 8 and dl.steps_per_epoch == 2 and dl.accum_steps == 2
    p0 = np.random.default_rng(42).permutation(11)[:8]
    p1 = np.random.default_rng(43).permutation(11)[:8]
    np.testing.assert_array_equal(dl.stream(0, 8), p0)
    np.testing.assert_array_equal(dl.stream(6, 4), np.concatenate([p0[6:], p1[:2]]))
    for mb in dl.micro_batches(4):
        longest = max(len(samples[i]) for i in mb.indices)
        assert mb.length == min(b for b in (16, 32, 64) if b >= longest)
        rows = load_rows(dl.source, mb)
        assert rows["input_ids"].shape == (2, mb.length)
        for r, i in enumerate(mb.indices):
            n = len(samples[i])
            np.testing.assert_array_equal(rows["input_ids"][r, :n], samples[i].input_ids)
            assert rows["loss_mask"][r, n:].sum() == 0
            assert rows["attention_mask"][r].sum() == n


def test_loader_skips_or_refuses_sequences_without_supervision():
    samples = make_samples(12, 256, empty_every=3)  # rows 2, 5, 8, 11 have no supervised token
    dl = DataLoader(InMemorySource(samples), global_batch=4, micro_batch=2, buckets=(32,))
    assert dl.num_skipped == 4 and dl.samples_per_epoch == 8
    assert not set(dl.stream(0, 24).tolist()) & {2, 5, 8, 11}
    with pytest.raises(DatasetError, match="no supervised token.*empty_sequences='skip'"):
        DataLoader(
            InMemorySource(samples),
            global_batch=4,
            micro_batch=2,
            buckets=(32,),
            empty_sequences="error",
        )


def test_loader_per_process_shards():
    """P = 2 data shards: contiguous halves of the usable rows, rows [0, B/2) of every
    micro-batch from shard 0 and [B/2, B) from shard 1, epochs over whole per-shard steps."""
    samples = make_samples(23, 256, empty_every=6)  # rows 5, 11, 17 unsupervised: 20 usable
    dl = DataLoader(
        InMemorySource(samples), global_batch=8, micro_batch=4, buckets=(32,), num_shards=2
    )
    s0, s1 = dl.shard_rows(0), dl.shard_rows(1)
    assert len(s0) == len(s1) == 10 and not set(s0) & set(s1) and s0.max() < s1.min()
    assert dl.samples_per_epoch == 8 and dl.steps_per_epoch == 2  # 4 per step from each shard
    seen = {0: [], 1: []}
    for step in range(4):  # two epochs
        for mb in dl.micro_batches(step * 8):
            assert set(mb.indices[:2]) <= set(s0) and set(mb.indices[2:]) <= set(s1)
            seen[0] += mb.indices[:2].tolist()
            seen[1] += mb.indices[2:].tolist()
    assert len(set(seen[0][:8])) == 8 and seen[0][:8] != seen[0][8:]  # fresh epoch order
    again = DataLoader(
        InMemorySource(samples), global_batch=8, micro_batch=4, buckets=(32,), num_shards=2
    )
    np.testing.assert_array_equal(again.micro_batches(24)[1].indices, mb.indices)  # resumable
    with pytest.raises(ConfigError, match="multiple of the number of data shards"):
        DataLoader(InMemorySource(samples), global_batch=6, micro_batch=3, buckets=(32,),
                   num_shards=2)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Training runs (toy drafter, tiny target, online features, one device)


def test_run_logs_evaluates_checkpoints_and_freezes(tmp_path):
    cfg = base_config(total_steps=6, eval_interval=3, checkpoint_interval=3)
    t = toy_trainer(tmp_path / "run", cfg, n_eval=6)
    frozen0 = jax.tree.map(np.asarray, t.frozen)
    target0 = jax.tree.map(np.asarray, t.target_params)
    res = t.run()
    assert res.step == 6 and [h["step"] for h in res.history] == list(range(1, 7))
    losses = [h["loss"] for h in res.history]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    want_lr = np.asarray(lr_schedule(cfg, 6)(np.arange(6)))
    np.testing.assert_allclose([h["lr"] for h in res.history], want_lr, rtol=1e-6)
    # evaluation: every loss term, per-position 1 - TV, simulated tau
    assert [e["step"] for e in res.evals] == [3, 6]
    for e in res.evals:
        assert {"loss", "ce", "l1", "accept_rate", "sim_tau"} <= set(e)
        assert len(e["accept_rate"]) == GAMMA
        assert e["sim_tau"] == pytest.approx(simulated_tau(e["accept_rate"]))
    best = max(res.evals, key=lambda e: e["sim_tau"])
    assert res.best_step == best["step"] and (tmp_path / "run/best" / str(best["step"])).is_dir()
    # logs, sidecar, checkpoints
    recs = _lines(tmp_path / "run/metrics.jsonl")
    assert [r["step"] for r in recs if r["split"] == "train"] == list(range(1, 7))
    assert [r["step"] for r in recs if r["split"] == "eval"] == [3, 6]
    side = json.loads((tmp_path / "run/config.json").read_text())
    assert side["train"]["total_steps"] == 6 and side["target"]["hidden_size"] == 64
    assert t.ckpt.steps() == [3, 6]
    # frozen parts untouched, master weights fp32, optimizer state only over trainable
    for a, b in zip(jax.tree.leaves(frozen0), jax.tree.leaves(t.frozen)):
        np.testing.assert_array_equal(a, np.asarray(b))
    for a, b in zip(jax.tree.leaves(target0), jax.tree.leaves(t.target_params)):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(t.trainable))
    n_train = len(jax.tree.leaves(t.trainable))
    opt_arrays = [x for x in jax.tree.leaves(t.opt_state) if x.ndim > 0]
    assert len(opt_arrays) == 2 * n_train  # Adam mu and nu, nothing for frozen params
    frozen_shapes = {x.shape for x in jax.tree.leaves(t.frozen)}
    assert not frozen_shapes & {x.shape for x in opt_arrays}
    t.close()


def test_best_checkpoint_follows_simulated_tau_not_loss(tmp_path, monkeypatch):
    scripted = iter(
        [
            {"loss": 5.0, "accept_rate": np.array([0.5]), "sim_tau": 1.5},
            {"loss": 4.0, "accept_rate": np.array([0.9]), "sim_tau": 1.9},
            {"loss": 1.0, "accept_rate": np.array([0.7]), "sim_tau": 1.7},
        ]
    )
    monkeypatch.setattr(trainer_mod, "heldout_summary", lambda sums, n: next(scripted))
    t = toy_trainer(tmp_path / "run", base_config(total_steps=3, eval_interval=1), n_eval=2)
    res = t.run()
    assert [e.get("best", False) for e in res.evals] == [True, True, False]
    assert res.best_step == 2 and res.best_score == pytest.approx(1.9)
    assert t.best_ckpt.steps() == [2]
    t.close()


def test_gradient_is_mean_of_micro_batch_gradients(tmp_path):
    t = toy_trainer(tmp_path / "run", base_config(total_steps=1))
    micro = t.loader.micro_batches(0)
    assert len(micro) == 2
    grads = []
    for a, mb in enumerate(micro):
        batch = t._device_batch(t.train_source, mb)
        acc, macc = t._init_accumulators(batch)
        g, _ = t._micro(
            t.spec, t.trainable, t.frozen, t.target_params, acc, macc, batch, t.base_key, 0, a
        )
        grads.append(jax.tree.map(np.asarray, g))
    mean = jax.tree.map(lambda x, y: (x + y) / 2, *grads)
    want = np.sqrt(sum(float((x.astype(np.float64) ** 2).sum()) for x in jax.tree.leaves(mean)))
    res = t.run()
    assert res.history[0]["grad_norm"] == pytest.approx(want, rel=1e-5)
    t.close()


def test_one_compilation_per_bucket_then_no_retrace(tmp_path):
    # bf16 and total_steps=7 are unique to this test: every step compiles here, not earlier
    cfg = base_config(
        compute_dtype="bfloat16", seq_buckets=(16, 32), total_steps=7, eval_interval=2
    )
    train = make_samples(24, 256, lengths=(6, 30), seed=5)
    held_out = make_samples(4, 256, lengths=(6, 14), seed=6)  # one eval bucket (16)
    t = toy_trainer(tmp_path / "run", cfg, train_data=train, eval_data=held_out)
    seen = {mb.length for s in range(3) for mb in t.loader.micro_batches(4 * s)}
    assert seen == {16, 32}, "test data must exercise both buckets in the first 3 steps"
    with CompileCounter() as cc:
        t.run(max_steps=3)
    names = cc.names
    assert names.count("jit(train_micro_step)") == 2, names
    assert names.count("jit(train_apply_step)") == 1, names
    assert names.count("jit(eval_step)") == 1, names
    with CompileCounter() as cc:
        res = t.run()
    assert cc.count == 0 and cc.traces == 0, cc.names
    assert all(math.isfinite(h["loss"]) for h in res.history)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(t.trainable))  # fp32 master
    assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(t.frozen))
    t.close()


def test_resume_in_process_continues_the_same_trajectory(tmp_path):
    cfg = base_config(total_steps=6)
    ref = toy_trainer(tmp_path / "ref", cfg).run()
    first = toy_trainer(tmp_path / "run", cfg)
    first.run(max_steps=3)
    first.close()
    second = toy_trainer(tmp_path / "run", cfg)
    assert second.step == 3 and second.resumed_from == 3
    res = second.run()
    assert [h["loss"] for h in res.history] == [h["loss"] for h in ref.history[3:]]
    recs = _lines(tmp_path / "run/metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 7))
    assert [r["loss"] for r in recs] == [h["loss"] for h in ref.history]
    second.close()


def test_progress_bar_shows_loss_and_eta(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)  # CI quiets tqdm for the demo run
    t = toy_trainer(tmp_path / "run", base_config(total_steps=2, progress_bar=True))
    t.run()
    t.close()
    err = capsys.readouterr().err
    assert "train" in err and "loss=" in err and "2/2" in err and "<" in err  # elapsed<remaining


# ------------------------------------------------------------------------------------------------
# Bad input: clear errors before any step, nothing written


@pytest.mark.parametrize(
    "data, match",
    [
        ([], "empty"),
        (make_samples(6, 256, empty_every=1), "fewer than one global batch"),
        (make_samples(3, 256), "fewer than one global batch"),
        (
            [TokenizedSample(np.zeros(40, np.int32), np.ones(40, np.uint8))] * 4,
            "longer than the largest bucket",
        ),
    ],
)
def test_bad_training_data_is_refused_before_anything_is_written(tmp_path, data, match):
    with pytest.raises(DatasetError, match=match):
        toy_trainer(tmp_path / "run", train_data=data)
    assert not (tmp_path / "run").exists()


def test_bad_eval_data_and_configs_are_refused(tmp_path):
    no_sup = make_samples(4, 256, empty_every=1)
    with pytest.raises(DatasetError, match="evaluation set has no sequence"):
        toy_trainer(tmp_path / "run", eval_data=no_sup)
    with pytest.raises(ConfigError, match="FeatureCacheReader"):
        toy_trainer(tmp_path / "run", base_config(feature_mode="offline"))
    mesh8 = parallel.make_mesh(MeshConfig(data=8))
    with pytest.raises(ConfigError, match="multiple of the mesh"):
        toy_trainer(tmp_path / "run", mesh=mesh8)
    with pytest.raises(ConfigError, match="multiple of micro_batch_size"):
        base_config(global_batch_size=5)
    with pytest.raises(ConfigError, match="compute_dtype"):
        base_config(compute_dtype="float16")
    assert not (tmp_path / "run").exists()


def test_resume_with_another_config_is_refused_and_nothing_changes(tmp_path):
    t = toy_trainer(tmp_path / "run", base_config(total_steps=2))
    t.run()
    t.close()
    before = (tmp_path / "run/metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="learning_rate"):
        toy_trainer(tmp_path / "run", base_config(total_steps=2, learning_rate=1e-3))
    with pytest.raises(ConfigError, match="resume=False"):
        toy_trainer(tmp_path / "run", base_config(total_steps=2), resume=False)
    # a change that does not alter the trajectory is accepted
    toy_trainer(tmp_path / "run", base_config(total_steps=2, eval_interval=5)).close()
    assert (tmp_path / "run/metrics.jsonl").read_text() == before


def test_incompatible_drafter_and_target_are_refused():
    target = tiny_target_config()
    ok = DrafterConfig.dspark(target, num_layers=1, mask_token_id=255)
    check_fits(target, ok)
    wide = tiny_target_config(hidden_size=96, num_heads=6, num_kv_heads=2)
    with pytest.raises(ConfigError, match="hidden size"):
        check_fits(target, ok.replace(target=wide))
    big_vocab = tiny_target_config(vocab_size=512)
    with pytest.raises(ConfigError, match="vocabulary.*mask token 300"):
        check_fits(target, ok.replace(target=big_vocab, mask_token_id=300))
    deep = tiny_target_config(num_layers=8, target_layer_ids=(1, 4, 6))
    with pytest.raises(ConfigError, match=r"feature layer ids \[4, 6\] are outside"):
        check_fits(target, ok.replace(target=deep))
    other_ids = tiny_target_config(target_layer_ids=(0, 2))
    with pytest.raises(ConfigError, match="feature layer ids"):
        check_fits(target, ok.replace(target=other_ids))
    tcfg, tparams = tiny_target()
    bad_frozen = {"embed_tokens": np.zeros((100, 64)), "lm_head": np.zeros((64, 100))}
    with pytest.raises(ConfigError, match="frozen embedding"):
        check_fits(tcfg, ok, target_params=tparams, frozen=bad_frozen)


def test_drafter_for_another_target_is_refused_before_anything_is_written(tmp_path):
    from dspark_jax.train.trainer import Trainer

    _, tparams = tiny_target()  # vocab 256
    other = DrafterConfig.dflash(tiny_target_config(vocab_size=300), num_layers=1, mask_token_id=1)
    with pytest.raises(ConfigError, match="target embedding shape"):
        Trainer.for_drafter(
            base_config(), other, tparams, train_data=make_samples(8, 256), run_dir=tmp_path / "r"
        )
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------------------------
# The real drafters (D's losses) through the trainer, online features


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_real_drafters_train_a_few_steps(tmp_path, kind):
    from dspark_jax.train.trainer import Trainer

    tcfg, tparams = tiny_target()
    small = dict(num_layers=1, block_size=3)
    if kind == "eagle3":
        dcfg = DrafterConfig.eagle3(tcfg, block_size=3)
    elif kind == "dflash":
        dcfg = DrafterConfig.dflash(tcfg, **small, num_anchors=8, mask_token_id=255)
    else:
        dcfg = DrafterConfig.dspark(tcfg, **small, num_anchors=8, mask_token_id=255, markov_rank=16)
    # evaluation (D's accept/tau metrics -> sim_tau, best checkpoint) is exercised for DSpark only
    cfg = base_config(
        global_batch_size=2,
        total_steps=2,
        eval_interval=2 if kind == "dspark" else 0,
        learning_rate=3e-3,
        eval_batch_size=2,
    )
    t = Trainer.for_drafter(
        cfg,
        dcfg,
        tparams,
        train_data=make_samples(8, 256),
        eval_data=make_samples(2, 256, seed=1),
        run_dir=tmp_path / kind,
        mesh=one_device_mesh(),
        target_name="tiny",
        vocab_hash="0123abcd",
    )
    frozen0 = jax.tree.map(np.asarray, t.frozen)
    res = t.run()
    assert len(res.history) == 2 and all(math.isfinite(h["loss"]) for h in res.history)
    assert res.history[0]["grad_norm"] > 0
    if kind == "dspark":
        ev = res.evals[-1]
        assert len(ev["accept_rate"]) == 3 and 1.0 <= ev["sim_tau"] <= 4.0
        assert {"ce", "l1", "bce", "tau"} <= set(ev) and res.best_step == 2
        _check_best_checkpoint_names_its_target(tmp_path / kind, t, tcfg, dcfg)
    for a, b in zip(jax.tree.leaves(frozen0), jax.tree.leaves(t.frozen)):
        np.testing.assert_array_equal(a, np.asarray(b))
    t.close()


def _check_best_checkpoint_names_its_target(run_dir, t, tcfg, dcfg):
    """A drafter checkpoint carries the target it was trained for (name, layer ids, vocabulary hash;
    docs/ARCHITECTURE.md §3.5); loading it for another target fails with one clear error."""
    side = json.loads((run_dir / "config.json").read_text())
    assert side["trained_for"]["name"] == "tiny"
    assert side["trained_for"]["vocab_hash"] == "0123abcd"
    assert side["trained_for"]["target_layer_ids"] == list(tcfg.target_layer_ids)
    abstract = abstract_like(t.trainable)
    step, _, _ = load_best_params(
        run_dir, abstract, target_cfg=tcfg, drafter_cfg=dcfg, vocab_hash="0123abcd"
    )
    assert step == 2
    with pytest.raises(ConfigError, match="vocabulary hash: drafter 0123abcd vs target ffff") as e:
        load_best_params(run_dir, abstract, target_cfg=tcfg, drafter_cfg=dcfg, vocab_hash="ffff")
    assert "\n" not in str(e.value) and "load the drafter trained for this target" in str(e.value)
    other = tcfg.replace(target_layer_ids=(0, 2))
    with pytest.raises(ConfigError, match=r"reads target layers \(0, 1, 2\)"):
        load_best_params(
            run_dir, abstract, target_cfg=other, drafter_cfg=dcfg.replace(target=other)
        )


def test_vocab_hash_follows_the_vocabulary_not_the_object():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from dspark_jax.drafters.compat import vocab_hash

    def tok(vocab):
        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, "[UNK]")))

    base = {"[UNK]": 0, "a": 1, "b": 2}
    h = vocab_hash(tok(base))
    assert len(h) == 16 and h == vocab_hash(tok(dict(reversed(list(base.items())))))
    assert vocab_hash(tok({"[UNK]": 0, "a": 2, "b": 1})) != h  # same tokens, other ids
