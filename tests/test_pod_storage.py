"""Pod storage (issue 40 item 2): checkpoints and run-directory stage outputs on a bucket URL.

Every test writes to `gs://bkt/...` through the fake bucket of `fake_bucket.py`: a real `gs://`
URL down to the filesystem calls (epath's fsspec backend, orbax's bucket atomicity), a local
directory below. Why that backend: epath takes only gs/s3/az/hf URLs (`memory://` raises
KeyError in `epath.Path`), orbax points tensorstore only at `gs://`, and
tensorstore's `memory` kvstore dies with the `ts.Context` orbax opens per save; no GCS emulator
or gcsfs is installed here (details in `fake_bucket.py`).
Each test checks that nothing landed under the current directory (a `gs://` URL handled by
`os.path` / `open` / `pathlib` would have written a relative `gs:/...` there)."""

from __future__ import annotations

import json
import warnings

import fake_bucket
import numpy as np
import pytest
from toy_train import base_config, toy_trainer

from dspark_jax.errors import ConfigError
from dspark_jax.io import atomic_write, write_json_atomic
from dspark_jax.run.store import StageStore
from dspark_jax.storage import as_path, move_tree
from dspark_jax.train.checkpoint import Checkpointer, CheckpointWarning

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture
def bucket(monkeypatch, tmp_path):
    b = fake_bucket.install(monkeypatch, tmp_path)
    yield b
    assert b.stray() == [], "something was written as a local path"
    fake_bucket.clear_caches()


def test_trainer_checkpoints_to_a_bucket_and_resumes_exactly(bucket, tmp_path):
    """The toy trainer checkpoints to gs://, its losses equal a local run's; a step whose commit
    marker never landed (killed between the arrays and `commit_success.txt`) is not resumed
    from: the resumed run restarts at the previous step and redoes the rest bit for bit."""
    cfg = base_config(total_steps=4, checkpoint_interval=2, eval_interval=2)
    local = toy_trainer(tmp_path / "local", cfg, n_eval=2)
    ref = local.run()
    local.close()

    url = "gs://bkt/runs/toy"
    t = toy_trainer(url, cfg, n_eval=2)
    assert str(t.ckpt.directory) == f"{url}/checkpoints"
    res = t.run()
    t.close()
    assert [h["loss"] for h in res.history] == [h["loss"] for h in ref.history]
    on_disk = bucket.local(f"{url}/checkpoints")
    assert sorted(p.name for p in on_disk.iterdir()) == ["2", "4"]
    assert (on_disk / "4" / "commit_success.txt").is_file()  # orbax's bucket atomicity
    assert not list(on_disk.glob("*orbax-checkpoint-tmp*"))
    assert (bucket.local(url) / "config.json").is_file()

    (on_disk / "4" / "commit_success.txt").unlink()  # the commit marker of step 4 never landed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        again = toy_trainer(url, cfg, n_eval=2)
    assert again.resumed_from == 2
    res2 = again.run()
    again.close()
    assert [h["loss"] for h in res2.history] == [h["loss"] for h in ref.history[2:]]
    assert again.best_step == local.best_step
    # the log on the bucket was trimmed to step 2 on resume and appended to: as the local run's
    logged = as_path(f"{url}/metrics.jsonl").read_text().splitlines()
    want = (tmp_path / "local" / "metrics.jsonl").read_text().splitlines()
    drop = ("time", "seconds", "steps_per_s", "tokens_per_s")
    assert [{k: v for k, v in json.loads(x).items() if k not in drop} for x in logged] == [
        {k: v for k, v in json.loads(x).items() if k not in drop} for x in want
    ]
    assert Checkpointer(f"{url}/checkpoints").steps() == [2, 4]


def test_checkpoint_refusals_name_the_fix(bucket):
    with pytest.raises(ConfigError, match="gs:// buckets only"):
        Checkpointer("s3://bkt/ck")
    with pytest.raises(ConfigError, match="not a storage etils.epath writes"):
        as_path("memory://bkt/run")


def test_missing_backend_names_the_package(monkeypatch):
    import fsspec

    def no_gcsfs(protocol):
        raise ImportError("Install gcsfs to access Google Storage")

    monkeypatch.setattr(fsspec, "get_filesystem_class", no_gcsfs)
    with pytest.raises(ConfigError, match="pip install gcsfs"):
        as_path("gs://bkt/run")


