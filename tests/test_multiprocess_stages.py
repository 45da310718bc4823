"""Inference on two processes, as on a pod: two real processes joined by `jax.distributed` over
loopback (2 CPU devices each), the models sharded over both (fsdp 2 x tensor 2).

- `train.py` re-runs the target stage, each process reading its own rows (per-host data), and
  gets the one-process run's losses;
- `train.py` re-runs calibrate and evaluate of the micro run and reports the one-process run's
  τ tables and STS temperatures;
- `serve.py serve`: process 0 serves HTTP, process 1 follows its rounds; concurrent requests
  (seeded sampling, greedy) get the one-device engine's tokens, and SIGTERM on process 0 ends
  both."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from dspark_jax.train.data import count_jsonl_rows
from tests.procs import free_port, wait_all
from tests.test_pipeline_mesh import _env, _report, one_device_run  # noqa: F401 (the fixture)

ROOT = Path(__file__).resolve().parents[1]
MESH = {"data": 1, "fsdp": 2, "tensor": 2}


def _one_device_engine_ids(run: Path, prompt: list[int], n: int, **knobs) -> list[int]:
    """The same request through a one-device engine of the run (fixed γ, root seed 0, as the
    server below)."""
    from dspark_jax.engine import RequestParams
    from dspark_jax.run.rundir import RunDir

    eng = RunDir(run).decoder("dspark", max_len=64, length_buckets=(16,), num_slots=1)
    (out,) = eng.generate([prompt], RequestParams(n, **knobs))
    return [int(x) for x in out.tokens]


def _launch(script: str, args, port: int, tmp_path: Path, env: dict | None = None):
    """Two processes of `script` (logs in files: a pipe nobody reads fills and stalls them)."""
    env = env or _env(2)
    procs, logs = [], []
    for i in range(2):
        cmd = [sys.executable, str(ROOT / script), *args, "--coordinator", f"127.0.0.1:{port}",
               "--num-processes", "2", "--process-id", str(i)]  # fmt: skip
        logs.append(tmp_path / f"{Path(script).stem}{i}.log")
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                          stderr=subprocess.STDOUT))  # fmt: skip
    return procs, logs


def _wait(procs, timeout: float) -> None:
    deadline = time.time() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
def test_calibrate_and_evaluate_on_two_processes_give_the_one_process_report(request, tmp_path):
    one_run = request.getfixturevalue("one_device_run")  # test_pipeline_mesh's, imported above
    run = tmp_path / "micro"
    shutil.copytree(one_run, run)
    port = free_port()
    # the speed section (timed on the mesh in tests/test_pipeline_mesh.py) is left out
    sets = [f"mesh.{k}={v}" for k, v in MESH.items()] + ["evaluate.speed_prompts=0"]
    args = ["--config", "configs/micro.py", "--run-dir", str(run),
            "--stages", "calibrate,evaluate", "--force", "calibrate,evaluate",
            *[a for s in sets for a in ("--set", s)]]  # fmt: skip
    procs, logs = _launch("train.py", args, port, tmp_path)
    wait_all(procs, 900, logs)
    text = [log.read_text() for log in logs]
    tails = "\n".join(t[-3000:] for t in text)
    assert not any("Traceback" in t for t in text), tails
    for t in text:  # upstream stages reused, not re-run because of the mesh
        assert "drafters: skipped" in t and "evaluate: ran" in t, tails

    one, two = _report(one_run), _report(run)
    assert two["mesh"] == MESH and one["mesh"] is None
    for key in ("tau", "tau_by_temperature", "per_dataset", "threshold_sweep"):
        assert two[key] == one[key], key
    np.testing.assert_allclose(
        two["calibration"]["temperatures"], one["calibration"]["temperatures"], rtol=1e-6
    )


@pytest.mark.slow
def test_serve_on_two_processes_gives_the_one_device_tokens(request, tmp_path):
    """The paged engine (its pools' K/V heads over the two processes' tensor axis) behind the
    HTTP server on process 0; the tokens equal a one-device slot engine's."""
    run = request.getfixturevalue("one_device_run")
    http = free_port()
    args = ["serve", "--run-dir", str(run), "--mesh", "1,2,2", "--port", str(http),
            "--num-slots", "2", "--max-len", "64", "--policy", "fixed", "--log-level", "info",
            "--kv-layout", "paged", "--page-size", "8"]  # fmt: skip
    # compiled as the one-device engine in this process that gives the reference tokens (_env)
    procs, logs = _launch("serve.py", args, free_port(), tmp_path)
    url = f"http://127.0.0.1:{http}"
    jobs = [([5, 6, 7, 8, 9, 10], 24, dict(temperature=0.8, top_p=0.9, seed=7)),
            ([11, 12, 13], 20, dict(temperature=0.0)),
            ([40, 41, 42, 43], 16, dict(temperature=1.0, seed=3))]  # fmt: skip

    def complete(job):
        prompt, n, knobs = job
        body = {"model": run.name, "prompt": prompt, "max_tokens": n, "ignore_eos": True,
                "return_token_ids": True, **knobs}  # fmt: skip
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    try:
        deadline = time.monotonic() + 900
        while True:
            assert all(p.poll() is None for p in procs), logs[0].read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, logs[0].read_text()[-2000:]
            time.sleep(0.5)
        with ThreadPoolExecutor(len(jobs)) as ex:  # concurrent: batched on the mesh
            got = list(ex.map(complete, jobs))
        procs[0].terminate()  # the leader drains, then its stop message ends the follower
        _wait(procs, 120)
    finally:
        _wait(procs, 1)
    text = [log.read_text() for log in logs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(t[-2000:] for t in text)
    assert "follows process 0's rounds" in text[1] and "stopped" in text[1]
    for job, ids in zip(jobs, got):
        prompt, n, knobs = job
        assert ids == _one_device_engine_ids(run, prompt, n, **knobs), job


@pytest.mark.slow
def test_target_stage_on_two_processes_reads_per_host_and_trains_as_one(request, tmp_path):
    """Per-host data (issue 40): each process reads and tokenizes only its block of the training
    conversations, and the target trains on the one-process run's windows in the same order (its
    losses equal the one-process run's up to the mesh's reduction order)."""
    one_run = request.getfixturevalue("one_device_run")
    run = tmp_path / "micro"
    shutil.copytree(one_run, run)
    args = ["--config", "configs/micro.py", "--run-dir", str(run), "--stages", "target",
            "--force", "target", *[a for k, v in MESH.items() for a in ("--set", f"mesh.{k}={v}")]]  # fmt: skip
    procs, logs = _launch("train.py", args, free_port(), tmp_path)
    wait_all(procs, 600, logs)
    text = [log.read_text() for log in logs]
    rows = count_jsonl_rows(next((run / "corpus").rglob("train_conversations.jsonl")))
    read = [int(re.search(r"train_conversations.jsonl: read (\d+)", t).group(1)) for t in text]
    assert read == [rows // 2, rows - rows // 2]
    one, two = (json.loads((r / "target" / "train_log.json").read_text()) for r in (one_run, run))
    assert [sorted(r) for r in two] == [sorted(r) for r in one]
    for a, b in zip(one, two):  # the mesh's reduction order: ~2e-5 apart after 20 Adam steps
        for k in a:
            np.testing.assert_allclose(b[k], a[k], rtol=1e-4, err_msg=k)


@pytest.mark.slow
def test_drafters_stage_with_offline_features_on_two_processes(request, tmp_path):
    """Offline features per host: each process reads its block of the regenerated
    conversations and computes the target's features of its own rows only (together: the
    one-process run's samples); the drafter trains to a best checkpoint and the caches go."""
    one_run = request.getfixturevalue("one_device_run")
    run = tmp_path / "micro"
    shutil.copytree(one_run, run)
    sets = [f"mesh.{k}={v}" for k, v in MESH.items()]
    sets += ["drafters.kinds=dspark", "drafters.train.feature_mode=offline"]
    args = ["--config", "configs/micro.py", "--run-dir", str(run), "--stages", "drafters",
            "--force", "drafters", *[a for s in sets for a in ("--set", s)]]  # fmt: skip
    procs, logs = _launch("train.py", args, free_port(), tmp_path)
    wait_all(procs, 600, logs)
    text = [log.read_text() for log in logs]
    tails = "\n".join(t[-3000:] for t in text)
    assert not any("Traceback" in t for t in text) and all("drafters: ran" in t for t in text)

    def count(pattern, t):
        return int(re.search(pattern, t).group(1))

    from dspark_jax.cli.train import load_config

    c = load_config(str(ROOT / "configs" / "micro.py")).calibrate
    rows = sum(count_jsonl_rows(f) for f in (run / "regenerate" / "shards").glob("*.jsonl"))
    n_train = rows - min(c.max_prompts, max(rows // c.heldout_one_in, 1))  # the drafters' rows
    read = [count(r"conversations: read (\d+)", t) for t in text]
    feats = [count(r"target features of (\d+) samples", t) for t in text]
    assert sorted(read) == [n_train // 2, n_train - n_train // 2] and min(feats) > 0, tails
    # the stage's new output (dspark alone) with a best checkpoint
    assert sorted(x.name for x in (run / "drafters").iterdir()) == ["done.json", "dspark"]
    assert (run / "drafters" / "dspark" / "best").is_dir(), tails
    assert not list(run.rglob("features")), "the per-host feature caches were left behind"
    # the one-process run's training losses (as the target stage's per-host data gives): not
    # yet — the two hosts' batches hold other samples or another order (docs/MEASUREMENTS.md)
    rows = [map(json.loads, (r / "drafters/dspark/metrics.jsonl").open()) for r in (one_run, run)]
    losses = [[x["loss"] for x in r if x["split"] == "train"] for r in rows]
    if not np.allclose(losses[1], losses[0], rtol=1e-4):
        pytest.xfail(f"two processes train DSpark on other batches: losses {losses}")
