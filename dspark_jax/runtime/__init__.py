"""The process's runtime settings: every environment variable dspark-jax reads is read here, once,
and the process-wide set-up `train.py` and `serve.py` give themselves before JAX loads or compiles
(huge pages, below; the persistent compilation cache, `runtime.compile_cache`; XLA:CPU's
per-program options and threefry lowering, `runtime.xla_cpu`; `dspark_jax/cli/common.py` prints
them once).

    DSPARK_HUGEPAGES=off            no re-run with glibc's huge-page tunable (below)
    DSPARK_COMPILATION_CACHE=DIR    the persistent XLA cache's directory; off / 0 / none / "" for
                                    none; unset: $XDG_CACHE_HOME (or ~/.cache)/dspark-jax/xla
    DSPARK_XLA_CPU_TRAINING=off     no per-program XLA:CPU options (xla_cpu.py)
    DSPARK_XLA_CPU_THREEFRY=off     JAX's own rolled threefry lowering on CPU (xla_cpu.py)
    DSPARK_API_KEY=KEY              the HTTP server's key when --api-key is not given
    DSPARK_CACHE=DIR                local copies of remote files, a bucket run's scratch folders
                                    (`local_cache_dir`, read at each call; ~/.cache/dspark_jax)
    XLA_FLAGS, GLIBC_TUNABLES       read to respect the user's own settings
    JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID   multi-process launch (launch.py)

Huge pages. XLA:CPU allocates each call's temporary buffers anew (one training step of the demo's
target takes ~1.4 GB of them) and glibc serves allocations that large with a fresh `mmap`, so
every call page-faults its buffers in again, 4 KiB at a time: the demo's target stage took 11.7
million page faults in 30 steps, a third of its CPU time in the kernel. With the tunable
`glibc.malloc.hugetlb=1`, glibc asks the kernel for transparent huge pages on those mappings
(2 MiB pages, 512 times fewer faults). Measured on the 2-core development machine (alternated
runs, same run directory):

    30 target steps        68.8 s -> 59.3 s   page faults 11.7 M -> 0.2 M, kernel time 29.5 -> 8.3 s
    drafters, 3 x 40 steps 131.1 / 129.9 s -> 115.0 s   kernel time 38.6 -> 12.5 s
    batch-1 decoding       plain and speculative both ~8% faster (their ratio unchanged)

Peak memory was unchanged (2.40 vs 2.43 GB). glibc reads tunables only when a process starts, so
the scripts re-run themselves (`os.execve`, same pid, same arguments) before importing JAX. Only
on Linux with glibc >= 2.35 (where the tunable exists) and transparent huge pages in `madvise` or
`always` mode; never when `GLIBC_TUNABLES` already names the tunable (the user's choice, and the
re-run itself).

Importing this package does not import JAX (its submodules compile_cache and xla_cpu import it
when they are called).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
from collections.abc import Iterator, Mapping
from importlib import metadata
from pathlib import Path

HUGEPAGES_ENV = "DSPARK_HUGEPAGES"
CACHE_ENV = "DSPARK_COMPILATION_CACHE"
XLA_CPU_TRAINING_ENV = "DSPARK_XLA_CPU_TRAINING"
XLA_CPU_THREEFRY_ENV = "DSPARK_XLA_CPU_THREEFRY"
API_KEY_ENV = "DSPARK_API_KEY"
LOCAL_CACHE_ENV = "DSPARK_CACHE"
TUNABLE = "glibc.malloc.hugetlb"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
MIN_GLIBC = (2, 35)
_OFF = ("0", "off", "none", "false")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the environment asks of this process (`read`); nothing else reads it."""

    hugepages: bool  # DSPARK_HUGEPAGES not off
    glibc_tunables: str  # GLIBC_TUNABLES
    compilation_cache: Path | None  # DSPARK_COMPILATION_CACHE (None: off)
    xla_cpu_training: bool  # DSPARK_XLA_CPU_TRAINING not off
    xla_cpu_threefry: bool  # DSPARK_XLA_CPU_THREEFRY not off
    xla_flags: str  # XLA_FLAGS
    coordinator: str  # JAX_COORDINATOR_ADDRESS
    num_processes: str  # JAX_NUM_PROCESSES (parsed by launch.init_distributed)
    process_id: str  # JAX_PROCESS_ID
    api_key: str = dataclasses.field(default="", repr=False)  # DSPARK_API_KEY ("": none)


def _off(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "").strip().lower() in _OFF


def _cache_dir(environ: Mapping[str, str]) -> Path | None:
    v = environ.get(CACHE_ENV)
    if v is None:
        home = os.path.join(os.path.expanduser("~"), ".cache")
        return Path(environ.get("XDG_CACHE_HOME") or home) / "dspark-jax" / "xla"
    if v.strip().lower() in ("", *_OFF):
        return None
    return Path(v).expanduser()