def test_interrupted_writes_leave_no_half_output(bucket):
    """A writer killed between its temporary object and the rename, and a stage moved into
    place with its marker copied last, never show a part under the real name."""
    out = as_path("gs://bkt/run/evaluate/report.json")
    with pytest.raises(ValueError, match="storage.as_path"):
        write_json_atomic(str(out), {"v": 0})  # io.py (stdlib only) takes no URL strings
    write_json_atomic(out, {"v": 1})
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(out) as f:
            f.write('{"v": 2, "trunc')
            raise KeyboardInterrupt
    assert json.loads(out.read_text()) == {"v": 1}
    assert [p.name for p in bucket.local("gs://bkt/run/evaluate").iterdir()] == ["report.json"]

    # a stage folder moved into place: a crash while copying leaves the destination unmarked
    src, dst = "gs://bkt/run/work/s.k", "gs://bkt/run/s"
    write_json_atomic(as_path(f"{src}/data.json"), [1, 2])
    np.save(bucket.local(src) / "x.npy", np.arange(3))
    write_json_atomic(as_path(f"{src}/done.json"), {"key": "k"})
    real_copy = type(as_path(src)).copy
    copied = []

    def dying_copy(self, dst_path, overwrite=False):
        if len(copied) == 1:
            raise KeyboardInterrupt  # killed after the first file
        copied.append(self.name)
        return real_copy(self, dst_path, overwrite=overwrite)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(as_path(src)), "copy", dying_copy)
        with pytest.raises(KeyboardInterrupt):
            move_tree(src, dst)
    assert copied and "done.json" not in copied
    assert StageStore.read_done(as_path(dst)) is None  # unmarked: never taken for finished
    assert StageStore.read_done(as_path(src)) == {"key": "k"}  # the source is whole


def _commit(store: StageStore, stage: str, key: str, payload: str):
    w = store.begin(stage, key, force=False)
    (w / "weights.txt").write_text(payload)
    store.commit(stage, key, {}, force=False)


def test_stage_store_on_a_bucket_keeps_restores_and_bounds_versions(bucket):
    """tests/test_run_store.py's store lifecycle with the run directory on gs://."""
    run = as_path("gs://bkt/run")
    logs = []
    store = StageStore("gs://bkt/run", keep=2, log=logs.append)
    _commit(store, "drafters", "aaaa", "A")
    _commit(store, "drafters", "bbbb", "B")
    assert (run / "drafters" / "weights.txt").read_text() == "B"
    assert (run / "previous" / "drafters.aaaa" / "weights.txt").read_text() == "A"
    assert store.recover("drafters", "aaaa")
    assert (run / "drafters" / "weights.txt").read_text() == "A"
    assert (run / "previous" / "drafters.bbbb" / "weights.txt").read_text() == "B"
    for k in ("cccc", "dddd", "eeee"):
        _commit(store, "drafters", k, k)
    kept = sorted(p.name for p in (run / "previous").iterdir())
    assert kept == ["drafters.cccc", "drafters.dddd"], kept  # the newest two
    # a failed build leaves the current output; --force moves trained weights aside
    w = store.begin("drafters", "ffff", force=False)
    (w / "partial.txt").write_text("half")
    assert store.is_done("drafters", "eeee") and not store.is_done("drafters", "ffff")
    assert (store.begin("drafters", "ffff", force=False) / "partial.txt").exists()
    assert not (store.begin("drafters", "ffff", force=True) / "partial.txt").exists()


