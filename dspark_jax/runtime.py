"""The process's runtime settings: every environment variable dspark-jax reads is read here, once,
and the process-wide set-up `train.py` and `serve.py` give themselves before JAX loads or compiles
(huge pages, the persistent compilation cache; `dspark_jax/cli/common.py` prints them once).

    DSPARK_HUGEPAGES=off            no re-run with glibc's huge-page tunable (below)
    DSPARK_COMPILATION_CACHE=DIR    the persistent XLA cache's directory; off / 0 / none / "" for
                                    none; unset: $XDG_CACHE_HOME (or ~/.cache)/dspark-jax/xla
    DSPARK_XLA_CPU_TRAINING=off     no per-program XLA:CPU options (dspark_jax/xla_cpu.py)
    DSPARK_XLA_CPU_THREEFRY=off     JAX's own rolled threefry lowering on CPU (xla_cpu.py)
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

Compilation cache. Every stage, evaluation and server start compiles the same programs again
(the engine's buckets, the trainer's steps); on a small machine that is most of a demo
evaluation's time (the micro preset's evaluate stage: 619 s cold, 110 s with a warm cache, same
load). JAX keys each entry by the program, the compiler flags and the backend version, so a cache
hit is the same executable. A cache dir the user already gave JAX (`JAX_COMPILATION_CACHE_DIR`)
is kept. Entries are evicted least-recently-used beyond `MAX_CACHE_BYTES`. The keys include the
cache's own path (jax 0.10 puts `<dir>/xla_gpu_per_fusion_autotune_cache_dir` into the compile
options, even on CPU), so a copied or moved cache directory starts cold; another venv with the
same jax/jaxlib hits.

Importing this module does not import JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

HUGEPAGES_ENV = "DSPARK_HUGEPAGES"
CACHE_ENV = "DSPARK_COMPILATION_CACHE"
XLA_CPU_TRAINING_ENV = "DSPARK_XLA_CPU_TRAINING"
XLA_CPU_THREEFRY_ENV = "DSPARK_XLA_CPU_THREEFRY"
API_KEY_ENV = "DSPARK_API_KEY"
TUNABLE = "glibc.malloc.hugetlb"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
MIN_GLIBC = (2, 35)
MAX_CACHE_BYTES = 4 << 30
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


# ---------------------------------------------------------------------------------------------
# the persistent compilation cache


def enable_compilation_cache(environ: Mapping[str, str] | None = None) -> Path | None:
    """Turn the persistent cache on (before the first compilation); returns its directory."""
    import jax  # here: importing this module must not load jax (train.py's config check)

    if jax.config.jax_compilation_cache_dir:  # the user configured JAX's own cache
        return Path(jax.config.jax_compilation_cache_dir)
    d = resolve(environ).compilation_cache
    if d is None:
        return None
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # a read-only home: run without the cache rather than fail
    drop_unfinished_entries(d)
    jax.config.update("jax_compilation_cache_dir", str(d))
    # small models compile in well under the default 1 s threshold, and those are the programs
    # a CPU run recompiles most
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_compilation_cache_max_size", MAX_CACHE_BYTES)
    _scan_for_eviction_rarely()
    return d


def _scan_for_eviction_rarely() -> None:
    """JAX's LRU cache (0.10) sizes its whole directory before every write it makes (a stat and
    a read of every entry, under the directory's lock that every process using the cache
    shares): 1.15 s per compilation in a cache of 5,364 programs, as CI's was after its pytest
    groups, while the other processes queued on the lock. The subclass below sizes the
    directory on a process's first write, then again only once that process's writes since add
    up to 1/16 of the limit (the cache can run past its limit by that much per writing process
    meanwhile). Entries, access times, the lock and the eviction order stay JAX's own; a JAX
    without that class is left alone."""
    from jax._src import compilation_cache, lru_cache

    base = getattr(lru_cache, "LRUCache", None)
    if compilation_cache.LRUCache is not base or not hasattr(base, "_evict_if_needed"):
        return  # another JAX, or done already

    class RarelyScanningLRUCache(base):
        _since_scan: int | None = None  # bytes this process wrote since it last sized the cache

        def _evict_if_needed(self, *, additional_size: int = 0) -> None:
            since = self._since_scan
            if self.eviction_enabled and since is not None:
                if since + additional_size < self.max_size // 16:
                    self._since_scan = since + additional_size
                    return
            super()._evict_if_needed(additional_size=additional_size)
            self._since_scan = additional_size

    compilation_cache.LRUCache = RarelyScanningLRUCache


_ENTRY, _ATIME = "-cache", "-atime"  # JAX's LRU cache: <key>-cache, then <key>-atime


def drop_unfinished_entries(d: Path) -> list[str]:
    """Delete the cache entries whose write was interrupted (a process killed while writing it);
    returns their keys. JAX's LRU cache (on whenever a size limit is set, as here) writes an
    entry's `-cache` file, then its `-atime` file, under its directory's lock, and never
    overwrites an entry: a truncated one would fail to load, warn and be recompiled on every
    start. An entry without its `-atime` file is such an interrupted write; JAX's own lock is
    held while looking, so no live writer is caught halfway."""
    try:
        import filelock

        lock = filelock.FileLock(str(d / ".lockfile"))
        lock.acquire(timeout=10)
    except Exception:  # noqa: BLE001 (no filelock, a lock we cannot take: leave the cache be)
        return []
    try:
        names = {p.name for p in d.iterdir()}
        dropped = [n[: -len(_ENTRY)] for n in names
                   if n.endswith(_ENTRY) and n[: -len(_ENTRY)] + _ATIME not in names]  # fmt: skip
        for key in dropped:
            (d / (key + _ENTRY)).unlink(missing_ok=True)
        return dropped
    except OSError:
        return []
    finally:
        lock.release()
