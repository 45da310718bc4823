"""Test session setup: 8 simulated CPU devices (must happen before jax initialises a backend)."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# the simulated devices' collectives wait for each other's threads: on 2 loaded cores that can
# take longer than XLA:CPU's default 40 s, after which it aborts the process
if "collective_call_terminate_timeout" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_collective_call_terminate_timeout_seconds=900"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Compiling is most of the suite's time (1581 of 2524 s of the fast tier's test time, cold), so
# the pytest processes compile at XLA:CPU's lowest optimisation level (compiling 30-45% shorter,
# the programs ~40% slower, docs/MEASUREMENTS.md) and with its older fusion code generator
# (`--xla_cpu_use_fusion_emitters=false`: an engine's programs compile in ~55% of the time, and
# three engine / drafter files ran in 250 s instead of 351 s). Only these processes: XLA reads
# XLA_FLAGS once, when the backend starts below, and the flags then leave the environment, so
# the train.py / serve.py subprocesses the tests start compile as XLA does by default, as a
# user's run and CI's first step do (some tests compare with that run bit for bit, and read its
# compiled programs from the persistent cache). A caller's own XLA_FLAGS level is left alone
# (and given to the subprocesses of tests/procs.py's compile_like_this_process).
import re  # noqa: E402

from tests import procs  # noqa: E402

_caller = re.search(r"--xla_backend_optimization_level=\S+", os.environ["XLA_FLAGS"])
_own_level = _caller is None
if _own_level:
    os.environ["XLA_FLAGS"] += " " + procs.QUICK_COMPILE
else:
    procs.pytest_level = _caller.group(0)

# One persistent compilation cache for the whole test run, cold at its start: the pytest-xdist
# workers and the train.py / serve.py subprocesses the tests start compile many of the same
# programs (the micro pipeline's stages run in a dozen tests). The first process to import this
# file (pytest's own, before its workers start) names a new directory; the others inherit it, and
# pytest_unconfigure below deletes it. A caller's DSPARK_COMPILATION_CACHE (CI's, or `off`) wins.
import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from dspark_jax.runtime import CACHE_ENV  # noqa: E402

_RUN_CACHE = "DSPARK_TEST_RUN_CACHE"
_own_cache = not os.environ.get(CACHE_ENV) and not os.environ.get(_RUN_CACHE)
if _own_cache:
    os.environ[_RUN_CACHE] = tempfile.mkdtemp(prefix="dspark-tests-xla-")
if not os.environ.get(CACHE_ENV):
    os.environ[CACHE_ENV] = os.environ[_RUN_CACHE]

import jax  # noqa: E402

from dspark_jax.runtime.compile_cache import enable_compilation_cache  # noqa: E402

jax.devices()  # the backend starts and reads XLA_FLAGS (once per process)
enable_compilation_cache()  # before any test compiles (the run's own, the caller's, or off)
if _own_level:
    os.environ["XLA_FLAGS"] = os.environ["XLA_FLAGS"].replace(" " + procs.QUICK_COMPILE, "")

# Property tests draw a fixed example sequence: CI is reproducible and a failure can be replayed.
from hypothesis import settings  # noqa: E402

settings.register_profile("dspark", derandomize=True, database=None)
settings.load_profile("dspark")

import pytest  # noqa: E402


def _mapped_regions() -> int | None:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return None


def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs_near_the_map_limit():
    """Every compiled XLA:CPU program holds memory mappings (~6 for a small one) until its jit
    cache entry goes, and the whole suite in one process compiles thousands: a pytest process
    that reached the kernel's `vm.max_map_count` died inside an XLA compilation (segfault). After
    each test module past half the limit, the compiled programs are dropped (`jax.clear_caches`;
    later tests recompile what they need). The e-l test files in one process: 15368, 17790, 24151,
    31178, 46370 mapped regions after the first five modules, a segfault in test_lossless without
    this, 143 passed with it."""
    yield
    n = _mapped_regions()
    if n is not None and n > _map_limit() // 2:
        import jax

        jax.clear_caches()


_XLA = {"compile_s": 0.0, "compilations": 0, "from_cache": 0}


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache_and_tally():
    """A tally of the session's compilations for its summary line."""
    from jax import monitoring

    from dspark_jax.engine.compiles import CACHE_HIT_EVENT, COMPILE_EVENT

    def duration(event, duration_secs=None, **kw):
        if event == COMPILE_EVENT:
            _XLA["compile_s"] += duration_secs or 0.0
            _XLA["compilations"] += 1

    def hit(event, **kw):
        if event == CACHE_HIT_EVENT:
            _XLA["from_cache"] += 1

    monitoring.register_event_duration_secs_listener(duration)
    monitoring.register_event_listener(hit)
    yield


