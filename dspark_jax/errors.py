"""The project's error types, in one place.

Each means "the input is wrong, and the message says how to fix it" (one line naming the field,
file or request and the change to make). All derive from `ValueError`, so a CLI reports any of
them as a user error (cli/common.py `user_errors`) and a caller that already catches `ValueError`
keeps working.
"""

from __future__ import annotations

import os

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DatasetError",
    "FeatureCacheError",
    "PolicyError",
    "RequestError",
]


class ConfigError(ValueError):
    """A configuration that cannot work; the message says what to change."""


class RequestError(ValueError):
    """A generation request that cannot be served as configured; the message names the fix."""


class CheckpointError(ValueError):
    """A checkpoint (training or HF) or tokenizer that cannot be loaded, or none where one was
    expected; the message says what is wrong and what to do (e.g. which directory to remove)."""


class DataError(ValueError):
    """A data file that cannot be used; the message names the file and the 1-based line."""

    def __init__(self, path: str | os.PathLike, line: int | None, message: str):
        self.path = str(path)
        self.line = line
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


class DatasetError(ValueError):
    """A training or evaluation set that cannot be used; the message says what to change."""


class FeatureCacheError(ValueError):
    """A feature cache that cannot be used as asked; the message says what to do."""


class PolicyError(ValueError):
    """A policy returned lengths the engine cannot verify losslessly."""
