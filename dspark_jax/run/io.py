"""Atomic writes and cached content hashes for the run directory."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the new one, never a part."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1, default=_json_default))


def canonical_hash(obj) -> str:
    """A short stable hash of a JSON-able object (sorted keys)."""
    blob = json.dumps(obj, sort_keys=True, default=_json_default).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class FileHasher:
    """sha256 of file contents, remembered by (path, size, mtime) in a JSON file so that a large
    checkpoint is read once, not at every start."""

    def __init__(self, cache_file: str | os.PathLike | None = None):
        self.cache_file = Path(cache_file) if cache_file else None
        self._memo: dict[str, dict] = {}
        if self.cache_file and self.cache_file.is_file():
            try:
                self._memo = json.loads(self.cache_file.read_text())
            except (OSError, ValueError):
                self._memo = {}
        self._dirty = False

    def file(self, path: str | os.PathLike) -> str:
        p = Path(path).resolve()
        st = p.stat()
        stamp = [st.st_size, st.st_mtime_ns]
        got = self._memo.get(str(p))
        if got and got.get("stamp") == stamp:
            return got["sha256"]
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        digest = h.hexdigest()[:16]
        self._memo[str(p)] = {"stamp": stamp, "sha256": digest}
        self._dirty = True
        return digest

    def tree(self, path: str | os.PathLike, patterns=("*",)) -> dict[str, str]:
        """{relative name: hash} of the files in directory `path` matching `patterns`."""
        root = Path(path)
        out = {}
        for pat in patterns:
            for f in sorted(root.glob(pat)):
                if f.is_file():
                    out[str(f.relative_to(root))] = self.file(f)
        return out

    def save(self) -> None:
        if self.cache_file and self._dirty and self.cache_file.parent.is_dir():
            write_json_atomic(self.cache_file, self._memo)
            self._dirty = False
