"""Multi-process launch: `jax.distributed.initialize` from flags or the environment (two real
processes over loopback), one-line errors for incomplete flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from dspark_jax.config import MeshConfig
from dspark_jax.errors import ConfigError
from dspark_jax.launch import init_distributed
from dspark_jax.parallel import local_mesh
from tests.procs import free_port

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys
from dspark_jax.launch import add_distributed_flags, init_distributed
from dspark_jax.parallel import make_mesh
import argparse, jax
ap = argparse.ArgumentParser()
add_distributed_flags(ap)
a = ap.parse_args(sys.argv[1:])
multi = init_distributed(a.coordinator, a.num_processes, a.process_id, a.distributed)
mesh = make_mesh()  # every device of every process, data parallel
print(json.dumps({"multi": multi, "index": jax.process_index(), "count": jax.process_count(),
                  "devices": jax.device_count(), "local": jax.local_device_count(),
                  "mesh": dict(mesh.shape)}))
jax.distributed.shutdown()
"""


def _run_processes(cmds, timeout):
    """Start every (argv, env) at once; each must exit 0; their last stdout lines as JSON."""
    procs = [
        subprocess.Popen(c, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for c, e in cmds
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def test_incomplete_flags_are_one_line_errors(monkeypatch):
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(k, raising=False)
    assert init_distributed() is False  # single process: nothing initialised
    with pytest.raises(ConfigError, match="need --coordinator"):
        init_distributed(num_processes=2, process_id=0)
    with pytest.raises(ConfigError, match="needs --num-processes N and --process-id"):
        init_distributed("127.0.0.1:1", num_processes=2)
    with pytest.raises(ConfigError, match="must be in 0 .. 1"):
        init_distributed("127.0.0.1:1", num_processes=2, process_id=2)
    env = dict(os.environ, TQDM_DISABLE="1")
    p = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--num-processes", "2", "--process-id", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode != 0 and "need --coordinator" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr


def test_two_processes_join_from_flags_and_from_the_environment(tmp_path):
    """Process 0 from flags, process 1 from JAX_* environment variables: one 4-device mesh."""
    port = free_port()
    base = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2"
    )
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")])
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        base.pop(k, None)
    addr = f"127.0.0.1:{port}"
    cmds = [
        ([sys.executable, "-c", CHILD, "--coordinator", addr, "--num-processes", "2",
          "--process-id", "0"], base),
        ([sys.executable, "-c", CHILD],
         dict(base, JAX_COORDINATOR_ADDRESS=addr, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1")),
    ]  # fmt: skip
    outs = _run_processes(cmds, timeout=120)
    assert [o["index"] for o in outs] == [0, 1]
    for o in outs:
        assert o["multi"] and o["count"] == 2 and o["devices"] == 4 and o["local"] == 2
        assert o["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_local_mesh_for_per_process_work():
    assert dict(local_mesh(MeshConfig(fsdp=2, tensor=4)).shape) == {
        "data": 1,
        "fsdp": 2,
        "tensor": 4,
    }
    # a model-parallel size that this host cannot hold: tensor over every local device
    assert dict(local_mesh(MeshConfig(tensor=16)).shape) == {"data": 1, "fsdp": 1, "tensor": 8}


STAGED_CHILD = """
import json, sys
from pathlib import Path
import jax
from dspark_jax.launch import init_distributed
init_distributed(sys.argv[1], 2, int(sys.argv[2]))
from dspark_jax.run.staged import StagedRun
from dspark_jax.cli.train import load_config

class Toy(StagedRun):
    def _corpus_needed(self):
        return []

    def _stage_corpus(self):
        d = self.stage_dir("corpus")
        (d / f"p{jax.process_index()}.txt").write_text("x")  # every process writes its part
        return {}

cfg = load_config(str(Path(sys.argv[4]) / "configs" / "micro.py"))
import dataclasses
cfg = dataclasses.replace(cfg, run_dir=sys.argv[3])
first = Toy(cfg, log=lambda *a: None).run_stages(("corpus",))
again = Toy(cfg, log=lambda *a: None).run_stages(("corpus",))
print(json.dumps({"first": first, "again": again}))
jax.distributed.shutdown()
"""


def test_stage_transitions_in_a_two_process_run(tmp_path):
    """Two processes run the same stage into one run directory: process 0 alone moves folders
    (barriers around each transition), both processes' writes land in the finished output, and a
    rerun finds it cached in both."""
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", TQDM_DISABLE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = tmp_path / "run"
    child = [sys.executable, "-c", STAGED_CHILD, f"127.0.0.1:{port}"]
    cmds = [([*child, str(i), str(run), str(ROOT)], env) for i in range(2)]
    outs = _run_processes(cmds, timeout=180)
    for o in outs:
        assert o == {"first": {"corpus": "ran"}, "again": {"corpus": "cached"}}
    assert sorted(f.name for f in (run / "corpus").iterdir()) == ["done.json", "p0.txt", "p1.txt"]
    assert not (run / "work").exists()


def test_batch_that_the_mesh_cannot_split_is_refused_at_start_up(tmp_path):
    """A drafters micro-batch that data x fsdp does not divide: one line naming the field, exit 2,
    before any stage runs (it used to surface only when the drafters stage built its Trainer)."""
    env = dict(os.environ, TQDM_DISABLE="1", JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")  # fmt: skip
    run = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--config", "configs/micro.py", "--run-dir",
         str(run), "--set", "mesh.data=2", "--set", "drafters.train.global_batch_size=6",
         "--set", "drafters.train.micro_batch_size=3"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "drafters.train.micro_batch_size=3" in err[0], p.stderr
    assert "data x fsdp = 2" in err[0] and "Traceback" not in p.stderr
    assert not (run / "corpus").exists()
