"""`dspark_jax.runtime`'s huge pages: when the scripts re-run themselves with glibc's huge-page tunable, that
the re-run happens once with the same arguments, and that it takes the page faults out of a
program whose temporary buffers are large (what it is for)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_jax import runtime as hp

ROOT = Path(__file__).resolve().parents[1]
LINUX = dict(platform="linux", glibc=(2, 36), thp="madvise")


def test_environ_adds_the_tunable_where_it_applies():
    env = hp.hugepage_environ({"PATH": "/bin"}, **LINUX)
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    env = hp.hugepage_environ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, **LINUX)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert hp.hugepage_environ({}, **{**LINUX, "thp": "always"}) is not None


@pytest.mark.parametrize(
    "environ, overrides",
    [
        ({"DSPARK_HUGEPAGES": "off"}, {}),
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, {}),  # the user's own choice
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, {}),  # the re-run itself
        ({}, {"platform": "darwin"}),
        ({}, {"glibc": (2, 31)}),  # the tunable does not exist there
        ({}, {"thp": "never"}),
        ({}, {"thp": ""}),  # mode unknown (no sysfs file)
    ],
)
def test_environ_leaves_the_process_alone_otherwise(environ, overrides):
    assert hp.hugepage_environ(environ, **{**LINUX, **overrides}) is None


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, "arg1", "--flag"],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )  # fmt: skip


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hp.HUGEPAGES_ENV)}
    env["PYTHONPATH"] = str(ROOT)
    return {**env, **extra}


needs_hugepages = pytest.mark.skipif(
    hp.hugepage_environ(_clean_env()) is None, reason="no glibc >= 2.35 with THP here"
)


@needs_hugepages
def test_rerun_happens_once_with_the_same_arguments():
    code = (
        "import os, sys\n"
        "print('start', os.getpid(), flush=True)\n"
        "from dspark_jax.runtime import rerun_with_hugepages\n"
        "rerun_with_hugepages()\n"
        "print('args', sys.argv[1:], os.environ['GLIBC_TUNABLES'], os.getpid())\n"
    )
    out = _run(code, _clean_env())
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    starts = [ln for ln in lines if ln.startswith("start")]
    assert len(starts) == 2 and len(set(starts)) == 1, lines  # re-run once, same process
    pid = starts[0].split()[1]
    assert lines[-1] == f"args ['arg1', '--flag'] glibc.malloc.hugetlb=1 {pid}", lines
    off = _run(code, _clean_env(DSPARK_HUGEPAGES="off"))
    assert [ln.split()[0] for ln in off.stdout.splitlines()][:1] == ["start"]
    assert off.stdout.count("start") == 1


FAULTS = (
    "import resource, jax, jax.numpy as jnp\n"
    "from dspark_jax.runtime import rerun_with_hugepages\n"
    "rerun_with_hugepages()\n"
    "@jax.jit\n"
    "def f(x):  # ~200 MB of temporaries per call\n"
    "    y = jnp.outer(x, x)\n"
    "    return (jnp.exp(y) * jnp.sin(y)).sum(0) + jnp.tanh(y).sum(1)\n"
    "x = jnp.linspace(0, 1, 4096)\n"
    "f(x).block_until_ready()\n"
    "f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
    "for _ in range(5):\n"
    "    f(x).block_until_ready()\n"
    "print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) // 5)\n"
)


@needs_hugepages
def test_huge_pages_take_the_page_faults_out_of_large_temporaries():
    env = _clean_env(JAX_PLATFORMS="cpu", DSPARK_COMPILATION_CACHE="off")
    on = _run(FAULTS, env)
    off = _run(FAULTS, {**env, hp.HUGEPAGES_ENV: "off"})
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    faults_on, faults_off = int(on.stdout.split()[-1]), int(off.stdout.split()[-1])
    # 4 KiB pages: tens of thousands of faults per call; huge pages: a few hundred
    assert faults_off > 10_000, (faults_on, faults_off)
    assert faults_on < faults_off / 5, (faults_on, faults_off)
