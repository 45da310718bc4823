"""dspark-jax pipeline: corpus → tokenizer → target → regenerate → drafters → calibrate → evaluate.

    python train.py --config configs/tiny.py                       # the embedded demo
    python train.py --config configs/tiny.py --stages evaluate     # one stage (cached inputs)
    python train.py --config configs/qwen3_4b_dspark.py --set target.path=/models/Qwen3-4B ...
    python train.py --config ... --set mesh.fsdp=2 --set mesh.tensor=4     # the device mesh
    python train.py --config ... --coordinator host0:1234 --num-processes 2 --process-id 0
                                                          # one command per host (--process-id i)

Every stage caches its output in the run directory and resumes; `--set key=value` overrides any
config field (unknown keys are errors); the final report is `<run_dir>/evaluate/report.{md,json}`.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from dspark_jax.cli.common import report, start_runtime, user_errors
from dspark_jax.config.pipeline import STAGES, PipelineConfig, apply_overrides
from dspark_jax.errors import ConfigError
from dspark_jax.launch import add_distributed_flags, init_distributed
from dspark_jax.run.validate import check_stage_names, validate_config

# configs/ is installed beside dspark_jax/ (pyproject's packages.find), in a checkout and a wheel
PRESETS_ROOT = Path(__file__).resolve().parents[2]


def load_config(path: str) -> PipelineConfig:
    here = PRESETS_ROOT / path
    if not Path(path).is_file() and here.is_file():
        path = str(here)  # the presets in configs/ work from any directory
    if not Path(path).is_file():
        raise ConfigError(f"config file {path} not found — pass a preset such as configs/tiny.py")
    try:
        ns = runpy.run_path(path)
    except SyntaxError as e:
        raise ConfigError(f"{path}:{e.lineno}: syntax error ({e.msg}) — fix the preset") from None
    if not callable(ns.get("config")):
        raise ConfigError(f"{path} must define a function config() returning a PipelineConfig")
    cfg = ns["config"]()
    if not isinstance(cfg, PipelineConfig):
        raise ConfigError(f"{path}: config() returned {type(cfg).__name__}, not a PipelineConfig")
    return cfg


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.py", help="preset file with config()")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set drafters.train.total_steps=100 (repeatable)",
    )
    ap.add_argument("--stages", default="", help="comma-separated subset of stages to run")
    ap.add_argument("--force", default="", help="comma-separated stages to redo even if cached")
    ap.add_argument("--run-dir", default="", help="override run_dir")
    ap.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    add_distributed_flags(ap)
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        # the configuration first, before jax is imported: a mistake is reported in ~0.3 s
        cfg = load_config(args.config)
        sets = list(args.set) + ([f"run_dir={args.run_dir}"] if args.run_dir else [])
        cfg = apply_overrides(cfg, sets)
        validate_config(cfg)
        stages = tuple(s for s in args.stages.split(",") if s) or STAGES
        force = tuple(s for s in args.force.split(",") if s)
        check_stage_names(stages, force)
        # jax and the pipeline load only now (2.2-4.0 s: python -X importtime, 2-core machine),
        # for a configuration that will run
        from dspark_jax.run.pipeline import Pipeline, stage_summary

        start_runtime()  # before anything touches devices or compiles
        init_distributed(args.coordinator, args.num_processes, args.process_id, args.distributed)
        pipe = Pipeline(cfg)
        pipe.run_stages(stages, force=force)
    except user_errors() as e:
        return report(e, args.debug)
    except KeyboardInterrupt:
        print("\ninterrupted — rerun the same command to resume", file=sys.stderr)
        return 130
    print(stage_summary(pipe))
    return 0
