"""XLA:CPU tuning: which fused computations each kind of program hands to YNNPACK (the training
steps and batch-1 plain decoding: dots and elementwise; the serving engine's programs and
batch-1 prefill: none), and the unrolled lowering of JAX's random-bit generator
(`unrolled_threefry`, below).

XLA:CPU hands some fused computations to YNNPACK. Its default also gives it reductions, and on
the vocabulary-sized parts of training (log-softmax, softmax, L1 over [tokens, V]) those fused
reductions were the slowest kernels of a step. Compiling a program with YNNPACK restricted to
dot and elementwise fusions (`xla_cpu_experimental_ynn_fusion_type`), on the demo's models
(2 cores, jaxlib 0.10.2; speedup over XLA's default):

                                       in one process,      across processes,
                                       per-program option   as an XLA_FLAGS entry
    target training step (16 x 256)          1.10x                1.22x
    DSpark / DFlash / Eagle3 micro-step      1.18 / 1.19 / 1.04x  1.46 / 1.43 / 1.15x
    8-token verify forward, batch 1          0.96x                0.81x
    DSpark / Eagle3 proposal                 1.06 / 0.92x         0.93 / 0.78x
    32 decode steps at batch 32              0.96x                0.94x
    32 decode steps at batch 1               1.55x (2026-12-03, decode_paths' decode_b1)

(`benchmarks/ab.py xla_cpu` re-measures the training rows; this shared machine ran ~1.2x slower
then. Its re-run of 2026-12-03, docs/MEASUREMENTS.md: target step 0.95x, micro-steps
1.07 / 1.12 / 1.03x, decode at batch 1 1.55x, at batch 32 0.93x: the training rows move with the
machine's load between runs.)
The two columns are not two strengths of one option: the target's real training step
(`lm._step_jit`) in alternated processes ran 3.08 / 3.60 s per step with the per-program option,
3.45 / 4.59 s with the XLA_FLAGS entry and 4.23 / 4.46 s with neither (two rounds, machine loaded).

So the option goes to the training programs (the target's step, the drafter trainer's micro-,
update and eval steps) as a per-program compiler option, and so does plain decoding at batch 1
(`generate`'s device loop at batch bucket 1): there XLA turns the one query's attention products
into multiply + reduce, YNNPACK's reduce fusion takes them with the K/V cache as an operand, and
the decode loop then copies every layer's cache buffers four times per token (128 copies of
[1, 1, S, 80] per step of the demo's target in the optimized HLO; none with the option): a step
of the demo's target 0.98-1.18 -> 0.66-0.81 ms (three runs of a 32-step loop). At batch 2-8 and at
32 rows the option made no difference or lost a little (1.91 / 1.92 ms at 2, 4.57 / 4.73 ms at 8),
and the serving engine's rounds and prefill did not gain, so every other decoding program (the
serving engine, the drafters' proposals, batched `generate`) keeps XLA's default. A per-program option never
changes another program, and an option a jaxlib does not know is a compile error rather than
the abort an unknown XLA_FLAGS entry is; still, it is given only on the jaxlib releases it was
checked on (the option is experimental and may be renamed), only on the CPU backend, and never
when the user set the same option in XLA_FLAGS. DSPARK_XLA_CPU_TRAINING=off turns it off (for
all three uses).

The serving engine's programs (prefill, one round, K device-resident rounds: the drafter's
proposal, the verify forward over a block of tokens per slot, acceptance) and batch-1 plain
prefill go the other way: compiled with no YNNPACK fusions at all (`ENGINE_VALUE`, the empty
list), their products of a few to a few hundred rows run in XLA's own dot kernels, which on
this CPU are faster at those shapes than YNNPACK's, while YNNPACK's stay faster for the one-row
products of a plain decode step. On the demo's models in one process (docs/MEASUREMENTS.md:
engine_ynn, 12 held-out prompts from the three evaluation sets, T = 1, the chat's stop ids, prefill
included, 5 interleaved passes; three runs): DSpark's batch-1 speculative decoding (8
device-resident rounds per call) 1.14 / 1.17 / 1.17x faster per token with the option than with
XLA's default (1.06x once the engine ran a tied LM head untied, s20: part of the gain was that
head's transposed read), the 8-slot evaluation decoder 1.07 / 0.97 / 1.13x; plain decoding with no
YNNPACK at all lost (1.43 -> 1.77 ms per token in one process), so its decode loop keeps the option
above and only its prefill, a separate program at batch 1, is compiled without.
"""

