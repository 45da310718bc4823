"""Choose the demo's proportions by measurement: target depth x width vs drafter depth (issue 13).

Random weights (timing only), batch 1, temperature 1, one process, every component timed once per
repetition in a shuffled order (interleaved), medians reported. For each candidate target:

* `step_ms`: one plain decode token inside `generate()`'s device loop (marginal cost of 64 more
  tokens, so prefill and dispatch are excluded);
* `verify_ms[T]`: one blocked target forward of T tokens against a filled KV cache (T = γ+1 is
  the verify forward; `--verify-sweep` adds T = 1..16);
* per drafter (DSpark with 1/2/3 backbone layers, Eagle3): `propose_ms` (γ drafts, sampled) and
  `round_ms` (a whole fused propose + verify + commit round through the host loop of
  `SpeculativeDecoder`, blocked on the round's output);
* derived: `draft_share_of_verify` = propose / verify(γ+1), `round_in_steps` = round / step,
  and `ideal_speedup` = τ · step / round at the plausible τ given by `--tau`.

    python benchmarks/demo_proportions.py [--reps 9] [--tau 3.3] [--out FILE]

Prints one JSON object. Absolute times on a shared CPU are noise; read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dspark_jax import drafters  # noqa: E402
from dspark_jax.config import DrafterConfig, TargetConfig, default_target_layer_ids  # noqa: E402
from dspark_jax.engine.speculative import SpeculativeDecoder  # noqa: E402
from dspark_jax.models import init_params  # noqa: E402
from dspark_jax.models.generate import generate  # noqa: E402
from dspark_jax.models.transformer import forward, init_cache  # noqa: E402
from dspark_jax.spec.sampling import SamplingConfig, validate_sampling_params  # noqa: E402

VOCAB = 2048
# (layers, hidden, intermediate, heads, kv heads): comparable parameter budgets in the layers
CANDIDATES = {
    "6x256": (6, 256, 512, 4, 2),
    "12x192": (12, 192, 384, 3, 1),
    "16x160": (16, 160, 320, 2, 1),
    "12x256": (12, 256, 512, 4, 2),
}


def target_config(name: str) -> TargetConfig:
    n, h, i, nh, kv = CANDIDATES[name]
    return TargetConfig(
        architecture="qwen3", vocab_size=VOCAB, hidden_size=h, intermediate_size=i,
        num_layers=n, num_heads=nh, num_kv_heads=kv, head_dim=h // nh if h // nh <= 96 else 64,
        rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=1024,
        target_layer_ids=default_target_layer_ids(n),
    )  # fmt: skip


def drafter_config(kind: str, tcfg: TargetConfig, layers: int, gamma: int) -> DrafterConfig:
    if kind == "eagle3":
        return DrafterConfig.eagle3(tcfg, block_size=gamma)
    kw = dict(block_size=gamma, num_layers=layers, num_anchors=64, mask_token_id=VOCAB - 1)
    if kind == "dflash":
        return DrafterConfig.dflash(tcfg, **kw)
    return DrafterConfig.dspark(tcfg, markov_rank=64, **kw)


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure_target(name: str, args) -> dict:
    tcfg = target_config(name)
    tp = init_params(tcfg, 0)
    g, plen = args.gamma, args.prompt_len
    prompt = [int(x) for x in jax.random.randint(jax.random.key(1), (plen,), 4, VOCAB - 1)]
    sp = validate_sampling_params(1.0, 0, 1.0, 0.0, batch_size=1)
    scfg = SamplingConfig.for_params(sp)
    seeds = jnp.zeros((1,), jnp.uint32)
    timers: dict[str, object] = {}

    def gen(n):
        return lambda: generate(
            tcfg, tp, [prompt], max_new_tokens=n, sampling={"temperature": 1.0}, seeds=[0],
            batch_buckets=(1,), length_buckets=(plen, 2 * plen),
        )  # fmt: skip

    long_n, short_n = 72, 8
    timers["gen_long"], timers["gen_short"] = gen(long_n), gen(short_n)

    # the target forward of T tokens against a cache filled with the prompt
    max_len = plen + 32
    cache = init_cache(tcfg, 1, max_len)
    pos0 = jnp.arange(plen, dtype=jnp.int32)[None]
    _, cache = jax.jit(forward, static_argnums=0)(tcfg, tp, jnp.asarray([prompt]), pos0, cache)
    fwd = jax.jit(forward, static_argnums=0)
    ts = sorted({1, 2, 4, 8, 12, 16, g + 1} if args.verify_sweep else {1, g + 1})
    for t in ts:
        toks = jnp.asarray([prompt[:t]])
        pos = plen + jnp.arange(t, dtype=jnp.int32)[None]
        timers[f"verify_T{t}"] = lambda toks=toks, pos=pos: jax.block_until_ready(
            fwd(tcfg, tp, toks, pos, cache)
        )

    rounds_cap = (args.reps + 2) * 4 * (g + 1)
    kinds = [("dspark", n) for n in args.dspark_layers] + [("eagle3", 1)]
    decs = {}
    for kind, layers in kinds:
        dcfg = drafter_config(kind, tcfg, layers, g)
        dp = drafters.init_params(dcfg, target_params=tp)
        dec = SpeculativeDecoder(
            tcfg, dcfg, tp, dp, max_len=plen + rounds_cap + g + 2, length_buckets=(plen,)
        )
        label = f"{kind}{layers}L" if kind != "eagle3" else "eagle3"
        toks = jnp.asarray([prompt])
        lens = jnp.asarray([plen], jnp.int32)

        def fresh(dec=dec, dcfg=dcfg, dp=dp, toks=toks, lens=lens):
            return dec._prefill(
                tcfg, dcfg, scfg, dec.max_len, tp, dp, toks, lens, dec.key, seeds, sp
            )

        state0 = fresh()
        decs[label] = {"state": fresh(), "n": 0}

        def propose(dec=dec, dcfg=dcfg, dp=dp, state0=state0):
            jax.block_until_ready(dec._propose(dcfg, scfg, dp, state0, dec.key, seeds, sp).tokens)

        def round_(dec=dec, dcfg=dcfg, dp=dp, label=label, fresh=fresh):
            rec = decs[label]
            if rec["n"] >= 3 * (args.reps + 2):  # keep the cache inside max_len
                rec["state"], rec["n"] = fresh(), 0
            full = jnp.full((1,), g, jnp.int32)
            st, out = dec._fused(tcfg, dcfg, scfg, tp, dp, rec["state"], full, dec.key, seeds, sp)
            out.emitted.block_until_ready()
            _ = [int(x) for x in jax.device_get(out.num_accepted)]  # the host loop's read-back
            rec["state"], rec["n"] = st, rec["n"] + 1

        timers[f"propose_{label}"] = propose
        timers[f"round_{label}"] = round_

    for fn in timers.values():  # compile + warm every program before timing
        fn()
        fn()
    samples: dict[str, list[float]] = {k: [] for k in timers}
    order = list(timers)
    rng = random.Random(0)
    for _ in range(args.reps):
        rng.shuffle(order)
        for k in order:
            samples[k].append(_time(timers[k]))
    med = {k: statistics.median(v) for k, v in samples.items()}
    step = (med["gen_long"] - med["gen_short"]) / (long_n - short_n)
    verify = med[f"verify_T{g + 1}"]
    out = {
        "target": {"layers": tcfg.num_layers, "hidden": tcfg.hidden_size,
                   "intermediate": tcfg.intermediate_size, "feature_layers": tcfg.target_layer_ids,
                   "params": int(sum(x.size for x in jax.tree.leaves(tp)))},
        "step_ms": step,
        "verify_ms": {t: med[f"verify_T{t}"] for t in ts},
        "verify_in_steps": {t: med[f"verify_T{t}"] / step for t in ts},
        "drafters": {},
    }  # fmt: skip
    for kind, layers in kinds:
        label = f"{kind}{layers}L" if kind != "eagle3" else "eagle3"
        p, r = med[f"propose_{label}"], med[f"round_{label}"]
        out["drafters"][label] = {
            "propose_ms": p,
            "round_ms": r,
            "draft_share_of_verify": p / verify,
            "draft_share_of_round": p / r,
            "round_in_steps": r / step,
            "ideal_speedup_at_tau": args.tau * step / r,
        }
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default=",".join(CANDIDATES))
    ap.add_argument("--dspark-layers", default="1,2,3")
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--tau", type=float, default=3.3)
    ap.add_argument("--verify-sweep", action="store_true", help="verify forward for T = 1..16")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    args.dspark_layers = [int(x) for x in args.dspark_layers.split(",") if x]
    t0 = time.time()
    res = {"gamma": args.gamma, "tau_assumed": args.tau, "reps": args.reps, "targets": {}}
    for name in args.targets.split(","):
        res["targets"][name] = measure_target(name, args)
    res["seconds"] = time.time() - t0
    res["load_avg_1min"] = os.getloadavg()[0]
    text = json.dumps(res, indent=1, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return res


if __name__ == "__main__":
    main()
