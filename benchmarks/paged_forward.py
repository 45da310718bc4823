"""The paged verify forward against today's dense packed one, same workload, one run.

N requests, each with a context of S positions, verify G new tokens each (a flat bucket of
N x G tokens). Dense: `packed.packed_forward` over an [N, S + G] cache (slot-major, its
cache-in-place layout). Paged: `paged.paged_forward` over a pool of pages of `--page` positions,
each request's pages interleaved at random, token-major and request-major (`q_per_req=G`).
Every program donates its cache (the engine's setting) and is timed jitted, minimum over
interleaved repetitions; the logits of all three are compared.

    python benchmarks/paged_forward.py [--points 8:256:5,32:1024:8] [--page 16] [--reps 5]

Prints ONE JSON object: `points` (requests, context, tokens_per_request, dense_ms,
paged_token_major_ms, paged_request_major_ms, max_abs_diff), `platform`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dspark_jax.models import packed, paged  # noqa: E402
from dspark_jax.models import transformer as tf  # noqa: E402
from dspark_jax.testing import random_params, small_target_config  # noqa: E402


def _programs(cfg, n, s, g):
    def dense(params, cache, toks, slot, off):
        pos = cache.lengths[slot] + off
        out, cache = packed.packed_forward(cfg, params, toks, slot, off, pos, off >= 0, cache,
                                           s + g, slot_tokens=g, one_set=True)  # fmt: skip
        return out.logits, cache

    def paged_fn(q_per_req):
        def fwd(params, cache, toks, cu, kv, tables):
            out, cache = paged.paged_forward(cfg, params, toks, cu, kv, tables, cache,
                                             q_per_req=q_per_req)  # fmt: skip
            return out.logits, cache

        return jax.jit(fwd, donate_argnums=(1,))

    return jax.jit(dense, donate_argnums=(1,)), paged_fn(0), paged_fn(g)


def _point(cfg, params, n, s, g, page, reps, rng):
    b = -(-(s + g) // page)
    pool_pages = n * b + 8
    toks = jnp.asarray(rng.integers(0, cfg.vocab_size, n * g), jnp.int32)
    slot = jnp.asarray(np.repeat(np.arange(n), g), jnp.int32)
    off = jnp.asarray(np.tile(np.arange(g), n), jnp.int32)
    cu = jnp.asarray(np.arange(n + 1) * g, jnp.int32)
    kv = jnp.full((n,), s + g, jnp.int32)
    tables = jnp.asarray(rng.permutation(pool_pages)[: n * b].reshape(n, b), jnp.int32)
    dense, tok_major, req_major = _programs(cfg, n, s, g)
    # the same random context in both caches: contiguous per request, and its pages
    ctx = [rng.normal(size=(n, cfg.num_kv_heads, s + g, cfg.head_dim)).astype(np.float32) * 0.5
           for _ in range(2 * cfg.num_layers)]  # fmt: skip
    d_cache = tf.KVCache(tuple(map(jnp.asarray, ctx[::2])), tuple(map(jnp.asarray, ctx[1::2])),
                         jnp.full((n,), s, jnp.int32))  # fmt: skip

    def to_pages(x):
        pool = np.zeros((pool_pages, page, cfg.num_kv_heads, cfg.head_dim), np.float32)
        xp = np.zeros((n, cfg.num_kv_heads, b * page, cfg.head_dim), np.float32)
        xp[:, :, : s + g] = x
        pool[np.asarray(tables)] = xp.transpose(0, 2, 1, 3).reshape(n, b, page, *pool.shape[2:])
        return jnp.asarray(pool)

    caches = {"dense": d_cache}
    for name in ("tok", "req"):
        caches[name] = paged.PagedKVCache(tuple(map(to_pages, ctx[::2])),
                                          tuple(map(to_pages, ctx[1::2])))  # fmt: skip
    progs = {
        "dense": lambda c: dense(params, c, toks, slot, off),
        "tok": lambda c: tok_major(params, c, toks, cu, kv, tables),
        "req": lambda c: req_major(params, c, toks, cu, kv, tables),
    }
    logits = {}
    for k, p in progs.items():
        logits[k], caches[k] = jax.block_until_ready(p(caches[k]))
    times = {k: [] for k in progs}
    for _ in range(reps):
        for k, p in progs.items():
            t0 = time.perf_counter()
            for _ in range(5):
                _, caches[k] = p(caches[k])
            jax.block_until_ready(caches[k])
            times[k].append((time.perf_counter() - t0) / 5 * 1e3)
    diff = max(float(jnp.abs(logits[k] - logits["dense"]).max()) for k in ("tok", "req"))
    return dict(
        requests=n, context=s, tokens_per_request=g,
        dense_ms=round(min(times["dense"]), 3),
        paged_token_major_ms=round(min(times["tok"]), 3),
        paged_request_major_ms=round(min(times["req"]), 3),
        max_abs_diff=diff,
    )  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", default="8:256:5", help="N:S:G,... requests:context:tokens")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    cfg = small_target_config()
    params = random_params(cfg, 0)
    rng = np.random.default_rng(0)
    points = []
    for spec in args.points.split(","):
        n, s, g = (int(x) for x in spec.split(":"))
        points.append(_point(cfg, params, n, s, g, args.page, args.reps, rng))
        print(points[-1], file=sys.stderr, flush=True)
    print(json.dumps(dict(
        points=points, page=args.page,
        platform=f"{platform.machine()} {jax.default_backend()} x{os.cpu_count()}",
    )))  # fmt: skip


if __name__ == "__main__":
    main()
