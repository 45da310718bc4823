"""Check a whole `PipelineConfig` and every input file before the first stage runs.

A mistake must cost seconds, never a trained stage: every field's type and range (including
fields only a late stage reads), every input file parsed (not only checked for existence), and the
cross-field limits (prompt + generation budget within the target's context). Errors are
`ConfigError` / `DataError` with one line naming the field or file and the fix.

train.py imports this module to check a configuration before jax loads; the checks that read the
input files, a checkpoint or the device mesh are in run/validate_inputs.py (they import jax).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing

from dspark_jax.compat import check_sampling
from dspark_jax.config import MARKOV_HEAD_TYPES, TargetConfig
from dspark_jax.config.pipeline import STAGES, PipelineConfig
from dspark_jax.errors import ConfigError

DRAFTER_KINDS = ("dspark", "dflash", "eagle3")

# (low, high, low_inclusive, high_inclusive); None = unbounded. Fields not listed only need their
# type (plus `_INT_MIN_DEFAULT` for ints: counts and sizes are non-negative).
_RANGES: dict[str, tuple] = {
    "keep_versions": (0, None, True, True),
    "tokenizer.vocab_size": (260, None, True, True),
    "target.train.total_steps": (1, None, True, True),
    "target.train.learning_rate": (0, None, False, True),
    "target.train.anchor_chunk": (-1, None, True, True),
    "target.vocab_multiple": (1, None, True, True),
    "target.render_windows": (1, None, True, True),
    "target.heldout_one_in": (2, None, True, True),
    "regenerate.shard_batches": (1, None, True, True),
    "regenerate.temperature": (0, None, True, True),
    "regenerate.top_p": (0, 1, False, True),
    "regenerate.max_new_tokens": (1, None, True, True),
    "regenerate.max_prompts": (1, None, True, True),
    "regenerate.batch_size": (1, None, True, True),
    "drafters.block_size": (1, None, True, True),
    "drafters.num_layers": (1, None, True, True),
    "drafters.num_anchors": (1, None, True, True),
    "drafters.train.total_steps": (1, None, True, True),
    "drafters.train.learning_rate": (0, None, False, True),
    "drafters.train.eval_interval": (1, None, True, True),
    "drafters.eval_one_in": (1, None, True, True),
    "calibrate.heldout_one_in": (1, None, True, True),
    "calibrate.max_new_tokens": (1, None, True, True),
    "evaluate.max_prompts_per_dataset": (1, None, True, True),
    "evaluate.max_new_tokens": (1, None, True, True),
    "evaluate.temperature": (0, None, True, True),
    "evaluate.batch_size": (1, None, True, True),
    "evaluate.max_len": (0, None, True, True),
    "evaluate.speed_rounds_per_call": (1, None, True, True),
    "drafters.train.anchor_chunk": (-1, None, True, True),  # -1 = all anchors at once
    "mesh.data": (-1, None, True, True),  # -1 = the devices left after fsdp x tensor
    "mesh.fsdp": (1, None, True, True),
    "mesh.tensor": (1, None, True, True),
    "data.corpus.heldout_fraction": (0, 1, True, True),
    "data.corpus.two_turn_fraction": (0, 1, True, True),
}
_NO_RANGE = {
    "target.train.seed",
    "target.train.data_seed",
    "regenerate.seed",
    "drafters.train.seed",
    "drafters.train.data_seed",
    "calibrate.seed",
    "evaluate.seed",
    "data.corpus.seed",
}
# (the TrainConfig sections check their own cross-field rules when built; their sequence
# lengths must hold a rendered sample)
_MIN_SEQ_LEN = 8


def check_stage_names(stages, force=()) -> None:
    """Every name in `--stages` / `--force` is a stage."""
    unknown = [s for s in (*stages, *force) if s not in STAGES]
    if unknown:
        raise ConfigError(f"unknown stage(s) {unknown} — stages: {', '.join(STAGES)}")


def validate_config(cfg: PipelineConfig) -> None:
    """Types and ranges of every field, then the cross-field rules."""
    _walk(cfg, "")
    d = cfg.drafters
    if not d.kinds:
        raise ConfigError(
            "drafters.kinds is empty — name at least one of " + ", ".join(DRAFTER_KINDS)
        )
    for k in d.kinds:
        if k not in DRAFTER_KINDS:
            raise ConfigError(
                f"unknown drafter kind {k!r} in drafters.kinds — use {', '.join(DRAFTER_KINDS)}"
            )
    if len(set(d.kinds)) != len(d.kinds):
        raise ConfigError(f"drafters.kinds {d.kinds} lists a drafter twice — list each once")
    if d.markov_head_type not in MARKOV_HEAD_TYPES:
        raise ConfigError(
            f"drafters.markov_head_type={d.markov_head_type!r} is unknown — use one of "
            + ", ".join(MARKOV_HEAD_TYPES)
        )
    for sec in ("target", "drafters"):
        buckets = getattr(cfg, sec).train.seq_buckets
        if min(buckets) < _MIN_SEQ_LEN:
            raise ConfigError(
                f"{sec}.train.seq_buckets={buckets} must be >= {_MIN_SEQ_LEN} tokens — raise them"
            )
    if d.markov_rank < 0:
        raise ConfigError(f"drafters.markov_rank={d.markov_rank} must be >= 0 (0 = no Markov head)")
    r, e = cfg.regenerate, cfg.evaluate
    check_sampling("regenerate.temperature/top_k/top_p", r.temperature, r.top_k, r.top_p)
    for t in (e.temperature, *e.temperatures):
        check_sampling("evaluate.temperature(s)", t)


def _walk(obj, prefix: str) -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        key = f"{prefix}{f.name}"
        v = getattr(obj, f.name)
        if isinstance(v, TargetConfig):
            continue  # TargetConfig checks itself on construction
        if dataclasses.is_dataclass(v):
            _walk(v, key + ".")
            continue
        _check_type(key, v, hints[f.name])
        _check_range(key, v)


def _check_type(key: str, v, typ) -> None:
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if v is None and type(None) in typing.get_args(typ):
            return
        typ, origin = args[0], typing.get_origin(args[0])
    if origin is tuple:
        if not isinstance(v, tuple):
            raise ConfigError(f"{key}={v!r} must be a list (e.g. --set {key}=a,b)")
        (elem, *_) = typing.get_args(typ) or (object,)
        for x in v:
            if elem is not Ellipsis and elem is not object:
                _check_type(f"{key}[]", x, elem)
        return
    ok = {
        int: isinstance(v, int) and not isinstance(v, bool),
        float: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: isinstance(v, str),
        bool: isinstance(v, bool),
    }.get(typ, True)
    if not ok:
        raise ConfigError(f"{key}={v!r} must be a {typ.__name__}")
    if typ is float and not math.isfinite(v):
        raise ConfigError(f"{key}={v!r} must be a finite number")


def _check_range(key: str, v) -> None:
    if key in _NO_RANGE or isinstance(v, (bool, str, tuple)) or v is None:
        return
    lo, hi, lo_inc, hi_inc = _RANGES.get(key, (0, None, True, True))
    bad = (lo is not None and (v < lo if lo_inc else v <= lo)) or (
        hi is not None and (v > hi if hi_inc else v >= hi)
    )
    if bad:
        lo_s = "" if lo is None else ("[" if lo_inc else "(") + str(lo)
        hi_s = "∞)" if hi is None else str(hi) + ("]" if hi_inc else ")")
        raise ConfigError(f"{key}={v!r} is out of range — use a value in {lo_s}, {hi_s}")
