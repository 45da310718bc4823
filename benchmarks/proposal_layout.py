"""Drafter proposal time before / after the heads-first drafter context (issue 9, models/layers.py).

Both versions run in this one process: the drafter code of revision `--before` (default: the last
commit with the `[B, S, n_kv, d]` drafter contexts) is read with `git show` into a temporary
package (its `dspark_jax.drafters` / `dspark_jax.models.transformer` imports renamed to it), the
current code is imported as usual. For the demo's drafters (configs/tiny.py: γ = 7, one backbone
layer, Markov rank 64; random weights, random target features) at batch 1 and 8, each version
fills a context of `--ctx-len` positions (cache of `--max-len`) and then `propose` (jitted,
sampling at T = 1, as the demo evaluates) is timed: `--reps` interleaved rounds (the order of the
two versions alternates), `--calls` calls per round, per-call median over the rounds. Both
versions must draw the same tokens (checked).

    python benchmarks/proposal_layout.py [--before REV] [--reps 15] [--calls 20]

Prints one JSON object: per kind and batch, the median ms per proposal before and after and
after / before.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from configs import tiny  # noqa: E402
from dspark_jax import drafters  # noqa: E402
from dspark_jax.config import DrafterConfig  # noqa: E402
from dspark_jax.drafters import api as api_after  # noqa: E402
from dspark_jax.models import transformer  # noqa: E402
from dspark_jax.spec.sampling import SamplingConfig  # noqa: E402

BEFORE_REV = "2c0aa93"  # the drafters' [B, S, n_kv, d] contexts and their own attention kernels
_OLD_FILES = [
    "dspark_jax/drafters/__init__.py",
    "dspark_jax/drafters/api.py",
    "dspark_jax/drafters/common.py",
    "dspark_jax/drafters/dflash.py",
    "dspark_jax/drafters/dspark.py",
    "dspark_jax/drafters/eagle3.py",
    "dspark_jax/drafters/heads.py",
    "dspark_jax/models/transformer.py",
]


def load_before(rev: str, tmp: str):
    """The `drafters.api` module of revision `rev`, importable next to the current one."""
    pkg = "_proposal_before"
    for f in _OLD_FILES:
        text = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:{f}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        text = text.replace("dspark_jax.drafters", f"{pkg}.drafters")
        text = text.replace("dspark_jax.models.transformer", f"{pkg}.models.transformer")
        out = Path(tmp, pkg, *Path(f).parts[1:])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    for d in ("", "models"):
        Path(tmp, pkg, d, "__init__.py").touch()
    sys.path.insert(0, tmp)
    return importlib.import_module(f"{pkg}.drafters.api")


def drafter_config(kind: str, tcfg) -> DrafterConfig:
    """configs/tiny.py's drafter of `kind` (its shapes, as `run.rundir.RunDir.drafter_config`
    builds it; the weights are random here)."""
    d = tiny.config().drafters
    common = dict(block_size=d.block_size)
    if kind == "eagle3":
        return DrafterConfig.eagle3(tcfg, **common)
    common.update(num_layers=d.num_layers, num_anchors=d.num_anchors)
    common["mask_token_id"] = tcfg.vocab_size - 1
    if kind == "dflash":
        return DrafterConfig.dflash(tcfg, **common)
    return DrafterConfig.dspark(
        tcfg, markov_rank=d.markov_rank, markov_head_type=d.markov_head_type, **common
    )


def setup(api, cfg, params, batch: int, ctx_len: int, max_len: int):
    """A jitted `propose` call on a context holding `ctx_len` positions of random features."""
    k = jax.random.key(batch)
    feats = jax.random.normal(k, (batch, ctx_len, cfg.feature_size), jnp.float32)
    nxt = jax.random.randint(k, (batch, ctx_len), 0, cfg.vocab_size - 1)
    ctx = api.init_context(cfg, batch, max_len)
    ctx = jax.jit(api.extend_context, static_argnames=("cfg",))(
        cfg, params, ctx, feats, nxt, jnp.full((batch,), ctx_len, jnp.int32)
    )
    anchor = jnp.arange(batch, dtype=jnp.int32) + 3
    seeds = jnp.arange(batch, dtype=jnp.uint32)
    rounds = jnp.zeros((batch,), jnp.int32)
    fn = jax.jit(api.propose, static_argnames=("cfg", "scfg"))
    key = jax.random.key(0)

    def call():
        return fn(cfg, params, ctx, anchor, key, seeds, None, SamplingConfig(), rounds_B=rounds)

    jax.block_until_ready(call())  # compile
    return call


def time_calls(call, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        jax.block_until_ready(call())
    return (time.perf_counter() - t0) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=BEFORE_REV)
    ap.add_argument("--kinds", default="dspark,dflash,eagle3")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ctx-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()

    tcfg = tiny.config().target.model
    tparams = transformer.init_params(tcfg, seed=0)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        api_before = load_before(args.before, tmp)
        for kind in args.kinds.split(","):
            cfg = drafter_config(kind, tcfg)
            params = drafters.init_params(cfg, target_params=tparams)
            for batch in (int(b) for b in args.batches.split(",")):
                calls = {
                    name: setup(api, cfg, params, batch, args.ctx_len, args.max_len)
                    for name, api in (("before", api_before), ("after", api_after))
                }
                pb, pa = calls["before"](), calls["after"]()
                if not np.array_equal(np.asarray(pb.tokens), np.asarray(pa.tokens)):
                    raise SystemExit(
                        f"{kind} batch {batch}: the two versions draw different tokens"
                    )
                prob_diff = float(jnp.max(jnp.abs(pb.probs - pa.probs)))
                times = {"before": [], "after": []}
                for rep in range(args.reps):
                    order = ("before", "after") if rep % 2 == 0 else ("after", "before")
                    for name in order:
                        times[name].append(time_calls(calls[name], args.calls))
                med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
                results.append(
                    dict(
                        kind=kind,
                        batch=batch,
                        before_ms=round(med["before"], 4),
                        after_ms=round(med["after"], 4),
                        after_over_before=round(med["after"] / med["before"], 3),
                        max_abs_prob_diff=prob_diff,
                    )
                )
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(
        json.dumps(
            dict(
                benchmark="proposal_layout",
                before=args.before,
                ctx_len=args.ctx_len,
                max_len=args.max_len,
                reps=args.reps,
                calls=args.calls,
                backend=jax.default_backend(),
                results=results,
            ),
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