from __future__ import annotations

from collections.abc import Mapping

from dspark_jax import runtime

OPTION = "xla_cpu_experimental_ynn_fusion_type"
VALUE = "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE"
ENGINE_VALUE = ""  # no fusion handed to YNNPACK
CHECKED_JAXLIB = ((0, 10),)  # (major, minor) releases the option exists in and was measured on
ENV = runtime.XLA_CPU_TRAINING_ENV
_release = runtime.release


def _jaxlib_release() -> tuple[int, int] | None:
    return _release("jaxlib")


def batch1_decode_compiler_options(
    environ: Mapping[str, str] | None = None,
) -> dict[str, str] | None:
    """`compiler_options` for plain decoding's loop at batch 1: the training steps' (above)."""
    return training_compiler_options(environ)


def training_compiler_options(environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """`compiler_options` for `jax.jit` of a training step: {OPTION: VALUE}, or None where it
    does not apply (another backend, an unchecked jaxlib, turned off, the user's own setting)."""
    return _given(VALUE, environ)


def engine_compiler_options(environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """`compiler_options` for the serving engine's programs and batch-1 plain prefill:
    {OPTION: ENGINE_VALUE} (no YNNPACK fusions), or None where it does not apply (as above)."""
    return _given(ENGINE_VALUE, environ)


def _given(value: str, environ: Mapping[str, str] | None) -> dict[str, str] | None:
    import jax  # here: train.py imports this module before its config check, without jax

    s = runtime.resolve(environ)
    if not s.xla_cpu_training:
        return None
    if OPTION in s.xla_flags or _jaxlib_release() not in CHECKED_JAXLIB:
        return None
    if jax.default_backend() != "cpu":
        return None
    return {OPTION: value}


# ---------------------------------------------------------------------------------------------
# threefry on CPU

THREEFRY_ENV = runtime.XLA_CPU_THREEFRY_ENV
THREEFRY_CHECKED_JAX = ((0, 10),)  # jax releases whose private lowering API this was checked on
_threefry_on = False


def unrolled_threefry(environ: Mapping[str, str] | None = None) -> bool:
    """Lower JAX's threefry2x32 hash (behind every `jax.random` draw) on the CPU backend as
    straight-line code, the lowering JAX itself uses on the other backends, instead of its CPU
    default: a rolled 5-iteration loop of small array ops. Every draw is bit for bit the same
    (the same uint32 arithmetic; tests/test_xla_cpu.py compares them); XLA fuses the unrolled
    rounds into one loop over the elements. On the 2-core CPU (`benchmarks/ab.py threefry`) the
    Gumbel noise of one [2048]-vocabulary draw, which every sampled token of plain decoding
    pays, took 109 -> 16 us, the drafter's γ = 7 draws 110 -> 46 us; 32 sampled decode steps of
    the demo's target at batch 1 1.06-1.12x, at batch 32 1.01-1.05x.

    Process-wide and for programs compiled after the call; train.py and serve.py call it at
    start-up, a library user may too. Returns whether the unrolled lowering is in place: False
    on a jax release it was not checked on (it uses `jax._src`), where the private names are
    gone, or with DSPARK_XLA_CPU_THREEFRY=off."""
    global _threefry_on
    if _threefry_on:
        return True
    if not runtime.resolve(environ).xla_cpu_threefry:
        return False
    if _release("jax") not in THREEFRY_CHECKED_JAX:
        return False
    try:
        # jax's private modules, inside the try: a jax without them turns this off (ImportError);
        # and importing this module must not load jax (train.py's config check, as in _given)
        from jax._src.interpreters import mlir
        from jax._src.random import threefry2x32 as tf  # (the same two reasons)

        rule = tf._threefry2x32_lowering_rule  # JAX's unrolled rule (its non-CPU default)
        mlir.register_lowering(tf.threefry2x32_p, rule, platform="cpu", inline=False)
    except (ImportError, AttributeError):
        return False
    _threefry_on = True
    return True
