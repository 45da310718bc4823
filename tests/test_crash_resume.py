"""Nothing lost on a crash: `train.py` killed with SIGKILL inside each of the seven stages, rerun
each time, ends with the uninterrupted run's outputs bit for bit (the target's weights, every
drafter's training log, the τ tables and STS temperatures), and no stage output is ever
half-written; `serve.py serve` killed mid-warm-up restarts and reads the programs it had compiled
from the persistent compilation cache."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.procs import compile_like_this_process, free_port
from tests.test_pipeline_mesh import STAGES, _env, _report, one_device_run  # noqa: F401 (the fixture)

ROOT = Path(__file__).resolve().parents[1]
# the target checkpoints every 10 of its 30 steps, so a kill inside it resumes from one (the
# interval changes no weight: the weights are compared with the reference run's, which has none)
SETS = ["--set", "target.train.checkpoint_interval=10"]


def _launch(args, log: Path, env=None) -> subprocess.Popen:
    with open(log, "w") as f:  # a file: a pipe nobody reads fills and stalls the process
        return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env or _env(1), stdout=f,
                                stderr=subprocess.STDOUT)  # fmt: skip


def _wait_for(proc, log: Path, ready, timeout=600.0) -> str:
    """Poll until `ready(text)` holds; the log's text (the process must still be running)."""
    deadline = time.monotonic() + timeout
    while True:
        text = log.read_text()
        if ready(text):
            return text
        assert proc.poll() is None, f"exited {proc.returncode} early:\n{text[-3000:]}"
        assert time.monotonic() < deadline, text[-3000:]
        time.sleep(0.05)


def _kill9(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _ckpt_saved(run: Path):
    """The target's first checkpoint is on disk (orbax commits a step's folder by renaming)."""
    return lambda text: any(p.name.isdigit() for p in run.glob("work/target.*/ckpt/*"))


def _after(marker: str, seconds: float = 0.0):
    seen: dict[str, float] = {}

    def ready(text: str) -> bool:
        if marker in text:
            seen.setdefault("t", time.monotonic())
            return time.monotonic() - seen["t"] >= seconds
        return False

    return ready


def _stage_outputs_whole(run: Path) -> list[str]:
    """Stages with a finished output; a stage's folder exists only with its done.json (built in
    work/ and swapped in whole), and every JSON file outside work/ parses."""
    done = []
    for s in STAGES:
        if (run / s).exists():
            assert (run / s / "done.json").is_file(), f"{s}/ without done.json"
            done.append(s)
    for f in run.glob("*.json"):
        json.loads(f.read_text())
    for s in done:
        for f in (run / s).rglob("*.json"):
            json.loads(f.read_text())
    return done


@pytest.mark.slow
def test_sigkill_in_every_stage_then_rerun_gives_the_uninterrupted_run(request, tmp_path):
    ref = request.getfixturevalue("one_device_run")  # test_pipeline_mesh's, imported above
    run = tmp_path / "micro"
    args = [str(ROOT / "train.py"), "--config", "configs/micro.py", "--run-dir", str(run), *SETS]
    kill_when = {
        "corpus": _after("[corpus] running"),
        "tokenizer": _after("[tokenizer] running"),
        "target": _ckpt_saved(run),
        "regenerate": _after("[regenerate] running", 3.0),
        "drafters": _after("training dflash"),  # dspark trained, dflash on its way
        "calibrate": _after("[calibrate] running", 2.0),
        "evaluate": _after("T=0: macro τ"),  # the τ tables done, the speed section not
    }
    interrupted = []
    for i, stage in enumerate(STAGES):
        log = tmp_path / f"train{i}.log"
        proc = _launch(args, log)
        _wait_for(proc, log, kill_when[stage])
        _kill9(proc)
        done = _stage_outputs_whole(run)
        if stage not in done:
            interrupted.append(stage)
    # the short stages may finish between the line and the kill; the long ones may not
    assert {"target", "regenerate", "drafters", "calibrate", "evaluate"} <= set(interrupted)
    log = tmp_path / "final.log"
    proc = _launch(args, log)
    proc.wait(timeout=900)
    text = log.read_text()
    assert proc.returncode == 0 and "Traceback" not in text, text[-3000:]
    assert "[evaluate] done" in text, text[-3000:]
    assert _stage_outputs_whole(run) == list(STAGES)

    assert (run / "target/hf/model.safetensors").read_bytes() == (
        ref / "target/hf/model.safetensors"
    ).read_bytes()
    for kind in ("dspark", "dflash", "eagle3"):  # the loss trajectory of every step, resumed
        got = (run / "drafters" / kind / "metrics.jsonl").read_text()
        assert got == (ref / "drafters" / kind / "metrics.jsonl").read_text(), kind
    one, two = _report(ref), _report(run)
    for key in ("tau", "tau_by_temperature", "per_dataset", "threshold_sweep"):
        assert two[key] == one[key], key
    assert two["calibration"]["temperatures"] == one["calibration"]["temperatures"]


def _entries(cache: Path) -> set[str]:
    """The persistent cache's programs (JAX's files <name>-<hash>-cache)."""
    return {p.name for p in cache.glob("*-cache")}


@pytest.mark.slow
def test_server_killed_mid_warmup_restarts_from_the_compilation_cache(request, tmp_path):
    run = request.getfixturevalue("one_device_run")
    cache = tmp_path / "xla"  # its own cache: CI's is warm from the runs above
    # compiled at the pytest processes' level (tests/procs.py): what is checked is which
    # programs the restarts read back, not their code; each warm-up compiles in about half
    env = {**compile_like_this_process(_env(1)), "DSPARK_COMPILATION_CACHE": str(cache)}
    port = free_port()
    args = [str(ROOT / "serve.py"), "serve", "--run-dir", str(run), "--port", str(port),
            "--num-slots", "1", "--max-len", "64", "--log-level", "info"]  # fmt: skip
    log = tmp_path / "serve0.log"
    proc = _launch(args, log, env)
    at_load: list[int] = []

    def mid_warmup(text: str) -> bool:  # loaded, and 3 of the warm-up's programs compiled
        if "loaded" not in text:
            return False
        at_load.append(len(_entries(cache)))
        return at_load[-1] >= at_load[0] + 3

    _wait_for(proc, log, mid_warmup)
    _kill9(proc)
    first = _entries(cache)
    warm = re.compile(r"warm-up: (\d+) compilations \((\d+) read from the compilation cache")
    counts = []
    for i in (1, 2):
        log = tmp_path / f"serve{i}.log"
        t0 = time.time()
        proc = _launch(args, log, env)
        try:
            _wait_for(proc, log, lambda t: "serving on" in t, timeout=600)
            body = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
        finally:
            proc.terminate()
            proc.wait(timeout=120)
        text = log.read_text()
        assert proc.returncode == 0 and "Traceback" not in text, text[-3000:]
        counts.append(tuple(int(x) for x in warm.search(text).groups()))
        if i == 1:  # every program the killed server compiled was read back, not compiled
            stale = [
                k for k in first if (cache / k.replace("-cache", "-atime")).stat().st_mtime < t0
            ]
            assert not stale, stale
    # the first restart read what the killed server compiled and compiled the rest of the
    # warm-up; the second one read every program
    (n1, hits1), (n2, hits2) = counts
    assert 0 < hits1 < n1 and hits2 == n2 == n1, counts
