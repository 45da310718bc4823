"""Where a batch-1 verify forward's time goes on this CPU: XLA's own per-op profile, by kind of op.

    python benchmarks/verify_profile.py [--tokens 1 8] [--cache 256]

The demo's target (configs/tiny.py: 16 layers x 160, vocab 2048, random init; timing does not
depend on the weights) runs `models.packed.packed_forward` over T tokens of one slot as a
speculative round runs it (a single-program engine: in place, `one_set`, `fused`), 32 forwards in a
jitted loop, under `jax.profiler`; every XLA:CPU op (thunk) of the loop body is timed by the
profiler and sorted by what it computes, from the optimized HLO:

  dense       the projections and the MLP (dots with a weight matrix: q|k|v, o, gate|up, down)
  lm_head     the logits ([T, H] x [V, H]^T)
  attention   the score and value products over the cache
  other       everything else (norms, RoPE, softmax, masks, the cache write, copies)

Prints ONE JSON object: per T, `forward_ms` (wall time of one forward in the loop),
`ops_per_forward`, and per kind `ms` (summed op time per forward; ops of one forward can run on
both cores at once, so the kinds can add up to more than the wall time), `ops` and
`us_per_op`; also `dense_gflops` (the dense and LM-head products' arithmetic over their time)
and, for T = 1 and the largest T, `ratio` (forward time, largest T / T = 1).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import platform
import re
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.profiler import ProfileData  # noqa: E402

from dspark_jax.models import transformer as tf  # noqa: E402
from dspark_jax.models.packed import packed_forward  # noqa: E402

LOOP = 32


def _program(tcfg, tparams, t: int, cache_len: int):
    def run(params, cache):
        off = jnp.arange(t, dtype=jnp.int32)

        def body(i, c):
            cache, tok = c
            pos = 64 + (i % 8) * t + off  # stays inside the cache bucket
            o, cache = packed_forward(tcfg, params, tok, jnp.zeros_like(off), off, pos, off >= 0,
                                      cache, cache_len, one_set=True, fused=True)  # fmt: skip
            return cache, jnp.argmax(o.logits[0], -1).astype(jnp.int32)

        return jax.lax.fori_loop(0, LOOP, body, (cache, jnp.zeros((t,), jnp.int32)))

    cache = tf.init_cache(tcfg, 1, cache_len)
    prog = jax.jit(run, donate_argnums=(1,)).lower(tparams, cache).compile()
    return prog, cache


def _kinds(hlo: str, t: int, widths: set[int], vocab: int) -> dict[str, str]:
    """Op (instruction) name -> kind, from the optimized HLO text: a dot (or a fusion around
    one) with a [T, width] result is a dense product ([T, V]: the LM head), any other dot
    attention, the rest `other`."""
    with_dot, comp = set(), None
    for line in hlo.split("\n"):
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if m:
            comp = m.group(1)
        elif comp and re.search(r" dot\(", line):
            with_dot.add(comp)
    out = {}
    for line in hlo.split("\n"):
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \w+\[([\d,]*)\]\S* (\w[\w-]*)\(", line)
        if not m:
            continue
        name, dims, op = m.group(1), [int(x) for x in m.group(2).split(",") if x], m.group(3)
        called = re.search(r"calls=%?([\w.\-]+)", line)
        is_dot = op == "dot" or (called is not None and called.group(1) in with_dot)
        if not is_dot:
            out[name] = "other"
        elif len(dims) == 2 and dims[0] == t and dims[1] == vocab:
            out[name] = "lm_head"
        elif len(dims) == 2 and dims[0] == t and dims[1] in widths:
            out[name] = "dense"
        else:
            out[name] = "attention"
    return out


def profile(tcfg, tparams, t: int, cache_len: int, calls: int = 4) -> dict:
    prog, cache = _program(tcfg, tparams, t, cache_len)
    for _ in range(2):
        cache, _ = jax.block_until_ready(prog(tparams, cache))
    t0 = time.perf_counter()
    for _ in range(calls):
        cache, _ = jax.block_until_ready(prog(tparams, cache))
    wall = (time.perf_counter() - t0) / (calls * LOOP)
    h, f, v = tcfg.hidden_size, tcfg.intermediate_size, tcfg.vocab_size
    d = tcfg.head_dim
    nq, nkv = tcfg.num_heads * d, tcfg.num_kv_heads * d
    widths = {h, f, nq, nkv, nq + 2 * nkv, 2 * f}  # separate and fused (q|k|v, gate|up) products
    kinds = _kinds(prog.as_text(), t, widths, v)
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(calls):
                cache, _ = jax.block_until_ready(prog(tparams, cache))
        data = ProfileData.from_file(glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)[0])
        ns, count = collections.Counter(), collections.Counter()
        for plane in data.planes:
            for line in plane.lines:
                if line.name == "python":
                    continue
                for ev in line.events:
                    kind = kinds.get(ev.name)
                    if kind is not None:
                        ns[kind] += ev.duration_ns
                        count[kind] += 1
    n = calls * LOOP
    proj = h * (tcfg.num_heads + 2 * tcfg.num_kv_heads) * d + tcfg.num_heads * d * h + 3 * h * f
    flops = 2 * t * (tcfg.num_layers * proj + h * v)
    dense_s = (ns["dense"] + ns["lm_head"]) / 1e9 / n
    return {
        "forward_ms": round(wall * 1e3, 3),
        "ops_per_forward": round(sum(count.values()) / n, 1),
        "kinds": {
            k: {
                "ms": round(ns[k] / 1e6 / n, 3),
                "ops": round(count[k] / n, 1),
                "us_per_op": round(ns[k] / 1e3 / max(count[k], 1), 2),
            }
            for k in ("dense", "lm_head", "attention", "other")
        },
        "dense_gflops": round(flops / max(dense_s, 1e-12) / 1e9, 1),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--cache", type=int, default=256)
    args = ap.parse_args()
    if min(args.tokens) < 1:
        sys.exit(f"--tokens {args.tokens}: every token count must be >= 1")
    if args.cache < 64 + 8 * max(args.tokens):
        sys.exit(f"--cache {args.cache} is too small: use at least {64 + 8 * max(args.tokens)}")
    import drafter_step  # the demo's models, shared with the training benchmarks

    _, tcfg, tparams, _ = drafter_step.demo_models()
    res = {str(t): profile(tcfg, tparams, t, args.cache) for t in args.tokens}
    ts = sorted(args.tokens)
    if len(ts) > 1:
        res["ratio"] = round(res[str(ts[-1])]["forward_ms"] / res[str(ts[0])]["forward_ms"], 2)
    res["cache"] = args.cache
    res["platform"] = f"{platform.machine()} {jax.default_backend()} x{os.cpu_count()}"
    print(json.dumps(res))


if __name__ == "__main__":
    main()
