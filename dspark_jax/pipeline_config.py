"""Configuration of the end-to-end pipeline behind `train.py` (one frozen dataclass per stage).

A preset in `configs/` returns a `PipelineConfig`; `--set key.sub=value` overrides any field
through `apply_overrides`, which rejects unknown keys and values that do not parse as the
field's type.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import types
import typing
from typing import Any

from dspark_jax.config import MeshConfig, TargetConfig, TrainConfig
from dspark_jax.demo.corpus import CorpusConfig
from dspark_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DataStage:
    """Training conversations and evaluation prompts.

    By default the embedded corpus (`corpus`: stdlib code, pydoc prose, generated math) provides
    both. `conversation_files` (JSONL `{"conversations": [...]}`) replace its training chats;
    `eval_prompt_files` (DeepSpec `{"turns": [...]}` JSONL, one dataset per file, named by the
    file stem) replace its held-out prompt sets. `tfds` ("name[:split[:field]]", e.g.
    "my_chats:train") adds a prepared TensorFlow-Datasets dataset (conversations, or prompts as
    user-only conversations) read from `tfds_data_dir` (default: TFDS's own).
    """

    corpus: CorpusConfig = CorpusConfig()
    conversation_files: tuple[str, ...] = ()
    eval_prompt_files: tuple[str, ...] = ()
    tfds: str = ""
    tfds_data_dir: str = ""


@dataclasses.dataclass(frozen=True)
class TokenizerStage:
    vocab_size: int = 2048
    path: str = ""  # an existing HF tokenizer directory (skips training)


@dataclasses.dataclass(frozen=True)
class TargetStage:
    """The target LM: trained here (embedded demo) or loaded from `path` (HF checkpoint dir)."""

    path: str = ""
    # the architecture to train (vocab_size is set from the tokenizer); ignored with `path`
    model: TargetConfig = TargetConfig()
    target_layer_ids: tuple[int, ...] = ()  # with `path`: feature layers (default: DFlash rule)
    steps: int = 1500
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    warmup_frac: float = 0.05
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class RegenerateStage:
    """The target answers every training prompt itself (REFERENCE §1.2)."""

    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    max_new_tokens: int = 160
    max_prompts: int = 2000
    batch_size: int = 32
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class DrafterStage:
    kinds: tuple[str, ...] = ("dspark", "dflash", "eagle3")
    block_size: int = 7
    num_layers: int = 1
    markov_rank: int = 64
    markov_head_type: str = "vanilla"
    num_anchors: int = 64
    steps: int = 600
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    eval_every: int = 200
    seed: int = 42
    # memory plan (TrainConfig): sequences per micro-step over all devices (0 = batch_size, no
    # gradient accumulation), dtypes ("auto": bf16 on GPU/TPU, f32 on CPU), anchors per
    # rematerialized chunk (-1 = all at once)
    micro_batch_size: int = 0
    compute_dtype: str = "auto"
    target_dtype: str = "auto"
    anchor_chunk: int = -1

    def train_config(self, seed: int) -> TrainConfig:
        """The drafters stage's TrainConfig (one per drafter kind; `seed` is the drafter's)."""
        micro = self.micro_batch_size or self.batch_size
        return TrainConfig(
            learning_rate=self.lr, total_steps=self.steps, warmup_ratio=0.05,
            global_batch_size=self.batch_size, micro_batch_size=micro,
            seq_buckets=(self.seq_len,), compute_dtype=self.compute_dtype,
            target_dtype=self.target_dtype, anchor_chunk=self.anchor_chunk,
            eval_interval=self.eval_every, eval_batch_size=micro, max_eval_batches=4,
            checkpoint_interval=self.eval_every, seed=seed, pad_id=0,
            # the reference's training τ: mean over blocks of per-block survival products
            best_metric="tau",
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CalibrateStage:
    max_prompts: int = 60
    max_new_tokens: int = 96


@dataclasses.dataclass(frozen=True)
class EvalStage:
    max_prompts_per_dataset: int = 30
    max_new_tokens: int = 128
    temperature: float = 1.0
    seed: int = 980406
    batch_size: int = 8
    # prompt + generation cap; 0 = the target's context (max_position_embeddings)
    max_len: int = 0
    speed_prompts: int = 8
    # further temperatures at which the τ table is repeated (the main table, calibration, the
    # analyses and the speed section use `temperature`); e.g. (0.0,) for greedy as well
    temperatures: tuple[float, ...] = (0.0,)
    # interleaved repetitions of the speed section's component timing (0 = no breakdown)
    speed_reps: int = 7


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    name: str = "tiny"
    run_dir: str = "runs/tiny"
    # finished stage outputs replaced by a changed configuration are kept in <run>/previous/;
    # at most this many per stage (older ones are removed)
    keep_versions: int = 3
    # device mesh of every stage that trains a model (--set mesh.data=2 mesh.fsdp=2
    # mesh.tensor=2); default: all local devices data-parallel
    mesh: MeshConfig = MeshConfig()
    data: DataStage = DataStage()
    tokenizer: TokenizerStage = TokenizerStage()
    target: TargetStage = TargetStage()
    regenerate: RegenerateStage = RegenerateStage()
    drafters: DrafterStage = DrafterStage()
    calibrate: CalibrateStage = CalibrateStage()
    evaluate: EvalStage = EvalStage()

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def absolute_paths(cfg: PipelineConfig) -> PipelineConfig:
    """`cfg` with every path made absolute (against the current directory), so that the run
    directory's config.json means the same from any directory."""

    def ab(p: str) -> str:
        return os.path.abspath(os.path.expanduser(p)) if p else p

    return dataclasses.replace(
        cfg,
        run_dir=ab(cfg.run_dir),
        data=dataclasses.replace(
            cfg.data,
            conversation_files=tuple(ab(f) for f in cfg.data.conversation_files),
            eval_prompt_files=tuple(ab(f) for f in cfg.data.eval_prompt_files),
        ),
        tokenizer=dataclasses.replace(cfg.tokenizer, path=ab(cfg.tokenizer.path)),
        target=dataclasses.replace(cfg.target, path=ab(cfg.target.path)),
    )


