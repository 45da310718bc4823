"""Decode τ on the calibration split: held-out prompts that are not the evaluation prompts.

The evaluate stage's τ table decodes the evaluation prompt sets; choosing a drafter's settings by
that table would tune on them. This script decodes the run's calibration split instead (the last
regenerated conversations, which no drafter trains on; the calibrate stage decodes the same
prompts with DSpark) with each drafter at the evaluation temperature and a fixed block, over a
few sampling seeds, and prints τ = tokens / rounds per drafter and seed. Settings chosen on this
number and then reported on the evaluation table keep the two apart.

    python benchmarks/heldout_tau.py --run-dir runs/tiny [--kinds dspark,eagle3] [--seeds 12345,777]

Prints one JSON object: {"prompts": n, "temperature": T, "seeds": [...], "tau": {kind: [τ per
seed]}, "mean": {kind: τ}}. The decoding is the calibrate stage's
(`Pipeline.decode_calibration`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", default="runs/tiny")
    ap.add_argument("--kinds", default="", help="drafters, comma-separated (default: the run's)")
    ap.add_argument("--seeds", default="12345,777", help="sampling seeds, comma-separated")
    args = ap.parse_args()
    import dataclasses

    from dspark_jax import xla_cpu
    from dspark_jax.errors import ConfigError
    from dspark_jax.eval.offline import summarize
    from dspark_jax.run.cli import report, user_errors
    from dspark_jax.run.pipeline import Pipeline
    from dspark_jax.run.rundir import RunDir

    xla_cpu.unrolled_threefry()  # as train.py and serve.py decode
    try:  # a wrong run directory, a missing drafter, bad seeds: one line, first
        cfg = dataclasses.replace(RunDir(args.run_dir).config, run_dir=args.run_dir)
        kinds = [k for k in args.kinds.split(",") if k] or list(cfg.drafters.kinds)
        try:
            seeds = [int(s) for s in args.seeds.split(",") if s]
        except ValueError:
            raise ConfigError(f"--seeds {args.seeds!r} — give integers, comma-separated") from None
        if not seeds:
            raise ConfigError("--seeds is empty — give at least one integer")
        p = Pipeline(cfg, log=lambda *a, **k: None)
        for kind in kinds:
            p.drafter(kind)
        prompts = p.calibration_prompts()
    except user_errors() as err:
        return report(err)
    out = {}
    for kind in kinds:
        runs, g = p.decode_calibration(kind, prompts, seeds)
        out[kind] = [summarize(res, g)["tau"] for res in runs]
        print(f"{kind}: τ " + ", ".join(f"{t:.3f}" for t in out[kind]), file=sys.stderr)
    mean = {k: sum(v) / len(v) for k, v in out.items()}
    print(json.dumps({"prompts": len(prompts), "temperature": cfg.evaluate.temperature,
                      "seeds": seeds, "tau": out, "mean": mean}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
