"""Atomic writes (the project's only writer of files that others read) and content hashes.

Every writer puts the data in a temporary file in the destination's directory, fsyncs it and
`os.replace`s it over the destination, so a reader sees the old file or the new one, never a
part; if the writer fails, the destination keeps its previous content (or stays absent) and the
temporary file is removed.

  atomic_write(path, mode)     a file object (text modes UTF-8)
  atomic_path(path)            a temporary path, for writers that want a file name
  atomic_dir(path)             a temporary directory renamed to `path` when complete
  write_{bytes,text,json}_atomic(path, data)

Every function takes a local path (str or `pathlib.Path`) or a path object of another
filesystem with pathlib's API (an `etils.epath.Path` for a bucket URL, made by
`dspark_jax.storage.as_path`; this module itself imports only numpy and the standard library).
On such an object `atomic_write` writes a temporary object next to the destination and renames
it over the destination (on a bucket a server-side copy: the object appears whole or not at all).

Lives at the top of the package (not in run/) so that sched/, models/ and train/ can use it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path, PurePath
from typing import Any

import numpy as np


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (Path, os.PathLike)):
        return os.fspath(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w") -> Iterator[Any]:
    """Open a temporary file next to `path`; on clean exit fsync and `os.replace` it over `path`.

    If the body raises (or the process dies), `path` keeps its previous content (or stays absent)
    and the temporary file is removed. Text modes use UTF-8. Creates missing parent directories.
    """
    if _remote(path):
        yield from _atomic_write_remote(path, mode)
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        kwargs = {} if "b" in mode else {"encoding": "utf-8"}
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _remote(path) -> bool:
    """True for a path object of another filesystem (`etils.epath.Path`: pathlib's API, not a
    `pathlib.Path`); a URL given as a string is refused (this module does not import epath)."""
    if isinstance(path, Path):
        return False
    if isinstance(path, PurePath) and hasattr(path, "open"):
        return True
    if "://" in os.fspath(path):
        raise ValueError(f"{os.fspath(path)}: a URL — pass dspark_jax.storage.as_path(url)")
    return False


def _atomic_write_remote(path, mode: str):
    """`atomic_write` on another filesystem: a temporary object next to `path`, renamed over it
    when the body finished (an object store upload is committed when its file is closed, even
    after an error in the body: hence the temporary object)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with tmp.open("wb") as raw:
            if "b" in mode:
                yield raw
            else:
                f = io.TextIOWrapper(raw, encoding="utf-8")
                yield f
                f.flush()
                f.detach()
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError, OSError):
            tmp.unlink()
        raise


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """A temporary file name next to `path` (same suffix, not yet created) for writers that take
    a file name (safetensors, matplotlib); on clean exit the file, if the body wrote one, is
    fsynced and replaces `path`. A body that writes nothing leaves `path` as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp{path.suffix}")
    try:
        yield str(tmp)
        if tmp.exists():
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """A fresh directory `<path>.tmp` (removed first if an interrupted writer left one); on clean
    exit it is renamed to `path`, which must not exist. On failure it is left for the caller's
    cleanup of `*.tmp` debris."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    yield tmp
    os.replace(tmp, path)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the new one, never a part."""
    with atomic_write(path, "wb") as f:
        f.write(data)


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
        self.cache_file = None
        if cache_file:
            self.cache_file = cache_file if _remote(cache_file) else Path(cache_file)
        self._memo: dict[str, dict] = {}
        if self.cache_file and self.cache_file.is_file():
            try:
                self._memo = json.loads(self.cache_file.read_text())
            except (OSError, ValueError):
                self._memo = {}
        self._dirty = False

    def file(self, path: str | os.PathLike) -> str:
        if _remote(path):  # (on a bucket: size and modification time as the backend reports)
            p = path
            st = p.stat()
            stamp = [st.length, st.mtime]
        else:
            p = Path(path).resolve()
            st = p.stat()
            stamp = [st.st_size, st.st_mtime_ns]
        got = self._memo.get(str(p))
        if got and got.get("stamp") == stamp:
            return got["sha256"]
        h = hashlib.sha256()
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        digest = h.hexdigest()[:16]
        self._memo[str(p)] = {"stamp": stamp, "sha256": digest}
        self._dirty = True
        return digest

    def tree(self, path: str | os.PathLike, patterns=("*",)) -> dict[str, str]:
        """{relative name: hash} of the files in directory `path` matching `patterns`."""
        root = path if _remote(path) else Path(path)
        out = {}
        for pat in patterns:
            for f in sorted(root.glob(pat)):
                if f.is_file():
                    out[str(f.relative_to(root))] = self.file(f)
        return out

    def save(self) -> None:
        if (
            self.cache_file
            and self._dirty
            and (_remote(self.cache_file) or self.cache_file.parent.is_dir())
        ):
            write_json_atomic(self.cache_file, self._memo)
            self._dirty = False
