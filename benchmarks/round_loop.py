"""Device-resident rounds: a plain decode step vs a speculative round, one round per jitted call
(K = 1, the host between rounds) vs K rounds per call (`ServingEngine(rounds_per_call=K)`).

    python benchmarks/round_loop.py [--batch 1 8] [--ks 1 2 4 8 16] [--out results/round_loop.json]
    python benchmarks/round_loop.py --smoke   # seconds: the same path and keys; the tiny test
                                              # target, γ = 2, batch 1, K in {1, 2}, short
                                              # prompts (the JSON to a temporary file)

Random weights at `configs/tiny.py`'s proportions (target 16 x 160, V = 2048, 1-layer DSpark,
γ = 7; timing does not depend on the weights), greedy, fixed γ. Per batch size B:

* `plain_step_ms`: one token of `models.generate.generate`'s device loop, from the difference of
  two generation lengths (prefill cancels out);
* `round_ms[K]`: one speculative round of the serving engine at K rounds per call, from the
  difference of two generation lengths (same cache bucket); every time is the minimum over
  interleaved repetitions (other processes on a shared CPU only ever add time);
* `host_share_k1`: (round at K=1 - round at the best K) / round at K=1, the host's share of a
  one-round call (dispatch, device->host read, bookkeeping);
* `verify_fwd_ms` / `propose_ms`: the packed verify forward (T = 8 B) and the drafter's proposal
  alone, and `draft_share` = propose / round at the best K;
* `ideal_speedup_at_tau`: τ · plain_step / round for the demo's τ values;
* `prefill_ms`: one 64-token prompt chunk attending over a 128-position cache bucket vs the
  whole 1024-position slot (item 1: bounded prefill attention);
* `dispatch_ms`: one jitted call with a round's arguments (a no-op), the params as the engine
  passes them (`flat`: `engine.flat.FlatParams`, flattened once) vs as `nnx.State`s (flattened
  in Python on every call, one call per variable);
* `retraces_after_warmup`: compilations during the timed part (must be 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import drafters
from dspark_jax.config import DrafterConfig, TargetConfig, default_target_layer_ids
from dspark_jax.engine import RequestParams, ServingEngine
from dspark_jax.engine import device as dev
from dspark_jax.engine.device import PrefillInputs
from dspark_jax.models import transformer as tf
from dspark_jax.models.generate import generate
from dspark_jax.testing import smoke_models

TAUS = (2.5, 3.34, 4.0)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Prompt, the two generation lengths, the engines' max_len and cache buckets, the cache
    the components are timed at, the prefill benchmark's slot and cache buckets."""

    prompt: int = 64
    short: int = 48
    long: int = 176
    max_len: int = 512
    caches: tuple[int, ...] = (128, 256, 512)
    component_cache: int = 256
    prefill_caches: tuple[int, ...] = (128, 1024)


SMOKE = Sizes(prompt=16, short=4, long=12, max_len=64, caches=(32, 64), component_cache=32,
              prefill_caches=(32, 64))  # fmt: skip


def models():
    tcfg = TargetConfig(
        architecture="qwen3", vocab_size=2048, hidden_size=160, intermediate_size=320,
        num_layers=16, num_heads=2, num_kv_heads=1, head_dim=80, rope_theta=1e6,
        tie_word_embeddings=True, max_position_embeddings=1024,
        target_layer_ids=default_target_layer_ids(16),
    )  # fmt: skip
    tp = tf.init_params(tcfg, 0)
    dcfg = DrafterConfig.dspark(
        tcfg, num_layers=1, block_size=7, markov_rank=64, mask_token_id=2047
    )
    dp = drafters.init_params(dcfg, seed=1, target_params=tp)
    return tcfg, tp, dcfg, dp


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _min_ms(fn, reps) -> float:
    fn()
    return 1e3 * min(_timed(fn) for _ in range(reps))


