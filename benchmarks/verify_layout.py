"""The batched verify forward's two attention layouts on the demo's target, in one run.

`models.packed.packed_forward` with several slots reads the KV cache in one of two ways:
  slot_major  the queries laid out [slots, γ+1] (padding rows see no key), each slot's rows
              reading its own cache in place: attention for every slot's γ+1 rows, no copy;
  gather      every token gathers its slot's cache (T copies of cache_len keys and values per
              layer): cheap for few tokens, a copy per token for many.
The library picks slot_major when slots x (γ+1) <= `SLOT_MAJOR_PAD` x T. This times both at each
token bucket T (the tokens spread over the slots, up to γ+1 each) for a 32-slot engine with a
128-position cache bucket (the serving frontier's) and an 8-slot one with 512, random weights at
configs/tiny.py's proportions, jitted, minimum over interleaved repetitions. The cache is not
donated, so both layouts also pay the same copy of it for the K/V write (the engine donates its
state): the differences, and so the crossover, are the layouts'.

    python benchmarks/verify_layout.py [--reps 7]

Prints ONE JSON object: `points` (slots, cache_len, tokens, slot_major_ms, gather_ms, picked),
`rule_within` (the picked layout's time over the faster one's, worst point), `slot_major_pad`,
`platform`.
"""

from __future__ import annotations

import argparse
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

from dspark_jax.models import packed  # noqa: E402
from dspark_jax.models import transformer as tf  # noqa: E402

G = 8  # γ + 1 at the demo's γ = 7
GRID = ((32, 128, (1, 8, 32, 64, 128, 256)), (8, 512, (1, 8, 16, 32, 64)))


def _layout(per_slot):
    slot = np.concatenate([np.full(c, k) for k, c in enumerate(per_slot)]).astype(np.int32)
    off = np.concatenate([np.arange(c) for c in per_slot]).astype(np.int32)
    return jnp.asarray(slot), jnp.asarray(off)


def _program(tcfg, s, slot_major: bool):
    def fwd(params, cache, toks, slot, off):
        pos = cache.lengths[slot] + off
        out, _ = packed.packed_forward(tcfg, params, toks, slot, off, pos, off >= 0, cache, s,
                                       slot_tokens=G if slot_major else 0)  # fmt: skip
        return out.logits

    return jax.jit(fwd)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    import drafter_step  # the demo's models, shared with the training benchmarks

    _, tcfg, tparams, _ = drafter_step.demo_models()
    rng = np.random.default_rng(0)
    points = []
    for n, s, tokens in GRID:
        cache = tf.init_cache(tcfg, n, s).with_lengths(jnp.full((n,), s - 2 * G, jnp.int32))
        for t in tokens:
            per = [min(G, t // n + (k < t % n)) for k in range(n)]  # round-robin, <= G each
            slot, off = _layout(per)
            toks = jnp.asarray(rng.integers(5, tcfg.vocab_size, t), jnp.int32)
            a = (tparams, cache, toks, slot, off)
            progs = {}
            for name in ("slot_major", "gather"):
                saved = packed.SLOT_MAJOR_PAD
                packed.SLOT_MAJOR_PAD = 1 << 30  # trace slot_major whatever the rule
                try:
                    progs[name] = _program(tcfg, s, name == "slot_major").lower(*a).compile()
                finally:
                    packed.SLOT_MAJOR_PAD = saved
            times = {k: [] for k in progs}
            for _ in range(args.reps):
                for k, p in progs.items():
                    jax.block_until_ready(p(*a))
                    t0 = time.perf_counter()
                    for _ in range(5):
                        r = p(*a)
                    jax.block_until_ready(r)
                    times[k].append((time.perf_counter() - t0) / 5 * 1e3)
            best = {k: min(v) for k, v in times.items()}
            picked = "slot_major" if n * G <= packed.SLOT_MAJOR_PAD * t else "gather"
            points.append(dict(slots=n, cache_len=s, tokens=t, picked=picked,
                               **{f"{k}_ms": round(v, 3) for k, v in best.items()}))  # fmt: skip
            print(points[-1], file=sys.stderr, flush=True)
    within = max(p[f"{p['picked']}_ms"] / min(p["slot_major_ms"], p["gather_ms"]) for p in points)
    print(json.dumps(dict(
        points=points, rule_within=round(within, 3), slot_major_pad=packed.SLOT_MAJOR_PAD,
        platform=f"{platform.machine()} {jax.default_backend()} x{os.cpu_count()}",
    )))  # fmt: skip


if __name__ == "__main__":
    main()
