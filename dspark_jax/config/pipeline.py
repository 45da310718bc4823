"""Configuration of the end-to-end pipeline behind `train.py` (one frozen dataclass per stage).

A preset in `configs/` returns a `PipelineConfig`; `--set key.sub=value` overrides any field
through `apply_overrides`, which rejects unknown keys and values that do not parse as the
field's type. The stages that train hold the library's `TrainConfig` (`target.train`,
`drafters.train`: `--set drafters.train.learning_rate=1e-3`), not copies of its fields.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import typing
from typing import Any

from dspark_jax.config.base import MeshConfig, from_json
from dspark_jax.config.corpus import CorpusConfig
from dspark_jax.config.target import TargetConfig
from dspark_jax.config.train import TrainConfig
from dspark_jax.errors import ConfigError

# the pipeline's stages, in order (train.py --stages / --force name them)
STAGES = ("corpus", "tokenizer", "target", "regenerate", "drafters", "calibrate", "evaluate")


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


# The embedded target's LM training (train/lm.py reads: learning_rate, warmup_ratio, total_steps,
# weight_decay and the other optimizer fields, global_batch_size, windows of max(seq_buckets)
# tokens, seed, checkpoint_interval, log_interval, max_eval_batches held-out batches).
TARGET_TRAIN = TrainConfig(
    learning_rate=3e-3, warmup_ratio=0.05, total_steps=1500, weight_decay=0.01,
    global_batch_size=16, micro_batch_size=16, seq_buckets=(256,), seed=0,
    checkpoint_interval=200, log_interval=20, max_eval_batches=4,
)  # fmt: skip

# The drafters' training (one Trainer per drafter kind; `seed` also initializes the drafter).
DRAFTER_TRAIN = TrainConfig(
    learning_rate=3e-3, warmup_ratio=0.05, total_steps=600, global_batch_size=8,
    micro_batch_size=8, seq_buckets=(256,), eval_interval=200, eval_batch_size=8,
    max_eval_batches=4, checkpoint_interval=200, seed=42, pad_id=0,
    # the reference's training τ: mean over blocks of per-block survival products
    best_metric="tau",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TargetStage:
    """The target LM: trained here (embedded demo) or loaded from `path` (HF checkpoint dir).

    Training the embedded target: `train` (TARGET_TRAIN), on conversations rendered up to
    `render_windows` x max(train.seq_buckets) tokens with >= `min_loss_tokens` supervised ones,
    one in `heldout_one_in` held out (split seeded by train.seed); the vocabulary is the
    tokenizer's rounded up to a multiple of `vocab_multiple`.
    """

    path: str = ""
    # the architecture to train (vocab_size is set from the tokenizer); ignored with `path`
    model: TargetConfig = TargetConfig()
    target_layer_ids: tuple[int, ...] = ()  # with `path`: feature layers (default: DFlash rule)
    train: TrainConfig = TARGET_TRAIN
    vocab_multiple: int = 64
    render_windows: int = 4
    min_loss_tokens: int = 1
    heldout_one_in: int = 50


@dataclasses.dataclass(frozen=True)
class RegenerateStage:
    """The target answers every training prompt itself (docs/METHOD.md §1.2)."""

    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    max_new_tokens: int = 160
    max_prompts: int = 2000
    batch_size: int = 32
    seed: int = 0
    shard_batches: int = 4  # batches per output shard (the unit of resume and of multi-process)


@dataclasses.dataclass(frozen=True)
class DrafterStage:
    """The drafters: their architecture knobs and `train` (DRAFTER_TRAIN), the library's
    TrainConfig (steps, batches and the memory plan: micro_batch_size, compute_dtype,
    target_dtype, anchor_chunk; `train.seed` also initializes each drafter). Training samples
    are rendered up to max(train.seq_buckets) tokens with >= `min_loss_tokens` supervised ones;
    max(global_batch_size, one in `eval_one_in`) of them are held out for evaluation."""

    kinds: tuple[str, ...] = ("dspark", "dflash", "eagle3")
    block_size: int = 7
    num_layers: int = 1
    markov_rank: int = 64
    markov_head_type: str = "vanilla"
    num_anchors: int = 64
    # the drafters see only the last context_window positions (0: the whole context), in
    # training and at serving time (recorded with each drafter)
    context_window: int = 0
    train: TrainConfig = DRAFTER_TRAIN
    min_loss_tokens: int = 4
    eval_one_in: int = 20

    def train_config(self, seed: int | None = None) -> TrainConfig:
        """`train`, with another seed if given."""
        return self.train if seed is None else self.train.replace(seed=seed)


@dataclasses.dataclass(frozen=True)
class CalibrateStage:
    # the last regenerated conversations, at most max_prompts and one in `heldout_one_in`
    max_prompts: int = 60
    max_new_tokens: int = 96
    heldout_one_in: int = 10
    seed: int = 12345  # sampling seed of the calibration decode


@dataclasses.dataclass(frozen=True)
class EvalStage:
    max_prompts_per_dataset: int = 30
    max_new_tokens: int = 128
    temperature: float = 1.0
    seed: int = 980406
    batch_size: int = 8
    # prompt + generation cap; 0 = the target's context (max_position_embeddings)
    max_len: int = 0
    speed_prompts: int = 8  # per evaluated dataset, for the batch-1 speed section
    # further temperatures at which the τ table is repeated (the main table, calibration, the
    # analyses and the speed section use `temperature`); e.g. (0.0,) for greedy as well
    temperatures: tuple[float, ...] = (0.0,)
    # interleaved repetitions of the speed section's component timing (0 = no breakdown)
    speed_reps: int = 7
    # the speed section's batch-1 decoder: one slot, up to this many device-resident rounds
    # per host call (engine.rounds; 1 = the host schedules every round). 16 on the demo's
    # models: the host's share of a round 2.1% (4.6-5.3% at 8), about two calls per answer
    speed_rounds_per_call: int = 16


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

    @property
    def regenerate_prompt_cap(self) -> int:
        """The most prompts regenerate answers: the drafters' training prompts and the
        calibration split after them (fewer when the data holds fewer)."""
        return self.regenerate.max_prompts + self.calibrate.max_prompts

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PipelineConfig:
        """From `to_json` output."""
        return from_json(cls, d)


def absolute_paths(cfg: PipelineConfig) -> PipelineConfig:
    """`cfg` with every path made absolute (against the current directory), so that the run
    directory's config.json means the same from any directory."""

    def ab(p: str) -> str:
        if not p or "://" in p:  # a bucket URL is absolute
            return p
        return os.path.abspath(os.path.expanduser(p))

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
        elif isinstance(lit, (int, float)):  # one element: seq_buckets=256
            lit = (lit,)
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
