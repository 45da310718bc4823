"""The checks that read what a configuration names, before the first stage runs: every input file
parsed (not only checked for existence), the target's checkpoint config and tokenizer, the
prompt room within the target's context, and the rules that need the device mesh. Errors are
`ConfigError` / `DataError` with one line naming the field or file and the fix.

The configuration's own checks (types, ranges, stage names) are run/validate.py, which train.py
runs before jax loads; these run after (run/staged.py, run/pipeline.py).
"""

from __future__ import annotations

from pathlib import Path

import jax

from dspark_jax.config.pipeline import PipelineConfig
from dspark_jax.errors import ConfigError, DataError
from dspark_jax.models.hf import config_from_hf, load_tokenizer, read_hf_config
from dspark_jax.train.data import read_conversations, read_prompts
from dspark_jax.train.host_data import per_host_layout
from dspark_jax.train.steps import check_batch_shards


def target_context(cfg: PipelineConfig) -> int:
    """The target's max_position_embeddings (from its checkpoint with target.path)."""
    if cfg.target.path:
        return int(read_hf_config(cfg.target.path).get("max_position_embeddings", 4096))
    return cfg.target.model.max_position_embeddings


def min_prompt_room(cfg: PipelineConfig) -> None:
    """evaluate.max_len must fit the target and leave room for a prompt after the budget."""
    e, g = cfg.evaluate, cfg.drafters.block_size
    ctx = target_context(cfg)
    if 0 < e.max_len < 16:
        raise ConfigError(
            f"evaluate.max_len={e.max_len} is too small — use 0 (the target's context) or >= 16"
        )
    if e.max_len > ctx:
        raise ConfigError(
            f"evaluate.max_len={e.max_len} exceeds the target's context ({ctx} positions) — "
            f"set evaluate.max_len <= {ctx}"
        )
    for name, budget in (
        ("evaluate", e.max_new_tokens),
        ("calibrate", cfg.calibrate.max_new_tokens),
    ):
        room = (e.max_len or ctx) - budget - g - 2
        if room < 8:
            raise ConfigError(
                f"{name}.max_new_tokens={budget} leaves {room} positions for the prompt in "
                f"{e.max_len or ctx} positions — raise evaluate.max_len or lower {name}.max_new_tokens"
            )


def validate_inputs(cfg: PipelineConfig) -> dict[str, int]:
    """Parse every input file the configuration names; returns {file: usable rows}."""
    counts = {}
    for f in cfg.data.conversation_files:
        _exists(f, "data.conversation_files")
        convs, stats = read_conversations(f)
        if not convs:
            raise DataError(
                f, None, f"no usable conversation ({stats.summary()}) — fix or drop the file"
            )
        counts[f] = len(convs)
    stems = [Path(f).stem for f in cfg.data.eval_prompt_files]
    if len(set(stems)) != len(stems):
        raise ConfigError(
            f"data.eval_prompt_files {cfg.data.eval_prompt_files} has two files with the same "
            "name; datasets are named by file stem — rename one"
        )
    for f in cfg.data.eval_prompt_files:
        _exists(f, "data.eval_prompt_files")
        prompts, stats = read_prompts(f)
        if not prompts:
            raise DataError(f, None, f"no usable prompt ({stats.summary()}) — fix or drop the file")
        counts[f] = len(prompts)
    if cfg.target.path:
        tcfg = config_from_hf(
            read_hf_config(cfg.target.path), target_layer_ids=cfg.target.target_layer_ids or None
        )
        del tcfg
    tok_dir = cfg.tokenizer.path or cfg.target.path
    if tok_dir:
        load_tokenizer(tok_dir, require_chat_template=True)
    min_prompt_room(cfg)
    return counts


def _exists(f: str, field: str) -> None:
    p = Path(f)
    if not p.is_file():
        raise ConfigError(f"{field}: {f} does not exist or is not a file — check the path")


def validate_mesh(cfg: PipelineConfig, mesh) -> None:
    """The rules that need the device mesh, checked when the mesh is built (before the first
    stage): the drafters' Trainer gives every data x fsdp shard whole sequences (the Trainer's
    own check, with the field named as `--set` spells it); offline features on several
    processes are computed per host, which needs the processes laid along data / fsdp."""
    check_batch_shards(cfg.drafters.train, mesh, field_prefix="drafters.train.")
    offline = cfg.drafters.train.feature_mode == "offline"
    if offline and jax.process_count() > 1 and not per_host_layout(mesh):
        raise ConfigError(
            "drafters.train.feature_mode='offline' on several processes has each compute the "
            "features of its own rows, but this mesh does not give each process its own block of "
            f"batch rows ({dict(mesh.shape)}): lay the processes along mesh.data / mesh.fsdp, "
            "or use --set drafters.train.feature_mode=online"
        )