# the components (`_components`, `bench_prefill`, `bench_dispatch`) call the slot layout's device
# programs directly, so every engine here is a slot engine
LAYOUT = "slots"


def _components(eng, tcfg, tp, dcfg, dp, b, reps, sz: Sizes):
    """(verify forward ms, proposal ms) of a round on the engine's state after a prefill, drafts
    verified in full."""
    state = eng.programs.state
    lengths = jnp.full((b,), dcfg.block_size, jnp.int32)
    active = jnp.ones((b,), bool)
    fwd = jax.jit(dev.verify_forward, static_argnums=(0, 1, 2, 3))
    t_fwd = b * (dcfg.block_size + 1)
    verify_ms = _min_ms(
        lambda: jax.block_until_ready(
            fwd(tcfg, dcfg, t_fwd, sz.component_cache, tp, state, lengths, active)[0]
        ),
        reps * 3,
    )
    seeds = jnp.zeros((b,), jnp.uint32)
    prop = jax.jit(drafters.propose, static_argnames=("cfg", "scfg"))
    from dspark_jax.spec.sampling import SamplingConfig

    g1 = SamplingConfig(greedy=True)
    propose_ms = _min_ms(
        lambda: jax.block_until_ready(
            prop(dcfg, dp, state.ctx, state.anchor, eng.programs.key, seeds, None, g1,
                 rounds_B=state.rounds).tokens
        ),
        reps * 3,
    )  # fmt: skip
    return verify_ms, propose_ms


def bench_batch(tcfg, tp, dcfg, dp, b, ks, reps, sz: Sizes = Sizes()):
    rng = np.random.default_rng(b)
    prompts = [rng.integers(0, tcfg.vocab_size - 1, sz.prompt).tolist() for _ in range(b)]
    engines = {}
    for k in ks:
        eng = ServingEngine(
            tcfg, dcfg, tp, dp, num_slots=b, max_len=sz.max_len, prompt_buckets=(sz.prompt,),
            cache_buckets=sz.caches, token_buckets=(b * (dcfg.block_size + 1),),
            modes=("greedy",), rounds_per_call=k, kv_layout=LAYOUT,
        )  # fmt: skip
        eng.warmup()
        engines[k] = eng

    def spec(k, n):
        eng = engines[k]
        r0 = eng.metrics().rounds
        eng.generate(prompts, RequestParams(n, temperature=0.0))
        return eng.metrics().rounds - r0

    def plain(n):
        jax.block_until_ready(
            generate(tcfg, tp, prompts, max_new_tokens=n, length_buckets=(sz.max_len,))
        )

    short, long = sz.short, sz.long
    for n in (short, long):  # warm: compile everything before timing
        plain(n)
        for k in ks:
            spec(k, n)
    comp0 = sum(e.compilations for e in engines.values())
    rec = {("plain", n): [] for n in (short, long)}
    rounds = {}
    for _ in range(reps):  # interleaved repetitions
        for n in (short, long):
            rec[("plain", n)].append(_timed(lambda n=n: plain(n)))
            for k in ks:
                t0 = time.perf_counter()
                rounds[(k, n)] = spec(k, n)
                rec.setdefault((k, n), []).append(time.perf_counter() - t0)
    retraces = sum(e.compilations for e in engines.values()) - comp0
    # the minimum over repetitions: on a shared CPU other processes only ever add time
    med = {key: min(v) for key, v in rec.items()}
    step = 1e3 * (med[("plain", long)] - med[("plain", short)]) / (long - short)
    round_ms = {
        k: 1e3 * (med[(k, long)] - med[(k, short)]) / max(rounds[(k, long)] - rounds[(k, short)], 1)
        for k in ks
    }
    best = min(round_ms, key=round_ms.get)

    verify_ms, propose_ms = _components(engines[ks[0]], tcfg, tp, dcfg, dp, b, reps, sz)
    return {
        "batch": b,
        "plain_step_ms": step,
        "round_ms": {str(k): v for k, v in round_ms.items()},
        "best_k": best,
        "round_over_step_k1": round_ms[ks[0]] / step,
        "round_over_step_best": round_ms[best] / step,
        "host_share_k1": (round_ms[ks[0]] - round_ms[best]) / round_ms[ks[0]],
        "verify_fwd_ms": verify_ms,
        "propose_ms": propose_ms,
        "draft_share": propose_ms / round_ms[best],
        "ideal_speedup_at_tau": {
            str(t): {"k1": t * step / round_ms[ks[0]], "best": t * step / round_ms[best]}
            for t in TAUS
        },
        "retraces_after_warmup": retraces,
    }


