"""Target features: online (inside the train step) vs offline (cache) give the same loss; the
cache writer is atomic and resumable; bad caches are refused clearly."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from toy_train import base_config, make_samples, tiny_target, toy_loss, toy_params, toy_trainer

from dspark_jax.errors import ConfigError, FeatureCacheError
from dspark_jax.testing import tiny_target_config
from dspark_jax.train.features import FeatureCacheReader, target_features_jit, write_feature_cache
from dspark_jax.train.loader import MicroBatch, load_rows


def _write(path, samples, dtype="float32", **kw):
    tcfg, tparams = tiny_target()
    kw.setdefault("chunk_size", 4)
    return write_feature_cache(
        path, tcfg, tparams, samples, batch_size=2, buckets=(32,), dtype=dtype, **kw
    )


def test_cache_holds_the_target_features_in_its_dtype(tmp_path):
    tcfg, tparams = tiny_target()
    samples = make_samples(5, 256)
    mb = MicroBatch(np.arange(2), 32)
    for dtype, np_dtype, tol in (
        ("float32", np.float32, 0),
        ("bfloat16", ml_dtypes.bfloat16, 1e-2),
    ):
        r = _write(tmp_path / dtype, samples, dtype)
        assert len(r) == 5 and r.feature_size == tcfg.feature_size
        np.testing.assert_array_equal(r.lengths, [len(s) for s in samples])
        rows = load_rows(r, mb)
        f, h = target_features_jit(
            tcfg, tparams, jnp.asarray(rows["input_ids"])
        )  # the writer's shape
        for i in mb.indices:
            got, n = r.get(i), len(samples[i])
            assert got["target_features"].dtype == np_dtype and len(got["target_hidden"]) == n
            np.testing.assert_array_equal(got["input_ids"], samples[i].input_ids)
            np.testing.assert_array_equal(got["loss_mask"], samples[i].loss_mask)
            for k, want in (("target_features", f), ("target_hidden", h)):
                np.testing.assert_allclose(
                    got[k].astype(np.float32), np.asarray(want[i, :n]), rtol=tol, atol=tol
                )


def test_online_and_offline_give_the_same_loss(tmp_path):
    """The same batch through both paths: exact for an fp32 cache written with the batch's
    shape, within bf16 rounding for the default bf16 cache."""
    tcfg, tparams = tiny_target()
    trainable, frozen = toy_params(tcfg, tparams)
    samples = make_samples(4, 256)
    mb = MicroBatch(np.arange(2), 32)
    rows = load_rows(_write(tmp_path / "f32", samples, chunk_size=2), mb)
    ids = jnp.asarray(rows["input_ids"])
    f_on, h_on = target_features_jit(tcfg, tparams, ids)  # the online computation, jitted
    key = jax.random.key(0)
    jloss = jax.jit(toy_loss)

    def loss(f, h):
        batch = dict(rows, target_features=jnp.asarray(f), target_hidden=jnp.asarray(h))
        return float(jloss(trainable, frozen, batch, key)[0])

    online = loss(f_on, h_on)
    assert loss(rows["target_features"], rows["target_hidden"]) == online
    rows16 = load_rows(_write(tmp_path / "bf16", samples, "bfloat16", chunk_size=2), mb)
    off16 = loss(
        rows16["target_features"].astype(np.float32), rows16["target_hidden"].astype(np.float32)
    )
    assert off16 == pytest.approx(online, rel=1e-2) and off16 != online


def test_offline_trainer_follows_the_online_trajectory(tmp_path):
    samples = make_samples(20, 256)
    held = make_samples(4, 256, seed=1)
    cache = _write(tmp_path / "cache", samples, chunk_size=8)
    cache_eval = _write(tmp_path / "cache_eval", held)
    cfg = base_config(total_steps=4, eval_interval=4)
    online = toy_trainer(tmp_path / "on", cfg, train_data=samples, eval_data=held).run()
    t = toy_trainer(
        tmp_path / "off",
        cfg.replace(feature_mode="offline"),
        train_data=cache,
        eval_data=cache_eval,
    )
    assert t.target_params is None  # no target in the offline step
    offline = t.run()
    t.close()
    np.testing.assert_allclose(
        [h["loss"] for h in offline.history], [h["loss"] for h in online.history], rtol=1e-6
    )
    assert offline.evals[-1]["sim_tau"] == pytest.approx(online.evals[-1]["sim_tau"], rel=1e-6)


def test_cache_writer_resumes_after_interruption(tmp_path):
    samples = make_samples(10, 256)
    path = tmp_path / "cache"
    _write(path, samples, max_chunks=1)  # interrupted after the first of 3 chunks
    with pytest.raises(FeatureCacheError, match="incomplete.*run write_feature_cache again"):
        FeatureCacheReader(path)
    first = os.stat(path / "chunk_000000" / "features.npy")
    # debris of a writer killed mid-chunk and of one killed between rename and index update
    (path / "chunk_000001.tmp").mkdir()
    (path / "chunk_000001.tmp" / "features.npy").write_bytes(b"garbage")
    (path / "chunk_000002").mkdir()
    r = _write(path, samples)
    assert len(r) == 10 and not (path / "chunk_000001.tmp").exists()
    again = os.stat(path / "chunk_000000" / "features.npy")
    assert (first.st_ino, first.st_mtime_ns) == (again.st_ino, again.st_mtime_ns)  # kept
    fresh = _write(tmp_path / "fresh", samples)
    for i in range(10):
        a, b = r.get(i), fresh.get(i)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    index = json.loads((path / "index.json").read_text())
    assert sorted(index["chunks"]) == ["chunk_000000", "chunk_000001", "chunk_000002"]


def test_bad_caches_are_refused(tmp_path):
    samples = make_samples(6, 256)
    path = tmp_path / "cache"
    r = _write(path, samples)
    with pytest.raises(FeatureCacheError, match="other data, target or settings"):
        _write(path, make_samples(6, 256, seed=9))
    with pytest.raises(FeatureCacheError, match="another target"):
        r.check_target(tiny_target_config(num_layers=5))
    with pytest.raises(FeatureCacheError, match="no feature cache"):
        FeatureCacheReader(tmp_path / "nothing")
    with pytest.raises(FeatureCacheError, match="empty"):
        _write(tmp_path / "empty", [])
    with pytest.raises(ConfigError, match="dtype"):
        _write(tmp_path / "f16", samples, "float16")
    (path / "index.json").write_text("{broken")
    with pytest.raises(FeatureCacheError, match="corrupt"):
        FeatureCacheReader(path)
    from dspark_jax.train.trainer import Trainer

    tcfg, tparams = tiny_target()
    trainable, frozen = toy_params(tcfg, tparams)
    with pytest.raises(FeatureCacheError, match="another target"):
        Trainer(
            base_config(feature_mode="offline"),
            toy_loss,
            trainable,
            frozen,
            train_data=_write(tmp_path / "c2", samples),
            target_cfg=tcfg.replace(num_layers=5),
            run_dir=tmp_path / "run",
        )
    assert not (tmp_path / "run").exists()


def test_cache_writer_per_process_shards_merge(tmp_path):
    """Process k of n writes chunks c % n == k and its own index.p<k>.json; the reader merges
    them into the same cache one process writes (here the two processes run one after the
    other, each with the target on its own devices)."""
    samples = make_samples(10, 256)
    path = tmp_path / "cache"
    part = _write(path, samples, process_index=1, process_count=2)
    assert len(part) == 4 and sorted(p.name for p in path.glob("chunk_*")) == ["chunk_000001"]
    _write(path, samples, process_index=0, process_count=2)
    assert not (path / "index.json").exists()
    assert sorted(p.name for p in path.glob("index.p*.json")) == [
        "index.p00000.json",
        "index.p00001.json",
    ]
    merged, single = FeatureCacheReader(path), _write(tmp_path / "single", samples)
    assert len(merged) == len(single) == 10
    for i in range(10):
        a, b = merged.get(i), single.get(i)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    # a later single-process run resumes from the shards (nothing recomputed)
    first = os.stat(path / "chunk_000001" / "features.npy")
    assert len(_write(path, samples)) == 10
    again = os.stat(path / "chunk_000001" / "features.npy")
    assert (first.st_ino, first.st_mtime_ns) == (again.st_ino, again.st_mtime_ns)
    with pytest.raises(ConfigError, match="process_index 2 must be in 0 .. 1"):
        _write(path, samples, process_index=2, process_count=2)
