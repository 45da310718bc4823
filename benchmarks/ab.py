"""Current vs replaced: the library's XLA:CPU settings against what they replaced, in one process.

    python benchmarks/ab.py xla_cpu  [--reps 5]
    python benchmarks/ab.py threefry [--reps 9]
    python benchmarks/ab.py threefry --smoke   # seconds: the same programs and keys on the
        # tiny test target (V = 256) and 1-layer drafters (γ = 2), 4 decode steps, 1 repetition

Only settings whose answer can change with the jax / jaxlib release or the CPU live here; a
form the library replaced for good is not re-measured (docs/MEASUREMENTS.md, "Settled
experiments", one line each). Both experiments run the demo's models (configs/tiny.py: the
16 x 160 target at a 2048-token vocabulary and its three drafters, random weights: timing only).
Every program is compiled twice in this process, ``current`` (as the library ships it) and
``replaced``, the two are timed interleaved (the order alternating per repetition, the first
pass a warm-up) and the medians reported.

* ``xla_cpu``: YNNPACK fusions restricted to dot and elementwise
  (`xla_cpu.training_compiler_options`) against XLA's default, on the target's training step
  (16 x 256 tokens), the three drafters' training micro-steps (the demo's micro-batch) and 32
  sampled decode steps at batch 1 (`xla_cpu.batch1_decode_compiler_options`).
* ``threefry``: JAX's random bits lowered unrolled on CPU (`xla_cpu.unrolled_threefry`) against
  JAX's rolled loop: one Gumbel draw over the vocabulary (every sampled token pays it), the
  drafter's γ x V noise and 32 sampled decode steps at batch 1. The bits must be equal.

Prints ONE JSON object: ``experiment``, ``{program}_ms`` / ``replaced_{program}_ms`` (per call;
a noise program's call is 64 draws), ``speedup`` {program: replaced / current}, ``same_output``
{program: bool} (threefry), ``reps``, ``platform``. Exits 1 with one line when the setting does not apply here (another
backend, an unchecked release, switched off in the environment): nothing to compare.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from configs.tiny import config as tiny_config  # noqa: E402
from dspark_jax import drafters, runtime  # noqa: E402
from dspark_jax.config import DrafterConfig  # noqa: E402
from dspark_jax.models import generate as gen  # noqa: E402
from dspark_jax.models import transformer as tf  # noqa: E402
from dspark_jax.runtime import xla_cpu  # noqa: E402
from dspark_jax.spec import sampling as S  # noqa: E402
from dspark_jax.testing import drafter_batch, tiny_target_config  # noqa: E402
from dspark_jax.train import lm, losses  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The vocabulary, decode steps, the decode cache (and its filled length), noise draws per
    call, the target step's windows [B, L] and (`smoke`) the tiny models instead of the demo's."""

    vocab: int = 2048
    decode_steps: int = 32
    cache: int = 256
    filled: int = 100
    noise_draws: int = 64
    window: tuple[int, int] = (16, 257)
    smoke: bool = False


FULL = Sizes()
SMOKE = Sizes(vocab=256, decode_steps=4, cache=64, filled=16, noise_draws=4, window=(2, 33),
              smoke=True)  # fmt: skip


def fail(msg: str):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(1)


def demo_models(sz: Sizes = FULL):
    """configs/tiny.py's pipeline config, its target at `sz.vocab` tokens (random init) and the
    drafters stage's three drafter configs on it: (cfg, tcfg, tparams, dcfgs). Smoke: the tiny
    test target and 1-layer drafters, γ = 2."""
    cfg = tiny_config()
    tcfg = dataclasses.replace(cfg.target.model, vocab_size=sz.vocab)
    d = cfg.drafters
    common = dict(block_size=d.block_size, num_layers=d.num_layers, num_anchors=d.num_anchors,
                  mask_token_id=tcfg.vocab_size - 1)  # fmt: skip
    rank = d.markov_rank
    if sz.smoke:
        tcfg = tiny_target_config(vocab_size=sz.vocab)
        common = dict(block_size=2, num_layers=1, num_anchors=4, mask_token_id=sz.vocab - 1)
        rank = 16
    dcfgs = {
        "dspark": DrafterConfig.dspark(tcfg, markov_rank=rank, **common),
        "dflash": DrafterConfig.dflash(tcfg, **common),
        "eagle3": DrafterConfig.eagle3(tcfg, block_size=common["block_size"]),
    }
    return cfg, tcfg, tf.init_params(tcfg, 0), dcfgs


