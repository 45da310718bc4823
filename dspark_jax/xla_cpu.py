"""The XLA:CPU fusion setting `train.py`, `serve.py`, the tests and the benchmarks run with.

XLA:CPU hands some fused computations to YNNPACK. Its default also gives it reductions, and on
the vocabulary-sized parts of training (log-softmax, softmax, L1 over [tokens, V]) those fused
reductions were the slowest kernels of a step. Restricting YNNPACK to dot and elementwise
fusions (`--xla_cpu_experimental_ynn_fusion_type=dot,eltwise`) measured on the demo's models
(2 cores, jaxlib 0.10.2; benchmarks/xla_cpu_flags.py re-measures it):

    target training step (16 x 256)            ~1.94 s -> ~1.56 s
    DSpark micro-step (loss + grad, 4 x 256)   ~485 ms -> ~340 ms
    DFlash / Eagle3 micro-step                 ~1.2x / unchanged
    the demo's target + drafters stages        387 + 818 s -> 330 + 696 s (demo 28.6 -> 25.8 min)
    plain batch-1 decoding (generate)          ~1.2-1.5x faster per token
    a speculative round (engine, batch 1)      not faster (overhead-bound: many small ops)

XLA reads XLA_FLAGS once, when JAX starts its first backend, and aborts on a flag it does not
know. So the flag is added only before that (call `apply_cpu_defaults()` first thing), only
for jaxlib releases it was checked on (the option is experimental and may be renamed), and
never over a setting of the same option the user already has in XLA_FLAGS.
DSPARK_XLA_CPU_DEFAULTS=off turns it off.
"""

from __future__ import annotations

import os
from importlib import metadata

OPTION = "--xla_cpu_experimental_ynn_fusion_type"
VALUE = "dot,eltwise"
CHECKED_JAXLIB = ((0, 10),)  # (major, minor) releases the option exists in and was measured on
ENV = "DSPARK_XLA_CPU_DEFAULTS"


def _jaxlib_release() -> tuple[int, int] | None:
    try:
        major, minor = metadata.version("jaxlib").split(".")[:2]
        return int(major), int(minor)
    except (metadata.PackageNotFoundError, ValueError):
        return None


def apply_cpu_defaults(environ=os.environ) -> str | None:
    """Append the fusion setting to XLA_FLAGS when it is safe; returns what was added or None.

    Has an effect only if no JAX backend has started yet in this process."""
    if environ.get(ENV, "").strip().lower() in ("0", "off", "none", "false"):
        return None
    flags = environ.get("XLA_FLAGS", "")
    if OPTION in flags or _jaxlib_release() not in CHECKED_JAXLIB:
        return None
    added = f"{OPTION}={VALUE}"
    environ["XLA_FLAGS"] = f"{flags} {added}".strip()
    return added
