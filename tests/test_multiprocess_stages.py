"""The inference stages on two processes, as on a pod: `train.py` on two real processes joined by
`jax.distributed` over loopback (2 CPU devices each) re-runs calibrate and evaluate of the micro
run with the models sharded over both processes (fsdp 2 x tensor 2) and reports the one-process
run's τ tables and STS temperatures."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.test_pipeline_mesh import _env, _report, one_device_run  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[1]
MESH = {"data": 1, "fsdp": 2, "tensor": 2}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_calibrate_and_evaluate_on_two_processes_give_the_one_process_report(request, tmp_path):
    one_run = request.getfixturevalue("one_device_run")  # test_pipeline_mesh's, imported above
    run = tmp_path / "micro"
    shutil.copytree(one_run, run)
    port = _port()
    sets = [f"mesh.{k}={v}" for k, v in MESH.items()] + ["evaluate.speed_reps=0"]
    procs, logs = [], []
    for i in range(2):
        cmd = [sys.executable, str(ROOT / "train.py"), "--config", "configs/micro.py",
               "--run-dir", str(run), "--coordinator", f"127.0.0.1:{port}",
               "--num-processes", "2", "--process-id", str(i),
               "--stages", "calibrate,evaluate", "--force", "calibrate,evaluate",
               *[a for s in sets for a in ("--set", s)]]  # fmt: skip
        logs.append(tmp_path / f"p{i}.log")
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(2), stdout=log,
                                          stderr=subprocess.STDOUT))  # fmt: skip
    deadline = time.time() + 900
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = [log.read_text() for log in logs]
    tails = "\n".join(t[-3000:] for t in text)
    assert all(p.returncode == 0 for p in procs), tails
    assert not any("Traceback" in t for t in text), tails
    for t in text:  # upstream stages reused, not re-run because of the mesh
        assert "drafters: skipped" in t and "evaluate: ran" in t, tails

    one, two = _report(one_run), _report(run)
    assert two["speed_batch1"]["mesh"] == MESH
    for key in ("tau", "tau_by_temperature", "per_dataset", "threshold_sweep"):
        assert two[key] == one[key], key
    np.testing.assert_allclose(
        two["calibration"]["temperatures"], one["calibration"]["temperatures"], rtol=1e-6
    )
