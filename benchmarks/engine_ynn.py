"""The serving engine's XLA:CPU option (`xla_cpu.engine_compiler_options`: no YNNPACK fusion)
against XLA's default, and batch-1 plain decoding's prefill in its own program against the one
program it was before, on a demo run's models, in one process.

    python benchmarks/engine_ynn.py --run-dir runs/tiny [--prompts 4] [--passes 5]

Batch 1, the evaluate stage's speed protocol: the first `--prompts` held-out prompts of every
evaluation set, answered at the evaluation temperature up to its max_new_tokens, stopping at the
chat's stop ids (prefill included), by

    plain          `generate()` at batch 1 as shipped: prefill with the engine's option, the
                   decode loop with the batch-1 option (two programs)
    plain_one      the form before: prefill and loop in one program with the batch-1 option
    spec           DSpark on a 1-slot ServingEngine, 8 device-resident rounds per call, fixed γ
                   (the evaluate stage's speed decoder), compiled with the engine's option
    spec_default   the same engine compiled with XLA's default (the form before)

Every variant runs every prompt once before timing; then each pass runs every prompt on every
variant in turn (new seeds per pass, the same seeds for every variant). Then at 8 slots: the
evaluate stage's DSpark decoder (host-scheduled rounds) over the same prompts in batches of 8,
with the option and with XLA's default, alternated, `--passes` times.

Prints ONE JSON object: `<variant>_ms_per_token` (wall time over tokens emitted, all passes),
`speedup` = plain / spec ms per token (as shipped), `speedup_before` = plain_one / spec_default,
`speedup_pass_min` / `speedup_pass_max` (the passes' own ratios), `engine_option_gain` =
spec_default / spec, `prefill_split_gain` = plain_one / plain, `round_ms` / `round_default_ms`
(speculative wall time per round), `tokens_per_round`, `slots8_s` / `slots8_default_s` (medians)
and `slots8_gain`, `prompts`, `passes`, `platform`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
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
from dspark_jax.models import decoding  # noqa: E402
from dspark_jax.models import generate as gen  # noqa: E402


def _fail(msg: str) -> None:
    print(f"engine_ynn: {msg}", file=sys.stderr)
    sys.exit(1)


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
    if xla_cpu.engine_compiler_options() is None:
        _fail("the engine's XLA:CPU option does not apply here (not CPU, an unchecked jaxlib, "
              f"{xla_cpu.ENV}=off or the option in XLA_FLAGS): nothing to compare")  # fmt: skip
    xla_cpu.unrolled_threefry()  # as train.py / serve.py
    from dspark_jax.run.evaluate_stage import eval_datasets, eval_decoder
    from dspark_jax.run.pipeline import Pipeline
    from dspark_jax.run.rundir import RunDir

    run = RunDir(args.run_dir)
    p = Pipeline(dataclasses.replace(run.config, run_dir=args.run_dir), log=lambda *a, **k: None)
    e = p.cfg.evaluate
    datasets, _ = eval_datasets(p)
    prompts = [[int(x) for x in q] for ds in datasets.values() for q in ds.prompts[: args.prompts]]
    longest = max(len(q) for ds in datasets.values() for q in ds.prompts)
    tcfg, tparams = p.target()
    stop, temp, n_new = p.stop_ids(), e.temperature, e.max_new_tokens
    sampling = None if temp == 0 else {"temperature": temp}

    def speed_decoder():  # the evaluate stage's batch-1 speed decoder
        return p.rundir.decoder_for(
            "dspark", [len(q) for q in prompts], n_new, e.max_len, num_slots=1,
            rounds_per_call=e.speed_rounds_per_call,
            token_buckets=(p.cfg.drafters.block_size + 1,),
        )  # fmt: skip

    spec_eng = speed_decoder()
    with mock.patch.object(serving, "engine_compiler_options", lambda: None):
        spec_default_eng = speed_decoder()
    one = jax.jit(decoding._generate, static_argnames=("cfg", "scfg", "cache_len"),
                  compiler_options=xla_cpu.batch1_decode_compiler_options())  # fmt: skip

    def plain(q, seed):
        return gen.generate(tcfg, tparams, [q], max_new_tokens=n_new, sampling=sampling,
                            stop_ids=stop, seeds=[seed])[0], 0  # fmt: skip

    def plain_one(q, seed):
        with (
            mock.patch.object(gen, "_batch1_programs", lambda: None),
            mock.patch.object(gen, "generate_jit", one),
        ):
            return plain(q, seed)

    def spec_with(eng):
        def f(q, seed):
            out = eng.generate([q], max_new_tokens=n_new, temperature=temp, seeds=[seed],
                               stop_ids=stop)[0]  # fmt: skip
            return out.tokens, out.stats.rounds

        return f

    variants = {"plain": plain, "plain_one": plain_one, "spec": spec_with(spec_eng),
                "spec_default": spec_with(spec_default_eng)}  # fmt: skip
    for i, q in enumerate(prompts):  # compile and warm every bucket of every variant
        for fn in variants.values():
            fn(q, i)
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

    # 8 slots: the evaluate stage's decoder, host-scheduled rounds
    dec8 = eval_decoder(p, "dspark", longest)
    with mock.patch.object(serving, "engine_compiler_options", lambda: None):
        dec8_default = eval_decoder(p, "dspark", longest)
    b = dec8.num_slots

    def batches(dec):
        t0 = time.perf_counter()
        for s in range(0, len(prompts), b):
            dec.generate(prompts[s : s + b], max_new_tokens=n_new, temperature=temp,
                         seeds=list(range(s, s + b))[: len(prompts[s : s + b])], stop_ids=stop)  # fmt: skip
        return time.perf_counter() - t0

    batches(dec8), batches(dec8_default)
    t8 = {"option": [], "default": []}
    for _ in range(args.passes):
        t8["option"].append(batches(dec8))
        t8["default"].append(batches(dec8_default))
    s8, s8d = statistics.median(t8["option"]), statistics.median(t8["default"])
    res = {
        **{f"{k}_ms_per_token": round(v, 4) for k, v in ms.items()},
        "speedup": round(ms["plain"] / ms["spec"], 4),
        "speedup_before": round(ms["plain_one"] / ms["spec_default"], 4),
        "speedup_pass_min": round(min(per_pass), 4),
        "speedup_pass_max": round(max(per_pass), 4),
        "engine_option_gain": round(ms["spec_default"] / ms["spec"], 4),
        "prefill_split_gain": round(ms["plain_one"] / ms["plain"], 4),
        "round_ms": round(tot["spec"][1] * 1e3 / tot["spec"][2], 3),
        "round_default_ms": round(tot["spec_default"][1] * 1e3 / tot["spec_default"][2], 3),
        "tokens_per_round": round(tot["spec"][0] / tot["spec"][2], 3),
        "slots": b,
        "slots8_s": round(s8, 3),
        "slots8_default_s": round(s8d, 3),
        "slots8_gain": round(s8d / s8, 4),
        "prompts": len(prompts),
        "passes": args.passes,
        "platform": f"{platform.machine()} {jax.default_backend()} x{os.cpu_count()}",
    }
    print(json.dumps(res))


if __name__ == "__main__":
    main()
