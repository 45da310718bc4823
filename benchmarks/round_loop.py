"""Device-resident rounds: a plain decode step vs a speculative round, one round per jitted call
(K = 1, the host between rounds) vs K rounds per call (`ServingEngine(rounds_per_call=K)`).

    python benchmarks/round_loop.py [--batch 1 8] [--ks 1 2 4 8 16] [--out results/round_loop.json]

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
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dspark_jax import drafters  # noqa: E402
from dspark_jax.config import DrafterConfig, TargetConfig, default_target_layer_ids  # noqa: E402
from dspark_jax.engine import RequestParams, ServingEngine  # noqa: E402
from dspark_jax.engine import device as dev  # noqa: E402
from dspark_jax.engine.device import PrefillInputs  # noqa: E402
from dspark_jax.models import transformer as tf  # noqa: E402
from dspark_jax.models.generate import generate  # noqa: E402

PROMPT, SHORT, LONG, MAX_LEN = 64, 48, 176, 512
TAUS = (2.5, 3.34, 4.0)


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


def _components(eng, tcfg, tp, dcfg, dp, b, reps):
    """(verify forward ms, proposal ms) of a round on the engine's state after a prefill, drafts
    verified in full."""
    state = eng.programs.state
    lengths = jnp.full((b,), dcfg.block_size, jnp.int32)
    active = jnp.ones((b,), bool)
    fwd = jax.jit(dev.verify_forward, static_argnums=(0, 1, 2, 3))
    t_fwd = b * (dcfg.block_size + 1)
    verify_ms = _min_ms(
        lambda: jax.block_until_ready(fwd(tcfg, dcfg, t_fwd, 256, tp, state, lengths, active)[0]),
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


def bench_batch(tcfg, tp, dcfg, dp, b, ks, reps):
    rng = np.random.default_rng(b)
    prompts = [rng.integers(0, 2047, PROMPT).tolist() for _ in range(b)]
    engines = {}
    for k in ks:
        eng = ServingEngine(
            tcfg, dcfg, tp, dp, num_slots=b, max_len=MAX_LEN, prompt_buckets=(PROMPT,),
            cache_buckets=(128, 256, MAX_LEN), token_buckets=(b * (dcfg.block_size + 1),),
            modes=("greedy",), rounds_per_call=k,
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
            generate(tcfg, tp, prompts, max_new_tokens=n, length_buckets=(MAX_LEN,))
        )

    for n in (SHORT, LONG):  # warm: compile everything before timing
        plain(n)
        for k in ks:
            spec(k, n)
    comp0 = sum(e.compilations for e in engines.values())
    rec = {("plain", n): [] for n in (SHORT, LONG)}
    rounds = {}
    for _ in range(reps):  # interleaved repetitions
        for n in (SHORT, LONG):
            rec[("plain", n)].append(_timed(lambda n=n: plain(n)))
            for k in ks:
                t0 = time.perf_counter()
                rounds[(k, n)] = spec(k, n)
                rec.setdefault((k, n), []).append(time.perf_counter() - t0)
    retraces = sum(e.compilations for e in engines.values()) - comp0
    # the minimum over repetitions: on a shared CPU other processes only ever add time
    med = {key: min(v) for key, v in rec.items()}
    step = 1e3 * (med[("plain", LONG)] - med[("plain", SHORT)]) / (LONG - SHORT)
    round_ms = {
        k: 1e3 * (med[(k, LONG)] - med[(k, SHORT)]) / (rounds[(k, LONG)] - rounds[(k, SHORT)])
        for k in ks
    }
    best = min(round_ms, key=round_ms.get)

    verify_ms, propose_ms = _components(engines[ks[0]], tcfg, tp, dcfg, dp, b, reps)
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


def bench_prefill(tcfg, tp, dcfg, dp, reps):
    eng = ServingEngine(
        tcfg, dcfg, tp, dp, num_slots=1, max_len=1024, prompt_buckets=(PROMPT,),
        cache_buckets=(128, 1024), modes=("greedy",),
    )  # fmt: skip
    toks = np.arange(PROMPT, dtype=np.int32) % 2000
    out = {}
    for s in (128, 1024):

        def run(s=s):
            inputs = PrefillInputs(
                np.int32(0),
                toks,
                toks,
                np.int32(0),
                np.int32(PROMPT),
                np.bool_(True),
                np.uint32(0),
                None,
                eng.programs.key,
            )
            first, _ = eng.programs.step_prefill(inputs, mode="greedy", cache_len=s)
            jax.block_until_ready(first)

        out[str(s)] = _min_ms(run, reps * 3)
    return {"prompt": PROMPT, "cache_len_ms": out}


def bench_dispatch(tcfg, tp, dcfg, dp, reps):
    """One jitted call's dispatch with a round's arguments (a no-op, blocked): the params as
    the engine passes them (`EnginePrograms.params`, flattened once) vs as `nnx.State`s."""
    from dspark_jax.eval.speed import _noop

    eng = ServingEngine(tcfg, dcfg, tp, dp, num_slots=1, max_len=MAX_LEN, modes=("greedy",))
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
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "round_loop.json"))  # fmt: skip
    args = ap.parse_args(argv)
    ks = sorted(set(args.ks) | {1})
    tcfg, tp, dcfg, dp = models()
    result = {
        "model": "tiny proportions, random weights (target 16x160, V=2048, DSpark 1 layer, γ=7)",
        "devices": str(jax.devices()[0]),
        "prefill": bench_prefill(tcfg, tp, dcfg, dp, args.reps),
        "dispatch_ms": bench_dispatch(tcfg, tp, dcfg, dp, args.reps),
        "batches": [bench_batch(tcfg, tp, dcfg, dp, b, ks, args.reps) for b in args.batch],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
