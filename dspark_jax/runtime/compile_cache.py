"""The persistent compilation cache of `train.py` and `serve.py`.

Every stage, evaluation and server start compiles the same programs again (the engine's buckets,
the trainer's steps); on a small machine that is most of a demo evaluation's time (the micro
preset's evaluate stage: 619 s cold, 110 s with a warm cache, same load). JAX keys each entry by
the program, the compiler flags and the backend version, so a cache hit is the same executable. A
cache dir the user already gave JAX (`JAX_COMPILATION_CACHE_DIR`) is kept. Entries are evicted
least-recently-used beyond `MAX_CACHE_BYTES`. The keys include the cache's own path (jax 0.10 puts
`<dir>/xla_gpu_per_fusion_autotune_cache_dir` into the compile options, even on CPU), so a copied
or moved cache directory starts cold; another venv with the same jax/jaxlib hits.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from dspark_jax.runtime import CACHE_ENV, resolve

MAX_CACHE_BYTES = 4 << 30

__all__ = ["CACHE_ENV", "drop_unfinished_entries", "enable_compilation_cache"]


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
    # jax's private cache modules: imported with jax, after the configuration check (as above)
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
        # optional: not our dependency (huggingface_hub brings it); JAX's LRU cache locks with it
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
