"""Does a drafter fit a target? The one drafter/target compatibility check.

    check_fits(target_cfg, drafter_cfg)                              # a config built for it
    check_fits(target_cfg, drafter_cfg, trained_for=TargetId...)     # a trained checkpoint

Used by the trainer (before anything is written), the run directory's drafter loader, the HF
drafter loader and the engines. A drafter checkpoint records the target it was trained for as a
`TargetId` (docs/ARCHITECTURE.md §3.5: name, feature layer ids, vocabulary hash, the copied shapes);
loading it for another target raises one `ConfigError` naming every difference and the fix (a
different name alone only logs a warning: a renamed copy of the same checkpoint still fits).

Fields of a `TargetId` that one side does not know (None, or "" for name / vocabulary hash: an
older checkpoint, a target without a tokenizer at hand) are not compared.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Mapping
from typing import Any

from flax import nnx

from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.errors import ConfigError

log = logging.getLogger(__name__)

# shape fields of a TargetId, with the words the error uses
_SHAPES = {
    "hidden_size": "hidden size",
    "vocab_size": "vocabulary",
    "num_heads": "attention heads",
    "num_kv_heads": "key/value heads",
    "head_dim": "head dim",
    "intermediate_size": "MLP size",
}


@dataclasses.dataclass(frozen=True)
class TargetId:
    """The target a drafter was trained for."""

    target_layer_ids: tuple[int, ...]
    num_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    dtype: str | None = None  # the target config's dtype (its parameters as loaded)
    max_position_embeddings: int | None = None  # the context window (RoPE) it was trained with
    rope_theta: float | None = None
    rope_scaling: Any = None  # the target config's RopeScaling as JSON (None: none or unknown)
    name: str = ""  # e.g. the checkpoint directory's name; "" = unknown
    vocab_hash: str = ""  # `vocab_hash(tokenizer)`; "" = unknown

    @classmethod
    def of(cls, cfg: TargetConfig, *, name: str = "", vocab_hash: str = "") -> TargetId:
        return cls.from_json(dict(cfg.to_json(), name=name, vocab_hash=vocab_hash))

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TargetId:
        """From `to_json()` or a `TargetConfig.to_json()` (unknown keys ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["target_layer_ids"] = tuple(int(i) for i in d.get("target_layer_ids", ()))
        if isinstance(kw.get("rope_scaling"), Mapping):  # hashable, comparable
            kw["rope_scaling"] = tuple(sorted(kw["rope_scaling"].items()))
        return cls(**kw)

    def to_json(self) -> dict[str, Any]:
        d = dict(dataclasses.asdict(self), target_layer_ids=list(self.target_layer_ids))
        if self.rope_scaling is not None:
            d["rope_scaling"] = dict(self.rope_scaling)
        return d


def vocab_hash(tokenizer) -> str:
    """A short hash of a tokenizer's vocabulary (token -> id); equal vocabularies, equal hash."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    text = json.dumps(items, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def recorded_target(sidecar: Mapping[str, Any]) -> TargetId | None:
    """The `TargetId` a trainer's config (`config.json` / checkpoint meta) records: its
    `trained_for`, or for a run written before that, the shapes of its `target` config."""
    if sidecar.get("trained_for"):
        return TargetId.from_json(sidecar["trained_for"])
    if sidecar.get("target"):
        return TargetId.from_json(sidecar["target"])
    return None


def _get(tree, key):
    try:
        v = tree[key]
    except (KeyError, TypeError, IndexError):
        return None
    return v.get_value() if isinstance(v, nnx.Variable) else v


def _differences(want: TargetId, have: TargetId, target_cfg: TargetConfig) -> list[str]:
    out = []
    for f, words in _SHAPES.items():
        a, b = getattr(want, f), getattr(have, f)
        if a is not None and b is not None and a != b:
            out.append(f"{words} ({f}): drafter {a} vs target {b}")
    if want.num_layers is not None and want.num_layers != target_cfg.num_layers:
        out.append(
            f"drafter was trained for a {want.num_layers}-layer target, the target has "
            f"{target_cfg.num_layers} layers"
        )
    ids = tuple(want.target_layer_ids)
    bad = [i for i in ids if not 0 <= i < target_cfg.num_layers - 1]
    if bad:
        out.append(
            f"feature layer ids {bad} are outside the target's layers 0..{target_cfg.num_layers - 2}"
        )
    elif ids != tuple(target_cfg.target_layer_ids):
        out.append(
            f"drafter reads target layers {ids} but the target captures "
            f"{tuple(target_cfg.target_layer_ids)} (feature layer ids: build the target with "
            f"target_layer_ids={ids})"
        )
    out += _settings(want, have)
    if want.vocab_hash and have.vocab_hash and want.vocab_hash != have.vocab_hash:
        out.append(
            f"tokenizer vocabulary hash: drafter {want.vocab_hash} vs target {have.vocab_hash}"
        )
    return out


def _settings(want: TargetId, have: TargetId) -> list[str]:
    """The target settings the drafter's features and positions depend on (compared only when
    the drafter records them: checkpoints written before they were recorded skip them)."""
    out = []
    if want.dtype and have.dtype and want.dtype != have.dtype:
        out.append(
            f"dtype: drafter trained on {want.dtype} target features, target is {have.dtype} "
            f"(load the target with dtype={want.dtype!r})"
        )
    a, b = want.max_position_embeddings, have.max_position_embeddings
    if a is not None and b is not None and b > a:
        out.append(
            f"context window (max_position_embeddings): drafter trained for {a}, target "
            f"configured for {b} (keep the target's max_position_embeddings <= {a})"
        )
    if want.rope_theta is not None and have.rope_theta is not None:
        if want.rope_theta != have.rope_theta or want.rope_scaling != have.rope_scaling:
            out.append(
                f"RoPE (rope_theta / rope_scaling): drafter trained with {want.rope_theta} / "
                f"{want.rope_scaling}, target has {have.rope_theta} / {have.rope_scaling}"
            )
    return out


def check_fits(
    target_cfg: TargetConfig,
    drafter_cfg: DrafterConfig | None = None,
    *,
    trained_for: TargetId | None = None,
    name: str = "",
    vocab_hash: str = "",
    target_params=None,
    frozen=None,
) -> None:
    """Raise `ConfigError` unless `drafter_cfg` (trained for `trained_for`, default: its own
    `drafter_cfg.target`) runs on the target `target_cfg` (called `name`, with a tokenizer of
    vocabulary hash `vocab_hash`; "" = unknown). Without `drafter_cfg` (a checkpoint whose config
    is not built yet), only `trained_for` is checked against the target.

    Checks the shapes the drafter copies (hidden size, vocabulary, heads, MLP size), the target's
    layer count, the feature layers (same ids, inside the target's layers, never its last), the
    mask token (a row of the embedding), name and vocabulary hash when both sides know them, and,
    when given, the shapes of the target's embedding and of the drafter's frozen embedding /
    LM head.
    """
    if trained_for is None and drafter_cfg is None:
        raise TypeError("check_fits needs drafter_cfg or trained_for")
    want = trained_for if trained_for is not None else TargetId.of(drafter_cfg.target)
    have = TargetId.of(target_cfg, name=name, vocab_hash=vocab_hash)
    problems = _differences(want, have, target_cfg)
    if want.name and have.name and want.name != have.name:
        # a name is a label, not a shape: a renamed copy of the same checkpoint still fits
        log.warning("drafter was trained for target %r, this target is %r", want.name, have.name)
    kind = None if drafter_cfg is None else drafter_cfg.kind
    if kind not in (None, "eagle3") and not 0 <= drafter_cfg.mask_token_id < target_cfg.vocab_size:
        problems.append(
            f"mask token {drafter_cfg.mask_token_id} is not a row of the target embedding "
            f"(vocab {target_cfg.vocab_size})"
        )
    shape = (target_cfg.vocab_size, target_cfg.hidden_size)
    if target_params is not None:
        emb = _get(target_params, "embed_tokens")
        emb = emb if emb is None or hasattr(emb, "shape") else _get(emb, "weight")  # Gemma 4
        if emb is not None and tuple(emb.shape) != shape:
            problems.append(f"target embedding shape {tuple(emb.shape)} != config {shape}")
    if frozen is not None:
        emb, head = _get(frozen, "embed_tokens"), _get(frozen, "lm_head")
        if emb is not None and tuple(emb.shape) != shape:
            problems.append(f"drafter frozen embedding shape {tuple(emb.shape)} != target {shape}")
        if head is not None and tuple(head.shape) != shape[::-1]:
            problems.append(f"drafter frozen lm_head shape {tuple(head.shape)} != {shape[::-1]}")
    if problems:
        fix = (
            "load the drafter trained for this target (or serve the target it was trained for)"
            if trained_for is not None
            else "build the drafter config from this target (DrafterConfig.dspark(target_cfg, ...))"
        )
        raise ConfigError(
            "drafter is incompatible with the target: " + "; ".join(problems) + f" — {fix}"
        )


__all__ = ["TargetId", "check_fits", "recorded_target", "vocab_hash"]
