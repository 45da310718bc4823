"""The helpers every config dataclass shares, and the device mesh shape.

`replace_checked` (`dataclasses.replace` refusing unknown field names), `to_json` / `from_json`
(the one JSON writer and reader of every config dataclass), and `MeshConfig` (used by training
and serving alike). Re-exported by `dspark_jax.config`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from dspark_jax.errors import ConfigError


def replace_checked(cfg, **overrides):
    """`dataclasses.replace` that rejects unknown field names with a clear error."""
    names = {f.name for f in dataclasses.fields(cfg)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ConfigError(
            f"{type(cfg).__name__} has no field(s) {unknown}; valid fields: {sorted(names)}"
        )
    return dataclasses.replace(cfg, **overrides)


def to_json(cfg) -> dict[str, Any]:
    """A (nested) config dataclass as a JSON-able dict (tuples become lists when dumped)."""
    return dataclasses.asdict(cfg)


def from_json(cls, d: dict[str, Any]):
    """The one JSON reader of every config dataclass: rebuilds `cls` (nested dataclasses, tuples,
    optional fields) from `to_json` output; missing fields take their defaults, unknown ones are
    a ConfigError."""
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


class ConfigMethods:
    """`replace` (checked field names), `to_json` and `from_json` of a config dataclass."""

    def replace(self, **kw):
        return replace_checked(self, **kw)

    def to_json(self) -> dict[str, Any]:
        return to_json(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]):
        return from_json(cls, d)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape over (data, fsdp, tensor). -1 in `data` means: all remaining devices."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