def _parse(value: str, typ, key: str):
    origin = typing.get_origin(typ)
    if typ is str:
        return value
    if typ is bool:
        if value.lower() in ("1", "true", "yes"):
            return True
        if value.lower() in ("0", "false", "no"):
            return False
        raise ConfigError(f"--set {key}={value!r}: expected true/false")
    try:
        lit = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        lit = value
    if typ is int and isinstance(lit, int) and not isinstance(lit, bool):
        return lit
    if typ is float and isinstance(lit, (int, float)) and not isinstance(lit, bool):
        return float(lit)
    if origin is tuple:
        if isinstance(lit, str):
            lit = tuple(s for s in lit.split(",") if s)
        if isinstance(lit, (list, tuple)):
            return tuple(lit)
    raise ConfigError(f"--set {key}={value!r}: cannot parse as {typ}")


def apply_overrides(cfg, overrides: list[str]):
    """Apply `a.b.c=value` strings to a nested frozen dataclass; unknown keys are errors."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        cfg = _set_path(cfg, key.strip().split("."), value.strip(), key)
    return cfg


def _set_path(obj, parts: list[str], value: str, key: str):
    hints = typing.get_type_hints(type(obj))
    fields = {f.name for f in dataclasses.fields(obj)}
    head = parts[0]
    if head not in fields:
        raise ConfigError(
            f"unknown config key {key!r}: {type(obj).__name__} has no field {head!r} "
            f"(fields: {sorted(fields)})"
        )
    cur = getattr(obj, head)
    if len(parts) == 1:
        if dataclasses.is_dataclass(cur):
            raise ConfigError(f"{key!r} is a section; set one of its fields, e.g. {key}.<field>")
        typ = hints[head]
        if typing.get_origin(typ) in (typing.Union, __import__("types").UnionType):
            args = [a for a in typing.get_args(typ) if a is not type(None)]
            typ = args[0]
        new = _parse(value, typ, key)
    else:
        if not dataclasses.is_dataclass(cur):
            raise ConfigError(f"{key!r}: {head!r} is not a section")
        new = _set_path(cur, parts[1:], value, key)
    return dataclasses.replace(obj, **{head: new})


def from_json(cls, d: dict):
    """Rebuild a (nested) config dataclass from `dataclasses.asdict` output (run_dir/config.json)."""
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue
        v, typ = d[f.name], hints[f.name]
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        base = args[0] if typing.get_origin(typ) in (typing.Union, types.UnionType) else typ
        if dataclasses.is_dataclass(base) and isinstance(v, dict):
            v = from_json(base, v)
        elif typing.get_origin(base) is tuple and isinstance(v, list):
            v = tuple(v)
        kw[f.name] = v
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ConfigError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    return cls(**kw)
