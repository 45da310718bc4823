"""The training steps' XLA:CPU compiler option (`dspark_jax/xla_cpu.py`) against XLA's default.

Every program of the demo that the option could go to, compiled twice in one process (with the
option, and with XLA's default) and timed interleaved, medians: the demo target's loss + grad
(`target_step.py`), the demo's three drafters' micro-steps (`drafter_step.py`), and the
decoding programs of `decode_paths.py` (32 decode steps at batch 32 and at batch 1, the 8-token
verify forward at batch 1, DSpark and Eagle3 proposals), all at the demo's sizes with random
weights. The library gives the option to the training programs and to batch-1 plain decoding
only; the other decoding rows show why.

Prints ONE JSON object: ``{program}_ms`` (with the option) / ``default_{program}_ms``,
``speedup`` {program: default / with}, ``option``, ``reps``, ``platform``.

    python benchmarks/xla_cpu_flags.py [--reps 5]

Re-run it before adding a jaxlib release to `xla_cpu.CHECKED_JAXLIB`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path[:0] = [HERE, os.path.join(HERE, "..")]

import decode_paths  # noqa: E402
import drafter_step  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import target_step  # noqa: E402

from dspark_jax import drafters, xla_cpu  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    option = {xla_cpu.OPTION: xla_cpu.VALUE}
    cfg, tcfg, tparams, dcfgs = drafter_step.demo_models()
    windows = jnp.asarray(np.random.default_rng(0).integers(1, 2048, size=(16, 257)), jnp.int32)
    batch = drafter_step.demo_batch(cfg, tcfg, tparams)
    dparams = {k: drafters.init_params(c, target_params=tparams) for k, c in dcfgs.items()}
    progs = {}  # (name, with option?) -> (compiled, args)
    for opt in (False, True):
        o = option if opt else None
        progs[("target_step", opt)] = (target_step._compile(tcfg, tparams, windows, o),
                                       (tparams, windows))  # fmt: skip
        for k, c in dcfgs.items():
            a = (dparams[k].trainable, batch, jax.random.key(0))
            progs[(f"{k}_step", opt)] = (drafter_step._compile(c, dparams[k], batch, o), a)
        ds = {k: (dcfgs[k], dparams[k]) for k in ("dspark", "eagle3")}
        for name, pa in decode_paths._programs(tcfg, tparams, ds, o).items():
            progs[(name, opt)] = pa
    for p, a in progs.values():
        jax.block_until_ready(p(*a))
    times = {k: [] for k in progs}
    for _ in range(args.reps):
        for k, (p, a) in progs.items():
            reps = 20 if k[0].startswith(("verify", "propose")) else 1
            t = time.perf_counter()
            for _ in range(reps):
                r = p(*a)
            jax.block_until_ready(r)
            times[k].append((time.perf_counter() - t) / reps)
    med = {k: float(np.median(v)) * 1000 for k, v in times.items()}
    names = list(dict.fromkeys(n for n, _ in progs))
    res = {}
    for n in names:
        res[f"{n}_ms"] = round(med[(n, True)], 3)
        res[f"default_{n}_ms"] = round(med[(n, False)], 3)
    res["speedup"] = {n: round(med[(n, False)] / med[(n, True)], 3) for n in names}
    res["option"] = option
    res["reps"] = args.reps
    res["platform"] = f"{platform.machine()} {jax.default_backend()} x{os.cpu_count()}"
    print(json.dumps(res))


if __name__ == "__main__":
    main()