def read(environ: Mapping[str, str]) -> Settings:
    """The settings an environment gives (tests pass their own mapping)."""
    return Settings(
        hugepages=not _off(environ, HUGEPAGES_ENV),
        glibc_tunables=environ.get("GLIBC_TUNABLES", ""),
        compilation_cache=_cache_dir(environ),
        xla_cpu_training=not _off(environ, XLA_CPU_TRAINING_ENV),
        xla_cpu_threefry=not _off(environ, XLA_CPU_THREEFRY_ENV),
        xla_flags=environ.get("XLA_FLAGS", ""),
        coordinator=environ.get("JAX_COORDINATOR_ADDRESS", ""),
        num_processes=environ.get("JAX_NUM_PROCESSES", ""),
        process_id=environ.get("JAX_PROCESS_ID", ""),
        api_key=environ.get(API_KEY_ENV, "").strip(),
    )


@functools.cache
def settings() -> Settings:
    """This process's settings, read from `os.environ` at the first call."""
    return read(os.environ)


def resolve(environ: Mapping[str, str] | None) -> Settings:
    """`settings()`, or those of `environ` when one is given (the helpers' test hook)."""
    return settings() if environ is None else read(environ)


def local_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """$DSPARK_CACHE, default ~/.cache/dspark_jax: local copies of remote files and the scratch
    folders of a bucket run directory. Read at each call, unlike `settings()` (a test, or a
    library user, may point it elsewhere in a running process)."""
    environ = os.environ if environ is None else environ
    return Path(environ.get(LOCAL_CACHE_ENV) or Path.home() / ".cache" / "dspark_jax")


@contextlib.contextmanager
def environ_set(name: str, value: str) -> Iterator[None]:
    """`name=value` in this process's environment for the block, the previous value (or none)
    restored after: for a library that reads its settings from the environment when it is
    imported (`models.hf_tokenizer.quiet_transformers`)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


@functools.cache  # read once: `generate` asks at every batch-1 call
def release(package: str) -> tuple[int, int] | None:
    """(major, minor) of an installed package, None when unknown."""
    try:
        major, minor = metadata.version(package).split(".")[:2]
        return int(major), int(minor)
    except (metadata.PackageNotFoundError, ValueError):
        return None


def describe(cache: Path | None, threefry: bool, s: Settings | None = None) -> str:
    """One line for the start-up log: what this process runs with (`cache`: the compilation
    cache in use; `threefry`: whether the unrolled lowering is in place)."""
    s = settings() if s is None else s
    pages = "on" if TUNABLE in s.glibc_tunables else "off"
    parts = [
        f"huge pages {pages}",
        f"compilation cache {cache or 'off'}",
        "XLA:CPU options " + ("on" if s.xla_cpu_training else "off"),
        "threefry " + ("unrolled" if threefry else "rolled"),
    ]
    if s.xla_flags.strip():
        parts.append(f"XLA_FLAGS={s.xla_flags.strip()}")
    return "runtime: " + ", ".join(parts)


# simulated CPU devices share a few cores: one collective's threads can wait longer than XLA:CPU's
# default 40 s before it aborts the process (seen with 8 devices on 2 loaded cores); the flag
# exists from jaxlib 0.10 on (an unknown XLA_FLAGS entry aborts, so it is given only there)
COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"


def patient_cpu_collectives(environ=None) -> bool:
    """With simulated CPU devices asked for in XLA_FLAGS, give their collectives 15 minutes
    instead of 40 s (unless the user set the timeout). Call before JAX starts a backend."""
    environ = os.environ if environ is None else environ
    flags = environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags or COLLECTIVE_TIMEOUT_FLAG in flags:
        return False
    if (release("jaxlib") or (0, 0)) < (0, 10):
        return False
    environ["XLA_FLAGS"] = f"{flags} {COLLECTIVE_TIMEOUT_FLAG}=900".strip()
    settings.cache_clear()
    return True


# ---------------------------------------------------------------------------------------------
# huge pages


def _glibc() -> tuple[int, int] | None:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, OSError, ValueError):
        return None


def _thp_mode(path: str = THP_MODE) -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), None if unknown."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def hugepage_environ(environ=None, *, platform=None, glibc=None, thp=None) -> dict | None:
    """The environment to re-run the process with, or None where it does not apply (another
    OS or libc, an old glibc, huge pages off, turned off, or the tunable already set)."""
    s = resolve(environ)
    environ = dict(os.environ if environ is None else environ)
    platform = sys.platform if platform is None else platform
    if not s.hugepages or TUNABLE in s.glibc_tunables or not platform.startswith("linux"):
        return None
    glibc = _glibc() if glibc is None else glibc
    if glibc is None or glibc < MIN_GLIBC:
        return None
    if (_thp_mode() if thp is None else thp) not in ("madvise", "always"):
        return None
    prev = s.glibc_tunables
    environ["GLIBC_TUNABLES"] = f"{prev}:{TUNABLE}=1" if prev else f"{TUNABLE}=1"
    return environ


def rerun_with_hugepages() -> None:
    """Replace this process by the same command with the tunable set (returns when it does not
    apply or the re-run cannot start). Call first thing in a script's `__main__`."""
    env = hugepage_environ()
    if env is None or not getattr(sys, "orig_argv", None):
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:
        return