def decode_program(tcfg, tparams, options, sz: Sizes = FULL):
    """32 sampled decode steps (T = 1, untruncated) at batch 1 from a 100-token cache (`sz`)."""
    scfg = S.SamplingConfig()

    def decode(params, cache, tok_Bx1, key):
        b = tok_Bx1.shape[0]
        seeds = jnp.arange(b, dtype=jnp.int32)
        sp = S.SamplingParams(jnp.ones((b,)), jnp.zeros((b,), jnp.int32), jnp.ones((b,)),
                              jnp.zeros((b,)))  # fmt: skip

        def body(i, c):
            cache, tok, toks_BxN = c
            o, cache = gen.extend(tcfg, params, tok, cache)
            nxt = gen.sample_tokens(o.logits[:, -1], key, seeds, cache.lengths + 1, sp, scfg)
            return cache.with_lengths(cache.lengths + 1), nxt[:, None], toks_BxN.at[:, i].set(nxt)

        init = (cache, tok_Bx1, jnp.zeros((b, sz.decode_steps), jnp.int32))
        return jax.lax.fori_loop(0, sz.decode_steps, body, init)[2]

    cache = tf.init_cache(tcfg, 1, sz.cache).with_lengths(jnp.full((1,), sz.filled, jnp.int32))
    tok_Bx1 = jnp.asarray(np.random.default_rng(0).integers(5, sz.vocab, (1, 1)), jnp.int32)
    a = (tparams, cache, tok_Bx1, jax.random.key(0))
    return jax.jit(decode).lower(*a).compile(options), a


def noise_program(shape, draws: int):
    """`draws` Gumbel draws of `shape` ([rows, V]) in one jitted loop."""

    def run(key):
        def body(i, acc_RxV):
            keys = jax.random.split(jax.random.fold_in(key, i), shape[0])
            return acc_RxV + S.gumbel_noise(keys, shape[1])

        return jax.lax.fori_loop(0, draws, body, jnp.zeros(shape))

    a = (jax.random.key(0),)
    return jax.jit(run).lower(*a).compile(), a


