"""Checkpoints: atomic async saves, verified restores that skip corrupt or partial steps, and a
bit-identical loss trajectory after SIGKILL + resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from toy_train import base_config, toy_trainer

from dspark_jax.errors import CheckpointError
from dspark_jax.train.checkpoint import Checkpointer, CheckpointWarning, abstract_like
from tests.procs import compile_like_this_process

HERE = Path(__file__).parent

# A restore that orbax/tensorstore abandons on corrupt data leaves callbacks that fire after their
# asyncio loop closed ("Event loop is closed", reported as unraisable at garbage collection).
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _state(scale=1.0):
    return {"w": jnp.arange(600.0).reshape(20, 30) * scale, "step": jnp.asarray(3, jnp.int32)}


def _corrupt_arrays(step_dir: Path):
    for f in (step_dir / "state" / "d").iterdir():
        b = bytearray(f.read_bytes())
        for i in range(len(b) // 2, min(len(b), len(b) // 2 + 8)):
            b[i] ^= 0xFF
        f.write_bytes(bytes(b))


def test_async_save_is_atomic_and_round_trips(tmp_path):
    ck = Checkpointer(tmp_path / "ck", max_to_keep=2)
    ck.save(1, _state(), {"data_position": 8, "config": {"a": 1}})
    # while the async write runs, only orbax's temporary directory (or the final one) exists
    names = os.listdir(tmp_path / "ck")
    assert all(n == "1" or ".orbax-checkpoint-tmp" in n for n in names), names
    ck.wait()
    assert os.listdir(tmp_path / "ck") == ["1"] and ck.steps() == [1]
    step, state, meta = ck.restore(abstract_like(_state()))
    assert step == 1 and meta["data_position"] == 8 and meta["config"] == {"a": 1}
    np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(_state()["w"]))
    ck.save(2, _state(2.0), {})
    ck.save(3, _state(3.0), {})
    ck.wait()
    assert ck.steps() == [2, 3]  # max_to_keep
    ck.close()


def test_restore_skips_partial_and_corrupt_steps_then_fails_clearly(tmp_path):
    d = tmp_path / "ck"
    ck = Checkpointer(d, max_to_keep=5)
    for s in (1, 2, 3):
        ck.save(s, _state(float(s)), {})
    ck.wait()
    (d / "4.orbax-checkpoint-tmp").mkdir()  # a save killed mid-write: never listed
    shutil.copytree(d / "3", d / "5")
    (d / "5" / "_CHECKPOINT_METADATA").unlink()  # partial: commit files missing
    _corrupt_arrays(d / "3")  # unreadable arrays
    (d / "2" / "meta" / "metadata").write_text("{not json")  # corrupt sidecar
    ck = Checkpointer(d, max_to_keep=5)
    assert ck.steps() == [1, 2, 3]
    with pytest.warns(CheckpointWarning) as rec:
        step, state, _ = ck.restore(abstract_like(_state()))
    assert step == 1
    np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(_state(1.0)["w"]))
    text = " ".join(str(w.message) for w in rec)
    assert "step 5" in text and "partial" in text and "step 3" in text and "step 2" in text
    assert sorted(p.name.split(".")[0] for p in d.glob("*.corrupt-*")) == ["2", "3", "5"]
    with pytest.raises(CheckpointError, match="step 3"):
        ck.restore(abstract_like(_state()), step=3)
    _corrupt_arrays(d / "1")
    with pytest.raises(CheckpointError, match="no usable checkpoint.*Remove the bad step"):
        with pytest.warns(CheckpointWarning):
            ck.restore(abstract_like(_state()))


def test_restore_refuses_arrays_that_do_not_match_the_fingerprint(tmp_path):
    ck = Checkpointer(tmp_path / "ck")
    ck.save(1, _state(), {})
    ck.wait()
    meta_file = tmp_path / "ck" / "1" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["fingerprint"][0] += 1.0  # as if the arrays had silently changed on disk
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="fingerprint"):
        with pytest.warns(CheckpointWarning):
            ck.restore(abstract_like(_state()))


def test_trainer_resumes_from_previous_good_checkpoint_when_latest_is_corrupt(tmp_path):
    cfg = base_config(total_steps=4, checkpoint_interval=2, eval_interval=2)
    t = toy_trainer(tmp_path / "run", cfg, n_eval=2)
    ref = t.run()
    t.close()
    _corrupt_arrays(tmp_path / "run" / "checkpoints" / "4")
    with pytest.warns(CheckpointWarning, match="step 4"):
        again = toy_trainer(tmp_path / "run", cfg, n_eval=2)
    assert again.step == 2
    res = again.run()
    assert [h["loss"] for h in res.history] == [h["loss"] for h in ref.history[2:]]
    assert [e["sim_tau"] for e in res.evals] == [e["sim_tau"] for e in ref.evals[1:]]
    assert again.best_step == ref.best_step and again.best_ckpt.steps() == [ref.best_step]
    again.close()
    for s in ("2", "4"):
        _corrupt_arrays(tmp_path / "run" / "checkpoints" / s)
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        with pytest.warns(CheckpointWarning):
            toy_trainer(tmp_path / "run", cfg)


@pytest.mark.bitwise
def test_sigkill_then_resume_gives_a_bit_identical_loss_trajectory(tmp_path):
    """Kill -9 a training subprocess after its step-3 checkpoint (steps 4-5 already logged),
    resume here, and compare every step's loss with an uninterrupted run."""
    from train_subprocess import kill_config

    run = tmp_path / "killed"
    env = compile_like_this_process(os.environ)  # its losses are compared bit for bit
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "train_subprocess.py"), "kill", str(run), "5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.time() + 240
        line = ""
        while time.time() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
            if line.strip() == "HANG":
                break
        assert line.strip() == "HANG", f"child did not reach step 5: {proc.stderr.read()[-3000:]}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    logged = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1] >= 4  # the killed run had gone past its last checkpoint
    cfg = kill_config()
    resumed = toy_trainer(run, cfg)
    assert resumed.resumed_from == 3
    resumed.run()
    resumed.close()
    ref = toy_trainer(tmp_path / "ref", cfg).run()
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert [r["loss"] for r in recs] == [h["loss"] for h in ref.history]  # bit-identical
    assert [r["grad_norm"] for r in recs] == [h["grad_norm"] for h in ref.history]
    jax.clear_caches()