def bench_prefill(tcfg, tp, dcfg, dp, reps, sz: Sizes = Sizes()):
    eng = ServingEngine(
        tcfg, dcfg, tp, dp, num_slots=1, max_len=sz.prefill_caches[-1],
        prompt_buckets=(sz.prompt,), cache_buckets=sz.prefill_caches, modes=("greedy",),
        kv_layout=LAYOUT,
    )  # fmt: skip
    toks = np.arange(sz.prompt, dtype=np.int32) % min(2000, tcfg.vocab_size - 1)
    out = {}
    for s in sz.prefill_caches:

        def run(s=s):
            inputs = PrefillInputs(
                np.int32(0),
                toks,
                toks,
                np.int32(0),
                np.int32(sz.prompt),
                np.bool_(True),
                np.uint32(0),
                None,
                eng.programs.key,
            )
            first, _ = eng.programs.step_prefill(inputs, mode="greedy", cache_len=s)
            jax.block_until_ready(first)

        out[str(s)] = _min_ms(run, reps * 3)
    return {"prompt": sz.prompt, "cache_len_ms": out}


def bench_dispatch(tcfg, tp, dcfg, dp, reps, sz: Sizes = Sizes()):
    """One jitted call's dispatch with a round's arguments (a no-op, blocked): the params as
    the engine passes them (`EnginePrograms.params`, flattened once) vs as `nnx.State`s."""
    from dspark_jax.eval.speed import _noop

    eng = ServingEngine(tcfg, dcfg, tp, dp, num_slots=1, max_len=sz.max_len, modes=("greedy",),
                        kv_layout=LAYOUT)  # fmt: skip
    out = {}
    for name, (a, b) in (("flat", eng.programs.params), ("nnx_state", (tp, dp))):
        run = lambda a=a, b=b: jax.block_until_ready(_noop(a, b, eng.programs.state))
        out[name] = _min_ms(lambda run=run: [run() for _ in range(100)], reps) / 100
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--ks", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="seconds-sized run, the same keys")
    args = ap.parse_args(argv)
    sz, model = (
        Sizes(),
        "tiny proportions, random weights (target 16x160, V=2048, DSpark 1 layer, γ=7)",
    )
    if args.smoke:
        args.batch, args.ks, args.reps = [1], [1, 2], 1
        sz, model = (
            SMOKE,
            "testing.smoke_models: tiny target (4x64, V=256), DSpark 1 layer, γ=2, random",
        )
        args.out = args.out or os.path.join(tempfile.mkdtemp(prefix="round_loop_"), "out.json")
    args.out = args.out or os.path.join(os.path.dirname(__file__), "results", "round_loop.json")
    ks = sorted(set(args.ks) | {1})
    tcfg, tp, dcfg, dp = smoke_models() if args.smoke else models()
    result = {
        "model": model,
        "devices": str(jax.devices()[0]),
        "prefill": bench_prefill(tcfg, tp, dcfg, dp, args.reps, sz),
        "dispatch_ms": bench_dispatch(tcfg, tp, dcfg, dp, args.reps, sz),
        "batches": [bench_batch(tcfg, tp, dcfg, dp, b, ks, args.reps, sz) for b in args.batch],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