def xla_cpu_programs(sz: Sizes = FULL):
    """program -> {"current": (compiled, args), "replaced": ...}: the option vs XLA's default."""
    option = xla_cpu.training_compiler_options()
    if option is None:
        fail(f"the training option is not given here (backend {jax.default_backend()}, "
             f"jaxlib release checked: {xla_cpu.CHECKED_JAXLIB}, {xla_cpu.ENV}, XLA_FLAGS); "
             "nothing to compare")  # fmt: skip
    cfg, tcfg, tparams, dcfgs = demo_models(sz)
    windows_BxL = jnp.asarray(np.random.default_rng(0).integers(1, sz.vocab, sz.window), jnp.int32)
    t = cfg.drafters.train
    mb, length = (2, 32) if sz.smoke else (t.micro_batch_size, t.seq_buckets[-1])
    batch = drafter_batch(tcfg, tparams, batch=mb, length=length, prompt=min(20, length // 2))
    dparams = {k: drafters.init_params(c, target_params=tparams) for k, c in dcfgs.items()}
    progs = {}
    for variant, opt in (("current", option), ("replaced", None)):
        step = jax.jit(jax.value_and_grad(functools.partial(lm._loss, tcfg)))
        a = (tparams, windows_BxL)
        progs.setdefault("target_step", {})[variant] = (step.lower(*a).compile(opt), a)
        for kind, c in dcfgs.items():
            f = functools.partial(losses.loss_fn, c)
            frozen = dparams[kind].frozen
            g = jax.jit(jax.value_and_grad(lambda tr, b, k, f=f, fz=frozen: f(tr, fz, b, k),
                                           has_aux=True))  # fmt: skip
            a = (dparams[kind].trainable, batch, jax.random.key(0))
            progs.setdefault(f"{kind}_step", {})[variant] = (g.lower(*a).compile(opt), a)
        progs.setdefault("decode_b1", {})[variant] = decode_program(tcfg, tparams, opt, sz)
    return progs


def threefry_programs(sz: Sizes = FULL):
    """program -> {"current": unrolled, "replaced": JAX's rolled CPU lowering}."""
    if runtime.release("jax") not in xla_cpu.THREEFRY_CHECKED_JAX:
        fail(f"jax {jax.__version__}: the unrolled lowering is only given on jax releases "
             f"{xla_cpu.THREEFRY_CHECKED_JAX}; nothing to compare")  # fmt: skip
    if not runtime.settings().xla_cpu_threefry:
        fail(f"{xla_cpu.THREEFRY_ENV} turns the unrolled lowering off; unset it to compare")
    _, tcfg, tparams, dcfgs = demo_models(sz)
    gamma = dcfgs["dspark"].block_size
    opt = xla_cpu.batch1_decode_compiler_options()

    def build():
        return {
            "noise_v": noise_program((1, sz.vocab), sz.noise_draws),
            "noise_gxv": noise_program((gamma, sz.vocab), sz.noise_draws),
            "decode_b1": decode_program(tcfg, tparams, opt, sz),
        }

    rolled = build()  # before the lowering is registered: JAX's CPU default
    jax.clear_caches()
    if not xla_cpu.unrolled_threefry():
        fail("the unrolled lowering could not be registered on this jax; nothing to compare")
    unrolled = build()
    return {n: {"current": unrolled[n], "replaced": rolled[n]} for n in rolled}


EXPERIMENTS = {"xla_cpu": xla_cpu_programs, "threefry": threefry_programs}


def time_interleaved(progs, reps):
    """Medians in seconds per (program, variant) and the last outputs; pass 0 warms up."""
    times = {(n, v): [] for n, pv in progs.items() for v in pv}
    outs = {}
    for rep in range(reps + 1):
        for n, pv in progs.items():
            order = list(pv) if rep % 2 else list(pv)[::-1]
            for v in order:
                prog, a = pv[v]
                t0 = time.perf_counter()
                outs[(n, v)] = jax.block_until_ready(prog(*a))
                if rep:
                    times[(n, v)].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}, outs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("experiment", choices=sorted(EXPERIMENTS))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--smoke", action="store_true", help="seconds-sized run, the same keys")
    args = ap.parse_args(argv)
    if args.smoke:
        args.reps = 1
    if args.reps < 1:
        fail(f"--reps {args.reps}: must be >= 1")
    progs = EXPERIMENTS[args.experiment](SMOKE if args.smoke else FULL)
    med, outs = time_interleaved(progs, args.reps)
    res = {"experiment": args.experiment}
    for n in progs:
        res[f"{n}_ms"] = round(med[(n, "current")] * 1e3, 3)
        res[f"replaced_{n}_ms"] = round(med[(n, "replaced")] * 1e3, 3)
    res["speedup"] = {n: round(med[(n, "replaced")] / med[(n, "current")], 3) for n in progs}
    if args.experiment == "threefry":
        same = {n: np.array_equal(outs[(n, "current")], outs[(n, "replaced")]) for n in progs}
        res["same_output"] = {n: bool(v) for n, v in same.items()}
    res["reps"] = args.reps
    res["platform"] = f"{platform.machine()} {jax.default_backend()} x{os.cpu_count()}"
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