def test_pipeline_stage_on_a_bucket_run_dir(bucket):
    """The corpus stage of configs/micro.py into gs://: built, swapped in, cached; a changed
    configuration keeps the previous output under previous/ and restores it when it returns."""
    import runpy
    from pathlib import Path

    from dspark_jax.config.pipeline import apply_overrides
    from dspark_jax.run.pipeline import Pipeline

    root = Path(__file__).resolve().parents[1]
    cfg = runpy.run_path(str(root / "configs" / "micro.py"))["config"]()
    cfg = apply_overrides(cfg, ["run_dir=gs://bkt/runs/micro", "data.corpus.n_math=20"])
    logs = []
    assert Pipeline(cfg, log=logs.append).run_stages(("corpus",)) == {"corpus": "ran"}
    first = Pipeline(cfg, log=logs.append).key("corpus")
    run = as_path("gs://bkt/runs/micro")
    assert StageStore.read_done(run / "corpus")["key"] == first
    assert (run / "corpus" / "train_conversations.jsonl").is_file()
    assert Pipeline(cfg, log=logs.append).run_stages(("corpus",)) == {"corpus": "cached"}
    cfg2 = apply_overrides(cfg, ["data.corpus.n_math=30"])
    assert Pipeline(cfg2, log=logs.append).run_stages(("corpus",)) == {"corpus": "ran"}
    assert (run / "previous" / f"corpus.{first}" / "done.json").is_file()
    assert Pipeline(cfg, log=logs.append).run_stages(("corpus",)) == {"corpus": "cached"}
    assert any("restored the output of this configuration" in m for m in logs)
    assert json.loads((run / "config.json").read_text())["data"]["corpus"]["n_math"] == 20
    assert json.loads((run / "config.json").read_text())["run_dir"] == "gs://bkt/runs/micro"
    # no temporary object survived
    assert not [p for p in bucket.local("gs://bkt/runs/micro").rglob("*.tmp")]


@pytest.mark.slow  # the whole micro pipeline in a subprocess: 100 s from a cold cache
def test_micro_pipeline_on_a_bucket_run_dir(bucket, tmp_path, monkeypatch):
    """`train.py --config configs/micro.py --run-dir gs://...` (one drafter, no speed timing; a
    subprocess on one device, like a user's run, with this test's fake bucket): every stage's
    output, done.json and config.json land in the bucket (stage bodies build in a local scratch
    folder, uploaded before their done.json; the drafter's training checkpoints go to the bucket
    directly); a second run finds every stage cached; the run directory loads from the URL and
    exports its drafter to the bucket."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from dspark_jax.config.pipeline import STAGES
    from dspark_jax.run.rundir import RunDir

    here = Path(__file__).resolve().parent
    cache = tmp_path / "cache"
    monkeypatch.setenv("DSPARK_CACHE", str(cache))
    env = dict(os.environ, TQDM_DISABLE="1", DSPARK_CACHE=str(cache))
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parent), env.get("PYTHONPATH", "")])
    url = "gs://bkt/runs/micro"
    args = ["--config", str(here.parent / "configs" / "micro.py"), "--run-dir", url,
            "--set", "drafters.kinds=dspark", "--set", "evaluate.speed_reps=0",
            "--set", "target.train.checkpoint_interval=15"]  # fmt: skip

    def train():
        p = subprocess.run(
            [sys.executable, str(here / "fake_bucket.py"), str(tmp_path), *args],
            cwd=bucket.cwd, env=env, capture_output=True, text=True, timeout=400,
        )  # fmt: skip
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
        return p.stdout + p.stderr

    out = train()
    run = as_path(url)
    for s in STAGES:
        assert StageStore.read_done(run / s) is not None, (s, out[-3000:])
    assert (run / "evaluate" / "report.json").is_file()
    assert (run / "target" / "hf" / "model.safetensors").is_file()
    # the training checkpoints (target and drafter) were written to the bucket by orbax
    for ck in ("target/ckpt", "drafters/dspark/checkpoints", "drafters/dspark/best"):
        steps = list(bucket.local(f"{url}/{ck}").iterdir())
        assert steps and all((d / "commit_success.txt").is_file() for d in steps), (ck, steps)
    assert not list(bucket.local(url).rglob("*.tmp"))
    assert not list((cache / "scratch").rglob("*.*")), "a scratch folder was left behind"
    out2 = train()
    assert all(f"{s}: cached" in out2 for s in STAGES), out2[-2000:]
    rd = RunDir(url)
    assert rd.config.run_dir == url and rd.sts() is not None
    packaged = here.parent / "dspark_jax" / "data" / "decode_cost.tiny.json"
    (run / "cost_profile.json").write_text(packaged.read_text())
    assert rd.cost_profile() is not None
    exported = rd.export_drafter("dspark", "gs://bkt/exports/dspark")
    assert (exported / "config.json").is_file() and (exported / "model.safetensors").is_file()
