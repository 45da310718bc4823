"""A persistent XLA compilation cache for `train.py` and `serve.py`.

Every stage, evaluation and server start compiles the same programs again (the engine's buckets,
the trainer's steps); on a small machine that is most of a demo evaluation's time (the micro
preset's evaluate stage: 619 s cold, 110 s with a warm cache, same load). JAX keys each entry by
the program, the compiler flags and the backend version, so a cache hit is the same executable.

    DSPARK_COMPILATION_CACHE unset   ~/.cache/dspark-jax/xla (or $XDG_CACHE_HOME/dspark-jax/xla)
    DSPARK_COMPILATION_CACHE=DIR     that directory
    DSPARK_COMPILATION_CACHE=off     no persistent cache (also "0", "none", "")

A cache dir the user already gave JAX (`JAX_COMPILATION_CACHE_DIR`) is kept. Entries are evicted
least-recently-used beyond `MAX_BYTES`. The keys include the cache's own path (jax 0.10 puts
`<dir>/xla_gpu_per_fusion_autotune_cache_dir` into the compile options, even on CPU), so a copied
or moved cache directory starts cold; another venv with the same jax/jaxlib hits.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "DSPARK_COMPILATION_CACHE"
MAX_BYTES = 4 << 30


def cache_dir() -> Path | None:
    """The directory the cache goes to, or None when it is turned off."""
    v = os.environ.get(ENV)
    if v is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "dspark-jax" / "xla"
    if v.strip().lower() in ("", "0", "off", "none", "false"):
        return None
    return Path(v).expanduser()


def enable_compilation_cache() -> Path | None:
    """Turn the persistent cache on (before the first compilation); returns its directory."""
    import jax

    if jax.config.jax_compilation_cache_dir:  # the user configured JAX's own cache
        return Path(jax.config.jax_compilation_cache_dir)
    d = cache_dir()
    if d is None:
        return None
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # a read-only home: run without the cache rather than fail
    jax.config.update("jax_compilation_cache_dir", str(d))
    # small models compile in well under the default 1 s threshold, and those are the programs
    # a CPU run recompiles most
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return d
