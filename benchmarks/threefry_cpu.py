"""JAX's threefry on XLA:CPU: its default rolled lowering against the unrolled one, in one run.

`dspark_jax.xla_cpu.unrolled_threefry` lowers the hash behind every `jax.random` draw as
straight-line code on CPU (JAX's lowering on the other backends) instead of a rolled 5-iteration
loop of small array ops. Each program below is compiled twice in this process, first with JAX's
CPU default (``rolled``), then, after `jax.clear_caches()` and `unrolled_threefry()`, again
(``unrolled``); the two are timed interleaved, medians of ``--reps``:

  noise_v         one Gumbel draw over the demo's 2048-token vocabulary (what every sampled
                  token pays: `spec.sampling.sample_from_logits`), 64 per call;
  noise_7xv       the drafter's noise for γ = 7 slots (`spec.sampling.gumbel_noise`), 64 per call;
  decode_b1       32 sampled decode steps (T = 1, untruncated) of the demo's target at batch 1,
                  compiled as `generate` compiles batch 1 (`xla_cpu.batch1_decode_compiler_options`);
  decode_b32      the same at batch 32 (regeneration, evaluation; XLA's default options).

Prints ONE JSON object: ``<name>_us`` (per draw) / ``<name>_ms`` (per call) and
``rolled_<name>_...`` for each, ``speedup`` (rolled / unrolled), ``compile_s`` and
``rolled_compile_s`` (the two decode programs together), ``tokens_equal`` and ``noise_equal``
(the draws bit for bit the same), ``reps``, ``platform``.

    python benchmarks/threefry_cpu.py [--reps 9]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dspark_jax import xla_cpu  # noqa: E402
from dspark_jax.models import generate as gen  # noqa: E402
from dspark_jax.models import transformer as tf  # noqa: E402
from dspark_jax.spec import sampling as S  # noqa: E402

LOOP, STEPS, CACHE, GAMMA = 64, 32, 256, 7


def _programs(tcfg, tparams):
    """name -> (compiled program, its arguments, compile seconds)."""
    v = tcfg.vocab_size
    out = {}

    def noise_loop(shape):
        def run(key):
            def body(i, acc):
                keys = jax.random.split(jax.random.fold_in(key, i), shape[0])
                return acc + S.gumbel_noise(keys, shape[1])

            return jax.lax.fori_loop(0, LOOP, body, jnp.zeros(shape))

        return run

    key = jax.random.key(0)
    for name, shape in (("noise_v", (1, v)), ("noise_7xv", (GAMMA, v))):
        t0 = time.perf_counter()
        prog = jax.jit(noise_loop(shape)).lower(key).compile()
        out[name] = (prog, (key,), time.perf_counter() - t0)

    scfg = S.SamplingConfig()

    def decode(params, cache, tok, key):
        b = tok.shape[0]
        seeds = jnp.arange(b, dtype=jnp.int32)
        sp = S.SamplingParams(jnp.ones((b,)), jnp.zeros((b,), jnp.int32), jnp.ones((b,)),
                              jnp.zeros((b,)))  # fmt: skip

        def body(i, c):
            cache, tok, toks = c
            o, cache = gen.extend(tcfg, params, tok, cache)
            nxt = gen.sample_tokens(o.logits[:, -1], key, seeds, cache.lengths + 1, sp, scfg)
            toks = toks.at[:, i].set(nxt)
            return cache.with_lengths(cache.lengths + 1), nxt[:, None], toks

        init = (cache, tok, jnp.zeros((b, STEPS), jnp.int32))
        return jax.lax.fori_loop(0, STEPS, body, init)[2]

    rng = np.random.default_rng(0)
    for name, b, options in (
        ("decode_b1", 1, xla_cpu.batch1_decode_compiler_options()),
        ("decode_b32", 32, None),
    ):
        cache = tf.init_cache(tcfg, b, CACHE).with_lengths(jnp.full((b,), 100, jnp.int32))
        tok = jnp.asarray(rng.integers(5, tcfg.vocab_size, (b, 1)), jnp.int32)
        t0 = time.perf_counter()
        prog = jax.jit(decode).lower(tparams, cache, tok, key).compile(options)
        out[name] = (prog, (tparams, cache, tok, key), time.perf_counter() - t0)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    if args.reps < 1:
        sys.exit(f"--reps {args.reps}: must be >= 1")
    if xla_cpu._release("jax") not in xla_cpu.THREEFRY_CHECKED_JAX:
        sys.exit(f"jax {jax.__version__}: the unrolled lowering is only given on jax "
                 f"{xla_cpu.THREEFRY_CHECKED_JAX}; nothing to compare")  # fmt: skip
    if xla_cpu.switched_off(xla_cpu.THREEFRY_ENV):
        sys.exit(f"{xla_cpu.THREEFRY_ENV} turns the unrolled lowering off; unset it to compare")
    import drafter_step  # the demo's models, shared with the training benchmarks

    _, tcfg, tparams, _ = drafter_step.demo_models()
    rolled = _programs(tcfg, tparams)
    jax.clear_caches()
    if not xla_cpu.unrolled_threefry():
        sys.exit(f"the unrolled lowering is off ({xla_cpu.THREEFRY_ENV} set?); nothing to compare")
    unrolled = _programs(tcfg, tparams)
    outs = {}
    times = {(k, name): [] for k in ("rolled", "unrolled") for name in rolled}
    for rep in range(args.reps + 1):  # the first pass warms up
        for name in rolled:
            for kind, progs in (("rolled", rolled), ("unrolled", unrolled))[:: 1 - 2 * (rep % 2)]:
                prog, a, _ = progs[name]
                t0 = time.perf_counter()
                o = jax.block_until_ready(prog(*a))
                if rep:
                    times[(kind, name)].append(time.perf_counter() - t0)
                outs[(kind, name)] = np.asarray(o)
    res = {}
    for name in rolled:
        for kind, prefix in (("unrolled", ""), ("rolled", "rolled_")):
            t = statistics.median(times[(kind, name)])
            if name.startswith("noise"):
                res[f"{prefix}{name}_us"] = round(t / LOOP * 1e6, 2)
            else:
                res[f"{prefix}{name}_ms"] = round(t * 1e3, 3)
    res["speedup"] = {
        name: round(
            statistics.median(times[("rolled", name)])
            / statistics.median(times[("unrolled", name)]),
            3,
        )  # fmt: skip
        for name in rolled
    }
    res["compile_s"] = round(sum(unrolled[n][2] for n in ("decode_b1", "decode_b32")), 2)
    res["rolled_compile_s"] = round(sum(rolled[n][2] for n in ("decode_b1", "decode_b32")), 2)
    eq = {n: bool(np.array_equal(outs[("rolled", n)], outs[("unrolled", n)])) for n in rolled}
    res["tokens_equal"] = eq["decode_b1"] and eq["decode_b32"]
    res["noise_equal"] = eq["noise_v"] and eq["noise_7xv"]
    res["reps"] = args.reps
    res["platform"] = f"{platform.machine()} {jax.default_backend()} x{os.cpu_count()}"
    print(json.dumps(res))


if __name__ == "__main__":
    main()