def pytest_unconfigure(config):
    if _own_cache and not hasattr(config, "workerinput"):  # pytest's own process, last out
        shutil.rmtree(os.environ[_RUN_CACHE], ignore_errors=True)


# A test marked `bitwise` compares the numbers of two programs bit for bit (K rounds per call
# against one, a resumed run against an uninterrupted one). That holds under XLA:CPU's default
# fusion code generator, which users run, and not under the older one these processes compile
# with, whose fusions reassociate differently in the two programs. Such a test runs in a child
# pytest process that compiles at level 0 with the default code generator.
_BITWISE_CHILD = "DSPARK_TEST_BITWISE_CHILD"


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker("bitwise") is None or os.environ.get(_BITWISE_CHILD):
        return None
    if procs.pytest_level != procs.QUICK_COMPILE:
        return None  # the caller's own XLA_FLAGS: run here
    import subprocess
    import sys

    flags = f"{os.environ['XLA_FLAGS']} {procs.LEVEL0}"  # a caller's level: the default emitters
    env = dict(os.environ, XLA_FLAGS=flags, **{_BITWISE_CHILD: "1"})
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    root = Path(__file__).resolve().parents[1]
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
            pyfuncitem.nodeid]  # fmt: skip
    r = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        out = (r.stdout + r.stderr)[-6000:]
        raise AssertionError(f"in a child pytest (default code generator):\n{out}")
    return True


# Compiling per test file (a test's setup, call and teardown, its module fixtures included),
# summed over the pytest-xdist workers: where the suite's compile time goes.
_PER_FILE: dict[str, list] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    n0, s0 = _XLA["compilations"], _XLA["compile_s"]
    yield
    row = _PER_FILE.setdefault(item.location[0], [0, 0.0])
    row[0] += _XLA["compilations"] - n0
    row[1] += _XLA["compile_s"] - s0


def pytest_sessionfinish(session):
    out = getattr(session.config, "workeroutput", None)
    if out is not None:  # a pytest-xdist worker: its tallies go to pytest's own process
        out["dspark_xla"] = dict(_XLA)
        out["dspark_xla_files"] = {k: list(v) for k, v in _PER_FILE.items()}


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent with -p no:xdist
def pytest_testnodedown(node, error):
    out = getattr(node, "workeroutput", {})
    for k, v in out.get("dspark_xla", {}).items():
        _XLA[k] += v
    for f, (n, sec) in out.get("dspark_xla_files", {}).items():
        row = _PER_FILE.setdefault(f, [0, 0.0])
        row[0] += n
        row[1] += sec


def pytest_terminal_summary(terminalreporter):
    import jax

    where = jax.config.jax_compilation_cache_dir or "off"
    terminalreporter.write_line(
        f"XLA: {_XLA['compilations']} compilations ({_XLA['from_cache']} read from the "
        f"compilation cache: {where}), {_XLA['compile_s']:.0f} s compiling"
    )
    top = sorted(_PER_FILE.items(), key=lambda kv: -kv[1][1])[:15]
    if top:
        terminalreporter.write_line("XLA compiling by test file (the 15 longest):")
        for f, (n, sec) in top:
            terminalreporter.write_line(f"  {sec:7.1f} s  {n:5d} programs  {f}")


@pytest.fixture(scope="session")
def micro_run(tmp_path_factory) -> tuple:
    """(run directory, train.py's output) of the micro preset from an empty run directory: the
    one end-to-end run every test that needs a trained run reads (copy it before changing it).
    CI's first step has already trained it in a brand-new venv (`.ci/run` names it in
    DSPARK_TEST_MICRO_RUN / DSPARK_TEST_MICRO_LOG); otherwise the first pytest worker that asks
    trains it and the others (pytest-xdist) wait for it under a file lock."""
    from tests.procs import train_micro_once

    given, log = os.environ.get("DSPARK_TEST_MICRO_RUN"), os.environ.get("DSPARK_TEST_MICRO_LOG")
    if given and log:
        from pathlib import Path

        return Path(given), Path(log).read_text()
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker's base is a folder of one root
        shared = shared.parent
    return train_micro_once(shared / "micro-shared")
