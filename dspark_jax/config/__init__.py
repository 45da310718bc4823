"""Frozen, hashable configuration dataclasses.

Every config here can be a static argument of `jax.jit`. Unknown or conflicting fields are errors:
`replace_checked` and `from_json` refuse names the dataclass does not have.

This package is the one place to import them from (`from dspark_jax.config import TargetConfig`);
they are defined by topic in
  `dspark_jax.config.base`     `replace_checked`, `to_json`, `from_json` (the helpers every
                               config class shares) and `MeshConfig` (training and serving);
  `dspark_jax.config.target`   `TargetConfig`, `RopeScaling`, `Gemma4Config`,
                               `default_target_layer_ids`, `ARCHITECTURES`, `LAYER_TYPES`;
  `dspark_jax.config.drafter`  `DrafterConfig`, `DRAFTER_KINDS`, `MARKOV_HEAD_TYPES`;
  `dspark_jax.config.train`    `TrainConfig`, `FEATURE_MODES`, `MEMORY_CHECKS`.
They are read in that order (TargetConfig → DrafterConfig → TrainConfig). The pipeline's sections
(`PipelineConfig`, `train.py`'s stages) are in `dspark_jax.config.pipeline`, the demo corpus's
parameters (`CorpusConfig`) in `dspark_jax.config.corpus`; both are imported from their modules.
The serving engine's `EngineConfig` stays in `dspark_jax.engine.config`: it is resolved against
the engine's buckets and sampling programs (it imports `dspark_jax.spec`, hence jax), and nothing
in this package imports jax.
"""

from __future__ import annotations

from dspark_jax.config.base import MeshConfig, from_json, replace_checked, to_json
from dspark_jax.config.drafter import DRAFTER_KINDS, MARKOV_HEAD_TYPES, DrafterConfig
from dspark_jax.config.target import (
    ARCHITECTURES,
    LAYER_TYPES,
    Gemma4Config,
    RopeScaling,
    TargetConfig,
    default_target_layer_ids,
)
from dspark_jax.config.train import FEATURE_MODES, MEMORY_CHECKS, TrainConfig

__all__ = [
    "ARCHITECTURES",
    "DRAFTER_KINDS",
    "FEATURE_MODES",
    "LAYER_TYPES",
    "MARKOV_HEAD_TYPES",
    "MEMORY_CHECKS",
    "DrafterConfig",
    "Gemma4Config",
    "MeshConfig",
    "RopeScaling",
    "TargetConfig",
    "TrainConfig",
    "default_target_layer_ids",
    "from_json",
    "replace_checked",
    "to_json",
]
