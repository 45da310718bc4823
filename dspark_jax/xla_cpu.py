"""The XLA:CPU fusion setting `train.py`, `serve.py`, the tests and the benchmarks run with.

XLA:CPU hands some fused computations to YNNPACK. Its default also gives it reductions, and on
the drafters' vocabulary-sized loss (log-softmax, softmax, L1 over [tokens, V]) those fused
reductions were the slowest kernels of a training step. Restricting YNNPACK to dot and
elementwise fusions (`--xla_cpu_experimental_ynn_fusion_type=dot,eltwise`) measured, on the
demo's models, interleaved in one session (2 cores, jaxlib 0.10.2):

    DSpark micro-step (loss + grad, 4 x 256)   ~485 ms -> ~340 ms
    DFlash micro-step                          ~347 ms -> ~292 ms
    Eagle3 micro-step                          ~359 ms -> ~354 ms
    target training step (16 x 256)           ~1936 ms -> ~1558 ms
    8-token verify forward, batch 1             5.1 ms -> 3.9 ms
    batch-32 decode step                        657 ms -> 648 ms

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
