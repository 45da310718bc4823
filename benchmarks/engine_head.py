"""The serving engine's target form on CPU: the tied LM head run from an untied [H, V] copy and
the q|k|v / gate|up products kept separate, against the forms before, on a demo run's models, in
one process.

    python benchmarks/engine_head.py --run-dir runs/tiny [--prompts 4] [--passes 5]

Batch 1, the evaluate stage's speed protocol (as benchmarks/engine_ynn.py): the first `--prompts`
held-out prompts of every evaluation set, answered at the evaluation temperature up to its
max_new_tokens, stopping at the chat's stop ids (prefill included), by

    plain         `generate()` at batch 1 as shipped (the tied head)
    plain_untied  the same with the untied copy (whether the baseline would gain from it too)
    spec          DSpark on a 1-slot ServingEngine, 8 device-resident rounds per call, fixed γ,
                  as shipped: untied head, separate products
    spec_tied     the same engine with the tied head (`serving.untie_applies` off)
    spec_fused    untied head, fused products (`models.packed`'s `fused`, the kernels
                  concatenated once per call)
    spec_before   tied head and fused products: the engine before this change

Every variant runs every prompt once before timing (the engines' tokens compared there); then
each pass runs every prompt on every variant in turn (new seeds per pass, the same seeds for
every variant).

Prints ONE JSON object: `<variant>_ms_per_token` (wall time over tokens emitted, all passes),
`speedup` = plain / spec, `speedup_before` = plain / spec_before, `speedup_pass_min` / `_max`
(the passes' own ratios, as shipped), `head_gain` = spec_tied / spec, `unfused_gain` =
spec_fused / spec, `plain_untied_ratio` = plain_untied / plain ms per token, `round_ms` /
`round_before_ms` (wall time per round), `tokens_per_round`, `same_tokens` (the four engines
emitted the same tokens on every warm-up prompt), `prompts`, `passes`, `platform`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from unittest import mock

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if __name__ == "__main__":
    from dspark_jax.hugepages import rerun_with_hugepages

    rerun_with_hugepages()  # as train.py runs the evaluate stage (dspark_jax/hugepages.py)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dspark_jax import xla_cpu  # noqa: E402
from dspark_jax.engine import serving  # noqa: E402
from dspark_jax.models import generate as gen  # noqa: E402
from dspark_jax.models import transformer as tf  # noqa: E402


def _fail(msg: str) -> None:
    print(f"engine_head: {msg}", file=sys.stderr)
    sys.exit(1)


def _fused(eng):
    """The engine's programs rebuilt with fused products (the form before)."""
    one_set, _ = eng.verify_form
    eng.verify_form = (one_set, True)
    eng.round_fn, eng.rounds_fn = serving._round_programs(one_set, True)
    eng._jit_programs()
    return eng


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--prompts", type=int, default=4, help="per evaluation set")
    ap.add_argument("--passes", type=int, default=5)
    args = ap.parse_args()
    if args.prompts < 1 or args.passes < 1:
        _fail("--prompts and --passes must be at least 1")
    if not os.path.exists(os.path.join(args.run_dir, "evaluate", "done.json")):
        _fail(f"{args.run_dir} has no finished evaluate stage — run "
              f"`python train.py --config configs/tiny.py --run-dir {args.run_dir}` first")  # fmt: skip
    if jax.default_backend() != "cpu":
        _fail("the untied head is a CPU form (serving.untie_applies): run this on CPU")
    xla_cpu.unrolled_threefry()  # as train.py / serve.py
    from dspark_jax.run.evaluate_stage import eval_datasets
    from dspark_jax.run.pipeline import Pipeline
    from dspark_jax.run.rundir import RunDir

    run = RunDir(args.run_dir)
    p = Pipeline(dataclasses.replace(run.config, run_dir=args.run_dir), log=lambda *a, **k: None)
    e = p.cfg.evaluate
    datasets, _ = eval_datasets(p)
    prompts = [[int(x) for x in q] for ds in datasets.values() for q in ds.prompts[: args.prompts]]
    tcfg, tparams = p.target()
    if not serving.untie_applies(tcfg, tparams):
        _fail("this run's target is not run untied by the engine (an untied head, or a table "
              "over serving.UNTIE_MAX_BYTES): nothing to compare")  # fmt: skip
    ucfg, uparams = tf.untie_lm_head(tcfg, tparams)
    stop, temp, n_new = p.stop_ids(), e.temperature, e.max_new_tokens
    sampling = None if temp == 0 else {"temperature": temp}

    def speed_decoder():  # the evaluate stage's batch-1 speed decoder
        return p.rundir.decoder_for(
            "dspark", [len(q) for q in prompts], n_new, e.max_len, num_slots=1,
            rounds_per_call=e.speed_rounds_per_call,
            token_buckets=(p.cfg.drafters.block_size + 1,),
        )  # fmt: skip

    spec_eng, fused_eng = speed_decoder(), _fused(speed_decoder())
    with mock.patch.object(serving, "untie_applies", lambda *a: False):
        tied_eng, before_eng = speed_decoder(), _fused(speed_decoder())
    assert not spec_eng.tcfg.tie_word_embeddings and tied_eng.tcfg.tie_word_embeddings

    def plain_with(cfg, params):
        def f(q, seed):
            return gen.generate(cfg, params, [q], max_new_tokens=n_new, sampling=sampling,
                                stop_ids=stop, seeds=[seed])[0], 0  # fmt: skip

        return f

    def spec_with(eng):
        def f(q, seed):
            out = eng.generate([q], max_new_tokens=n_new, temperature=temp, seeds=[seed],
                               stop_ids=stop)[0]  # fmt: skip
            return out.tokens, out.stats.rounds

        return f

    variants = {
        "plain": plain_with(tcfg, tparams),
        "plain_untied": plain_with(ucfg, uparams),
        "spec": spec_with(spec_eng),
        "spec_tied": spec_with(tied_eng),
        "spec_fused": spec_with(fused_eng),
        "spec_before": spec_with(before_eng),
    }
    same = True
    for i, q in enumerate(prompts):  # compile and warm every bucket of every variant
        outs = {k: list(fn(q, i)[0]) for k, fn in variants.items()}
        same &= all(outs[k] == outs["spec"] for k in ("spec_tied", "spec_fused", "spec_before"))
    acc = {k: np.zeros((args.passes, 3)) for k in variants}  # tokens, seconds, rounds
    for k in range(args.passes):
        for i, q in enumerate(prompts):
            seed = 1000 + k * len(prompts) + i
            for name, fn in variants.items():
                t0 = time.perf_counter()
                toks, rounds = fn(q, seed)
                acc[name][k] += (len(toks), time.perf_counter() - t0, rounds)
    tot = {k: v.sum(0) for k, v in acc.items()}
    ms = {k: v[1] * 1e3 / v[0] for k, v in tot.items()}
    per_pass = [(acc["plain"][k, 1] / acc["plain"][k, 0]) / (acc["spec"][k, 1] / acc["spec"][k, 0])
                for k in range(args.passes)]  # fmt: skip
    res = {
        **{f"{k}_ms_per_token": round(v, 4) for k, v in ms.items()},
        "speedup": round(ms["plain"] / ms["spec"], 4),
        "speedup_before": round(ms["plain"] / ms["spec_before"], 4),
        "speedup_pass_min": round(min(per_pass), 4),
        "speedup_pass_max": round(max(per_pass), 4),
        "head_gain": round(ms["spec_tied"] / ms["spec"], 4),
        "unfused_gain": round(ms["spec_fused"] / ms["spec"], 4),
        "plain_untied_ratio": round(ms["plain_untied"] / ms["plain"], 4),
        "round_ms": round(tot["spec"][1] * 1e3 / tot["spec"][2], 3),
        "round_before_ms": round(tot["spec_before"][1] * 1e3 / tot["spec_before"][2], 3),
        "tokens_per_round": round(tot["spec"][0] / tot["spec"][2], 3),
        "same_tokens": bool(same),
        "prompts": len(prompts),
        "passes": args.passes,
        "platform": f"{platform.machine()} {jax.default_backend()} x{os.cpu_count()}",
    }
    print(json.dumps(res))


if __name__ == "__main__":
    main()
