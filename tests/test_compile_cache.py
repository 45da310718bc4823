"""The persistent compilation cache of train.py / serve.py: where it goes, how to turn it off,
and that a second process reads back what the first one wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dspark_jax import runtime
from dspark_jax.runtime import CACHE_ENV as ENV
from dspark_jax.runtime import compile_cache

CHILD = """
import time, jax, jax.numpy as jnp
from dspark_jax.runtime.compile_cache import enable_compilation_cache
print(enable_compilation_cache())
hits = []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name))
x = jnp.ones((8, 8))
jax.jit(lambda a: jnp.tanh(a @ a.T).sum())(x).block_until_ready()
print(sum("cache_hits" in h for h in hits))
"""


def test_cache_dir_from_the_environment(tmp_path):
    def cache_dir(**env):
        return runtime.read(env).compilation_cache

    assert cache_dir(XDG_CACHE_HOME=str(tmp_path)) == tmp_path / "dspark-jax" / "xla"
    for off in ("off", "0", "none", ""):
        assert cache_dir(XDG_CACHE_HOME=str(tmp_path), **{ENV: off}) is None
    assert cache_dir(**{ENV: str(tmp_path / "mine")}) == tmp_path / "mine"


def test_a_second_process_reads_the_cache(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{ENV: str(tmp_path / "xla")})
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    runs = [
        subprocess.run(
            [sys.executable, "-c", CHILD],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout.split()  # fmt: skip
        for _ in range(2)
    ]
    assert Path(runs[0][0]) == tmp_path / "xla" and any((tmp_path / "xla").iterdir())
    assert runs[0][1] == "0" and int(runs[1][1]) >= 1  # the second process hit the cache


def test_an_entry_cut_short_by_a_kill_is_dropped_and_written_again(tmp_path):
    """A process killed while JAX wrote a cache entry leaves it truncated and without its
    `-atime` file; JAX never overwrites an entry, so it would fail to load on every start. The
    next start drops it (`compile_cache.drop_unfinished_entries`), compiles and writes it whole; the
    start after that reads it."""
    cache = tmp_path / "xla"
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{ENV: str(cache)})
    env.pop("JAX_COMPILATION_CACHE_DIR", None)

    def run():
        out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                             text=True, timeout=120, check=True)  # fmt: skip
        return int(out.stdout.split()[1]), out.stderr

    assert run()[0] == 0
    entries = sorted(cache.glob("*-cache"))
    assert entries
    for e in entries:  # what a kill mid-write leaves: half the bytes, no -atime
        e.write_bytes(e.read_bytes()[: e.stat().st_size // 2])
        (cache / (e.name[: -len("-cache")] + "-atime")).unlink()
    hits, err = run()
    assert hits == 0 and "Error" not in err  # dropped at start, not read
    assert run()[0] >= 1


def test_the_cache_sizes_its_directory_rarely_and_still_evicts(tmp_path, monkeypatch):
    """JAX's LRU cache sized its whole directory before every write (1.15 s per compilation at
    5,364 entries: CI's cache after its pytest groups; a Gemma 4 test file ran 264 s with such a
    cache, 27 s with this). The cache JAX builds after `enable_compilation_cache` sizes it on
    its first write and again once its writes since reach 1/16 of the limit, and still evicts
    the least recently used entries past the limit."""
    from jax._src import compilation_cache, lru_cache

    compile_cache._scan_for_eviction_rarely()
    cls = compilation_cache.LRUCache
    assert issubclass(cls, lru_cache.LRUCache) and cls is not lru_cache.LRUCache
    scans = []
    scan = lru_cache.LRUCache._evict_if_needed

    def counted(self, **kw):
        scans.append(len(list(tmp_path.glob("*-cache"))))
        return scan(self, **kw)

    monkeypatch.setattr(lru_cache.LRUCache, "_evict_if_needed", counted)
    cache = cls(str(tmp_path), max_size=16 * 1000)  # sized again after 1000 bytes written
    for i in range(20):
        cache.put(f"k{i}", bytes(100))
    assert scans == [0, 9, 18]  # the 1st write, then the 10th and the 19th (1000 bytes since)
    small = tmp_path / "small"
    cache = cls(str(small), max_size=16 * 250)  # sized every third write
    for i in range(60):
        cache.put(f"k{i}", bytes(100))
    kept = sorted(int(p.name[1 : -len("-cache")]) for p in small.glob("*-cache"))
    # 40 entries fit the limit, up to 2 more the writes since the last sizing; the oldest went
    assert 40 <= len(kept) <= 42 and kept == list(range(60 - len(kept), 60))
