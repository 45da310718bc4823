"""The demo target's training step against the formulation it replaced, in one run.

The demo's target (configs/tiny.py: 16 layers x 160, vocab 2048) takes one `train/lm.py`
step's loss and gradient (16 windows x 256 tokens, random init) in two compiled programs:

* ``current``: the library as it is;
* ``baseline``: the same model with attention's joint softmax differentiated by autodiff
  through its masks, max and division, and RoPE as split / rotate / concatenate (how both were
  written before they were given the softmax's own VJP and the roll form).

Both are compiled before timing, then timed interleaved; medians. Prints ONE JSON object:
``step_ms`` / ``baseline_step_ms`` (loss + gradient), ``speedup`` (baseline / current),
``loss_diff`` and ``max_grad_diff`` (current vs baseline; the two are the same math),
``reps``, ``platform``.

    python benchmarks/target_step.py [--reps 7]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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

from dspark_jax.models import layers  # noqa: E402
from dspark_jax.models.transformer import init_params  # noqa: E402
from dspark_jax.train import lm  # noqa: E402
from dspark_jax.xla_cpu import training_compiler_options  # noqa: E402


def _softmax_autodiff(scores, masks):
    """The joint softmax as it was written before its custom VJP (autodiff through the masks
    and the division; the max held constant)."""
    neg = layers._NEG
    scores = [jnp.where(m, s, neg) for s, m in zip(scores, masks)]
    mx = jnp.max(scores[0], axis=-1, keepdims=True, initial=neg)
    for s in scores[1:]:
        mx = jnp.maximum(mx, jnp.max(s, axis=-1, keepdims=True, initial=neg))
    mx = jax.lax.stop_gradient(mx)
    es = [jnp.where(m, jnp.exp(s - mx), 0.0) for s, m in zip(scores, masks)]
    den = sum(e.sum(-1, keepdims=True) for e in es)
    den = jnp.where(den > 0, den, 1.0)
    return [e / den for e in es]


def _rope_split(x, positions, inv_freq):
    """RoPE as it was written: split the halves, rotate, concatenate."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(freqs)[:, :, None, :], jnp.sin(freqs)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _compile(cfg, params, batch, options="training"):
    """Compiled loss + grad; `options` "training": the options `train_lm` compiles with."""
    options = training_compiler_options() if options == "training" else options
    f = jax.jit(jax.value_and_grad(functools.partial(lm._loss, cfg)))
    return f.lower(params, batch).compile(options)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    from configs.tiny import config

    cfg = dataclasses.replace(config().target.model, vocab_size=2048)
    params = init_params(cfg, 0)
    rng = np.random.default_rng(0)
    batch = jnp.asarray(rng.integers(1, cfg.vocab_size, size=(16, 257)), jnp.int32)

    progs = {"current": _compile(cfg, params, batch)}
    saved = layers.joint_softmax, layers.apply_rope
    layers.joint_softmax, layers.apply_rope = _softmax_autodiff, _rope_split
    try:
        progs["baseline"] = _compile(cfg, params, batch)
    finally:
        layers.joint_softmax, layers.apply_rope = saved

    outs = {k: jax.block_until_ready(p(params, batch)) for k, p in progs.items()}
    times = {k: [] for k in progs}
    for _ in range(args.reps):
        for k, p in progs.items():
            t = time.perf_counter()
            jax.block_until_ready(p(params, batch))
            times[k].append(time.perf_counter() - t)
    (lc, gc), (lb, gb) = outs["current"], outs["baseline"]
    med = {k: float(np.median(v)) * 1000 for k, v in times.items()}
    diffs = [
        float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(gc), jax.tree.leaves(gb))
    ]
    print(
        json.dumps(
            {
                "step_ms": round(med["current"], 1),
                "baseline_step_ms": round(med["baseline"], 1),
                "speedup": round(med["baseline"] / med["current"], 3),
                "loss_diff": float(lc - lb),
                "max_grad_diff": max(diffs),
                "reps": args.reps,
                "platform": f"{platform.machine()} {jax.default_backend()} x{os.cpu_count()}",
            }
        )
    )


if __name__ == "__main__":
    main()
