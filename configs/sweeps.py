"""Depth (paper Fig. 3) and proposal-length (Fig. 4) sweeps on the demo's own target and data.

Every point runs in the demo's run directory (`runs/tiny`), so the corpus, tokenizer, target and
regenerated answers are the demo's cached stages and only drafters → calibrate → evaluate run;
the demo's own drafters are kept in `runs/tiny/previous/` and restored when the demo's
configuration runs again. Evaluation per point: the τ table at the demo's temperature (no extra
temperatures, no speed section).

    python -m configs.sweeps                 # every point, then runs/sweeps/summary.{json,md}
    python -m configs.sweeps --only depth    # or: --only gamma
    python -m configs.sweeps --run-dir /data/runs/tiny   # a demo run directory elsewhere
    python train.py --config configs/sweeps.py --set drafters.num_layers=2   # one point by hand

Points:
  depth  DSpark with 1 / 2 / 5 backbone layers, and DFlash with 5 (paper: DSpark-2L > DFlash-5L)
  gamma  DSpark and DFlash with block_size 3 / 7 / 11 / 15 (draft length 4 / 8 / 12 / 16), at the
         demo's backbone depth (2 layers; the paper uses 5)

Time (measured 2026-12-04 on 2 cores with the present settings: 128 anchor blocks, 300 steps, a
warm compilation cache): depth 16.1 min (1L, 2L, 5L, DFlash-5L), gamma 28.4 min (4 points x 2
drafters); about 45 min in all (benchmarks/results/sweeps_{depth,gamma}.json). The target and
regeneration are never redone (`--stages` is not needed: their keys do not change).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from configs.tiny import config as tiny_config

ROOT = Path(__file__).resolve().parents[1]

POINTS = {
    "depth": [
        ("dspark_1L", ["drafters.kinds=dspark", "drafters.num_layers=1"]),
        ("dspark_2L", ["drafters.kinds=dspark", "drafters.num_layers=2"]),
        ("dspark_5L", ["drafters.kinds=dspark", "drafters.num_layers=5"]),
        ("dflash_5L", ["drafters.kinds=dflash", "drafters.num_layers=5"]),
    ],
    "gamma": [
        (f"g{g}", ["drafters.kinds=dspark,dflash", f"drafters.block_size={g}"])
        for g in (3, 7, 11, 15)
    ],
}


def config():
    """The demo with the sweep's evaluation (τ table only); points differ by `--set`."""
    base = tiny_config()
    return dataclasses.replace(
        base,
        evaluate=dataclasses.replace(base.evaluate, temperatures=(), speed_prompts=0, speed_reps=0),
    )


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="depth and γ sweeps on the demo's target")
    ap.add_argument("--only", choices=sorted(POINTS), default=None)
    ap.add_argument("--out", default=str(ROOT / "runs" / "sweeps"))
    ap.add_argument("--run-dir", default=tiny_config().run_dir, help="the demo's run directory")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Path(args.run_dir)
    run = run if run.is_absolute() else ROOT / run
    summary = {}
    for sweep, points in POINTS.items():
        if args.only and sweep != args.only:
            continue
        for name, sets in points:
            cmd = [
                sys.executable,
                str(ROOT / "train.py"),
                "--config",
                __file__,
                "--run-dir",
                str(run),
            ]
            for s in sets:
                cmd += ["--set", s]
            print(f"[sweeps] {sweep}/{name}: {' '.join(sets)}", flush=True)
            subprocess.run(cmd, cwd=ROOT, check=True, env=dict(os.environ))
            rep = run / "evaluate" / "report.json"
            shutil.copy(rep, out / f"{sweep}_{name}.json")
            tau = json.loads(rep.read_text())["tau"]
            summary.setdefault(sweep, {})[name] = {
                k: {"domains": v["domains"], "macro": v["macro"]} for k, v in tau.items()
            }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = ["# Sweeps on the demo's target", ""]
    for sweep, pts in summary.items():
        lines += [f"## {sweep}", "", "| point | drafter | macro τ |", "|---|---|---|"]
        for name, rows in pts.items():
            lines += [f"| {name} | {k} | {v['macro']:.3f} |" for k, v in rows.items()]
        lines.append("")
    (out / "summary.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
