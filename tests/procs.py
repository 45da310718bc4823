"""What the multi-process tests share: a free loopback port, and waiting on a group of processes
so that one that fails (or hangs) ends the test at once with every process's last output."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

# How the pytest processes compile (tests/conftest.py says why: XLA:CPU's lowest optimisation
# level and its older fusion code generator, or the caller's own XLA_FLAGS level); their
# subprocesses compile as XLA does by default unless a test gives them this.
LEVEL0 = "--xla_backend_optimization_level=0"
QUICK_COMPILE = f"{LEVEL0} --xla_cpu_use_fusion_emitters=false"
pytest_level = QUICK_COMPILE  # set by tests/conftest.py


def compile_like_this_process(env: dict) -> dict:
    """`env` for a subprocess whose numbers a test compares bit for bit with numbers this pytest
    process computes: XLA_FLAGS with this process's optimisation level."""
    return dict(env, XLA_FLAGS=f"{env.get('XLA_FLAGS', '')} {pytest_level}".strip())


def free_port() -> int:
    """A loopback TCP port nothing listens on (the kernel's pick for port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_all(procs: list[subprocess.Popen], timeout: float, logs: list[Path]) -> None:
    """Wait for every process to exit 0. The first that exits non-zero, or the deadline, kills
    the others and fails the test with each log's tail (a process whose peer died would
    otherwise sit in a collective until the deadline, and say nothing). At the deadline the
    processes are first asked for their threads' stacks (SIGUSR1: `cli/common.start_runtime`)."""
    deadline, failed = time.monotonic() + timeout, None
    try:
        while failed is None and any(p.poll() is None for p in procs):
            for i, p in enumerate(procs):
                if p.poll() not in (None, 0):
                    failed = f"process {i} exited with {p.returncode}"
            if failed is None and time.monotonic() > deadline:
                failed = f"still running after {timeout:g} s"
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGUSR1)
                time.sleep(2)
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if failed is None and all(p.returncode == 0 for p in procs):
        return
    tails = "\n".join(f"--- process {i} ({log}):\n{Path(log).read_text()[-3000:]}"
                      for i, log in enumerate(logs))  # fmt: skip
    raise AssertionError(f"{failed or 'a process failed'}\n{tails}")


def train_micro_once(where: Path) -> tuple[Path, str]:
    """The micro preset trained into `where/run` by the first process that asks (the others wait
    on a file lock and read it): (run directory, train.py's output)."""
    import os
    import sys

    from filelock import FileLock

    root = Path(__file__).resolve().parents[1]
    where.mkdir(parents=True, exist_ok=True)
    run, log, done = where / "run", where / "train.log", where / "done"
    with FileLock(str(where / "lock")):
        if not done.exists():
            env = dict(os.environ, TQDM_DISABLE="1", JAX_PLATFORMS="cpu")
            env.pop("XLA_FLAGS", None)  # one device at XLA's default level, like a user's run
            p = subprocess.run(
                [sys.executable, str(root / "train.py"), "--config", "configs/micro.py",
                 "--run-dir", str(run)],
                cwd=root, env=env, capture_output=True, text=True, timeout=1200,
            )  # fmt: skip
            assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
            log.write_text(p.stdout)
            done.touch()
    return run, log.read_text()
