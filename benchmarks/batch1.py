"""The evaluate stage's batch-1 speed protocol on a demo run's models, shared by the benchmarks
that compare forms of plain / speculative decoding in one process (engine_ynn.py,
engine_head.py).

    b = Batch1.from_args(args, "engine_head")   # refuses, one line and rc 1, before any work
    variants = {"plain": b.plain(), "spec": b.spec(b.speed_decoder())}
    acc, same = b.run(variants, compare=("spec", ...))

The first `--prompts` held-out prompts of every evaluation set, answered at the evaluation
temperature up to its max_new_tokens, stopping at the chat's stop ids (prefill included). Every
variant runs every prompt once before timing; then each pass runs every prompt on every variant
in turn (new seeds per pass, the same seeds for every variant).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time

import jax
import numpy as np

from dspark_jax import xla_cpu
from dspark_jax.models import generate as gen


def parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--prompts", type=int, default=4, help="per evaluation set")
    ap.add_argument("--passes", type=int, default=5)
    return ap


def fail(name: str, msg: str) -> None:
    print(f"{name}: {msg}", file=sys.stderr)
    sys.exit(1)


@dataclasses.dataclass
class Batch1:
    pipeline: object
    prompts: list
    tcfg: object
    tparams: object
    passes: int
    longest: int  # the longest prompt of every evaluation set (not only those timed)

    @classmethod
    def check(cls, args, name: str) -> None:
        """The checks that need no work: counts, a finished run."""
        if args.prompts < 1 or args.passes < 1:
            fail(name, "--prompts and --passes must be at least 1")
        if not os.path.exists(os.path.join(args.run_dir, "evaluate", "done.json")):
            fail(name, f"{args.run_dir} has no finished evaluate stage — run "
                 f"`python train.py --config configs/tiny.py --run-dir {args.run_dir}` first")  # fmt: skip

    @classmethod
    def load(cls, args) -> Batch1:
        xla_cpu.unrolled_threefry()  # as train.py / serve.py
        from dspark_jax.run.evaluate_stage import eval_datasets
        from dspark_jax.run.pipeline import Pipeline
        from dspark_jax.run.rundir import RunDir

        run = RunDir(args.run_dir)
        cfg = dataclasses.replace(run.config, run_dir=args.run_dir)
        p = Pipeline(cfg, log=lambda *a, **k: None)
        datasets, _ = eval_datasets(p)
        prompts = [
            [int(x) for x in q] for ds in datasets.values() for q in ds.prompts[: args.prompts]
        ]
        longest = max(len(q) for ds in datasets.values() for q in ds.prompts)
        tcfg, tparams = p.target()
        return cls(p, prompts, tcfg, tparams, args.passes, longest)

    @property
    def eval_cfg(self):
        return self.pipeline.cfg.evaluate

    def speed_decoder(self):
        """The evaluate stage's batch-1 speed decoder (DSpark, 1 slot, K rounds per call)."""
        e, p = self.eval_cfg, self.pipeline
        return p.rundir.decoder_for(
            "dspark", [len(q) for q in self.prompts], e.max_new_tokens, e.max_len, num_slots=1,
            rounds_per_call=e.speed_rounds_per_call,
            token_buckets=(p.cfg.drafters.block_size + 1,),
        )  # fmt: skip

    def plain(self, cfg=None, params=None):
        """Plain `generate()` at batch 1 (the run's target unless given)."""
        e, stop = self.eval_cfg, self.pipeline.stop_ids()
        cfg = self.tcfg if cfg is None else cfg
        params = self.tparams if params is None else params
        sampling = None if e.temperature == 0 else {"temperature": e.temperature}

        def f(q, seed):
            return gen.generate(cfg, params, [q], max_new_tokens=e.max_new_tokens,
                                sampling=sampling, stop_ids=stop, seeds=[seed])[0], 0  # fmt: skip

        return f

    def spec(self, eng):
        e, stop = self.eval_cfg, self.pipeline.stop_ids()

        def f(q, seed):
            out = eng.generate([q], max_new_tokens=e.max_new_tokens, temperature=e.temperature,
                               seeds=[seed], stop_ids=stop)[0]  # fmt: skip
            return out.tokens, out.stats.rounds

        return f

    def run(self, variants: dict, compare=()) -> tuple[dict, bool]:
        """Warm every variant on every prompt (the `compare` variants' tokens checked equal
        there), then the timed passes: {variant: [passes, 3] (tokens, seconds, rounds)}, same."""
        same = True
        for i, q in enumerate(self.prompts):
            outs = {k: list(fn(q, i)[0]) for k, fn in variants.items()}
            same &= all(outs[k] == outs[compare[0]] for k in compare)
        acc = {k: np.zeros((self.passes, 3)) for k in variants}
        for k in range(self.passes):
            for i, q in enumerate(self.prompts):
                seed = 1000 + k * len(self.prompts) + i
                for name, fn in variants.items():
                    t0 = time.perf_counter()
                    toks, rounds = fn(q, seed)
                    acc[name][k] += (len(toks), time.perf_counter() - t0, rounds)
        return acc, same


def summary(acc: dict, plain: str = "plain", spec: str = "spec") -> dict:
    """The keys every batch-1 benchmark prints: `<variant>_ms_per_token`, `speedup` (plain /
    spec ms per token), `speedup_pass_min` / `_max` (the passes' own ratios), `round_ms` and
    `tokens_per_round` (spec), `prompts` (per pass), `passes`, `platform`."""
    ms, per_pass, tot = ms_per_token(acc), pass_ratios(acc, plain, spec), acc[spec].sum(0)
    return {
        **{f"{k}_ms_per_token": round(v, 4) for k, v in ms.items()},
        "speedup": round(ms[plain] / ms[spec], 4),
        "speedup_pass_min": round(min(per_pass), 4),
        "speedup_pass_max": round(max(per_pass), 4),
        "round_ms": round(round_ms(acc, spec), 3),
        "tokens_per_round": round(tot[0] / tot[2], 3),
        "passes": acc[spec].shape[0],
        "platform": f"{platform.machine()} {jax.default_backend()} x{os.cpu_count()}",
    }


def ms_per_token(acc: dict) -> dict:
    return {k: v[:, 1].sum() * 1e3 / v[:, 0].sum() for k, v in acc.items()}


def pass_ratios(acc: dict, base: str, other: str) -> list[float]:
    """Each pass's own base / other ms-per-token ratio."""
    a, b = acc[base], acc[other]
    return [(a[k, 1] / a[k, 0]) / (b[k, 1] / b[k, 0]) for k in range(a.shape[0])]


def round_ms(acc: dict, name: str) -> float:
    v = acc[name].sum(0)
    return v[1] * 1e3 / v[2]
