"""train.py as two real processes (one CPU device each, `jax.distributed` over loopback): the
micro preset's first four stages into one run directory. Each process reads and regenerates only
the rows of its own shards, and the regenerated conversations equal a one-process regeneration from the same target,
row for row."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import free_port

ROOT = Path(__file__).resolve().parents[1]
STAGES = "corpus,tokenizer,target,regenerate"
# 16 regeneration prompts (10 + the 6 calibration ones) in shards of 4 x batch_size = 8 prompts
SETS = ["--set", "regenerate.max_prompts=10", "--set", "regenerate.batch_size=2"]


def _train(run_dir: Path, stages: str, extra=(), **env_extra) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", TQDM_DISABLE="1", **env_extra)
    env.pop("XLA_FLAGS", None)  # one device per process
    argv = [sys.executable, str(ROOT / "train.py"), "--config", "configs/micro.py",
            "--run-dir", str(run_dir), "--stages", stages, *SETS, *extra]  # fmt: skip
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip


def _wait(procs, timeout=600) -> list[str]:
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            assert p.returncode == 0, out[-3000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def _rows(run_dir: Path) -> dict[int, dict]:
    rows = {}
    for f in sorted((run_dir / "regenerate" / "shards").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            assert r["id"] not in rows, f"prompt {r['id']} regenerated twice"
            rows[r["id"]] = r
    return rows


@pytest.mark.slow
def test_two_process_regeneration_equals_one_process(tmp_path):
    run = tmp_path / "run"
    addr = f"127.0.0.1:{free_port()}"
    flags = ["--coordinator", addr, "--num-processes", "2", "--process-id"]
    outs = _wait([_train(run, STAGES, [*flags, str(i)]) for i in range(2)])
    for out in outs:
        assert "regenerate: ran" in out, out[-2000:]
        # per-host data: each process reads (parses) only the rows of its own shard
        assert "this process reads 8 row(s), 8 usable" in out, out[-2000:]
    shards = sorted(p.name for p in (run / "regenerate" / "shards").iterdir())
    assert shards == ["00000.p0.jsonl", "00001.p1.jsonl"]  # each process wrote its own shard
    assert not (run / "work").exists()

    # the same target regenerates the same prompts in one process: the same rows
    one = tmp_path / "one"
    shutil.copytree(run, one)
    shutil.rmtree(one / "regenerate")
    (out,) = _wait([_train(one, "regenerate")])
    assert "regenerate: ran" in out and "target: skipped" in out, out[-2000:]
    assert sorted(p.name for p in (one / "regenerate" / "shards").iterdir()) == [
        "00000.jsonl",
        "00001.jsonl",
    ]
    a, b = _rows(run), _rows(one)
    assert len(a) == 16 and a == b