def test_old_run_dir_without_later_fields_resumes_when_their_defaults_keep_its_behaviour(tmp_path):
    """Issue 12: a run directory whose saved TrainConfig predates fields added later (here
    `target_dtype`, `anchor_chunk`) resumes when the values that reproduce the old behaviour are
    set, and is refused in one line naming the field and the value otherwise."""
    from dspark_jax.errors import ConfigError

    cfg = base_config(total_steps=4)
    first = toy_trainer(tmp_path / "run", cfg)
    first.run(max_steps=2)
    first.close()
    side = tmp_path / "run/config.json"
    saved = json.loads(side.read_text())
    for field in ("target_dtype", "anchor_chunk"):
        del saved["train"][field]
    del saved["trained_for"]
    side.write_text(json.dumps(saved))
    # the target ran in the compute dtype then; "auto" resolves to it
    with pytest.raises(ConfigError, match=r"TrainConfig\.target_dtype='float32' to resume") as e:
        toy_trainer(tmp_path / "run", base_config(total_steps=4, target_dtype="bfloat16"))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"TrainConfig\.anchor_chunk=-1 to resume"):
        toy_trainer(tmp_path / "run", base_config(total_steps=4, anchor_chunk=4))
    again = toy_trainer(tmp_path / "run", cfg)
    assert again.resumed_from == 2
    res = again.run()
    assert res.step == 4 and [h["step"] for h in res.history] == [3, 4]
    again.close()
    assert "target_dtype" in json.loads(side.read_text())["train"]  # rewritten in today's layout
