"""The demo's drafter training micro-step against the loss formulation it replaced, in one run.

The demo's target (configs/tiny.py: 16 layers x 160, vocab 2048, random init) gives one batch
of the demo's micro-batch (4 sequences x 256 tokens, features from its 5 layers); the demo's
DSpark and DFlash drafters (2-layer backbone, 128 anchor blocks of 7 per sequence) and its
Eagle3 (1 layer, 7 training-time-test steps) take the loss and gradient (`train.losses.loss_fn`)
in two compiled programs each:

* ``current``: the library as it is (CE and L1 over the vocabulary with their own VJP,
  `losses.ce_and_l1`; Eagle3's soft-label CE the same way);
* ``baseline``: CE and L1 differentiated by autodiff through log-softmax, exp and abs, as they
  were written before.

Compiled before timing, then timed interleaved; medians. Prints ONE JSON object:
``{kind}_step_ms`` / ``baseline_{kind}_step_ms``, ``speedup`` {kind: baseline / current},
``loss_diff`` and ``max_grad_diff`` {kind: current vs baseline, the same math}, ``reps``,
``platform``.

    python benchmarks/drafter_step.py [--reps 7]
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

from dspark_jax import drafters  # noqa: E402
from dspark_jax.config import DrafterConfig  # noqa: E402
from dspark_jax.models import transformer as tf  # noqa: E402
from dspark_jax.testing import drafter_batch  # noqa: E402
from dspark_jax.train import losses  # noqa: E402
from dspark_jax.xla_cpu import training_compiler_options  # noqa: E402


def _ce_and_l1_autodiff(logits, p_t, ids=None):
    """CE and L1 as they were written before their own VJP (autodiff through every op)."""
    logp_d = jax.nn.log_softmax(logits, axis=-1)
    if ids is None:
        ce = -(p_t * logp_d).sum(-1)
    else:
        ce = -jnp.take_along_axis(logp_d, ids[..., None], axis=-1)[..., 0]
    return ce, jnp.abs(jnp.exp(logp_d) - p_t).sum(-1)


def _compile(cfg, params, batch, options="training"):
    """Compiled loss + grad; `options` "training": the options the trainer compiles with."""
    options = training_compiler_options() if options == "training" else options
    f = functools.partial(losses.loss_fn, cfg)
    g = jax.jit(jax.value_and_grad(lambda tr, b, k: f(tr, params.frozen, b, k), has_aux=True))
    return g.lower(params.trainable, batch, jax.random.key(0)).compile(options)


def demo_models():
    """configs/tiny.py's pipeline config, its target at a 2048-token vocabulary (random init) and
    the demo's three drafter configs on it (the drafters stage): (cfg, tcfg, tparams, dcfgs)."""
    from configs.tiny import config

    cfg = config()
    tcfg = dataclasses.replace(cfg.target.model, vocab_size=2048)
    d = cfg.drafters
    common = dict(block_size=d.block_size, num_layers=d.num_layers, num_anchors=d.num_anchors,
                  mask_token_id=tcfg.vocab_size - 1)  # fmt: skip
    dcfgs = {
        "dspark": DrafterConfig.dspark(tcfg, markov_rank=d.markov_rank, **common),
        "dflash": DrafterConfig.dflash(tcfg, **common),
        "eagle3": DrafterConfig.eagle3(tcfg, block_size=d.block_size),
    }
    return cfg, tcfg, tf.init_params(tcfg, 0), dcfgs


def demo_batch(cfg, tcfg, tparams):
    """One micro-batch of the demo's drafter training, features from `tparams`."""
    t = cfg.drafters.train
    return drafter_batch(tcfg, tparams, batch=t.micro_batch_size, length=t.seq_buckets[-1],
                         prompt=20)  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    cfg, tcfg, tparams, dcfgs = demo_models()
    batch = demo_batch(cfg, tcfg, tparams)
    progs, params = {}, {}
    for kind, c in dcfgs.items():
        params[kind] = drafters.init_params(c, target_params=tparams)
        progs[("current", kind)] = _compile(c, params[kind], batch)
        saved = losses.ce_and_l1
        losses.ce_and_l1 = _ce_and_l1_autodiff
        try:
            progs[("baseline", kind)] = _compile(c, params[kind], batch)
        finally:
            losses.ce_and_l1 = saved

    def run(vk):
        return progs[vk](params[vk[1]].trainable, batch, jax.random.key(0))

    outs = {vk: jax.block_until_ready(run(vk)) for vk in progs}
    times = {vk: [] for vk in progs}
    for _ in range(args.reps):
        for vk in progs:
            t = time.perf_counter()
            jax.block_until_ready(run(vk))
            times[vk].append(time.perf_counter() - t)
    med = {vk: float(np.median(v)) * 1000 for vk, v in times.items()}
    res = {}
    for kind in dcfgs:
        res[f"{kind}_step_ms"] = round(med[("current", kind)], 1)
        res[f"baseline_{kind}_step_ms"] = round(med[("baseline", kind)], 1)
    res["speedup"] = {k: round(med[("baseline", k)] / med[("current", k)], 3) for k in dcfgs}
    res["loss_diff"], res["max_grad_diff"] = {}, {}
    for kind in dcfgs:
        (lc, _), gc = outs[("current", kind)]
        (lb, _), gb = outs[("baseline", kind)]
        res["loss_diff"][kind] = float(lc - lb)
        res["max_grad_diff"][kind] = max(
            float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(gc), jax.tree.leaves(gb))
        )
    res["reps"] = args.reps
    res["platform"] = f"{platform.machine()} {jax.default_backend()} x{os.cpu_count()}"
    print(json.dumps(res))


if __name__ == "__main__":
    main()
