"""Atomic writes (the project's only writer of files that others read) and content hashes.

Every writer puts the data in a temporary file in the destination's directory, fsyncs it and
`os.replace`s it over the destination, so a reader sees the old file or the new one, never a
part; if the writer fails, the destination keeps its previous content (or stays absent) and the
temporary file is removed.

  atomic_write(path, mode)     a file object (text modes UTF-8)
  atomic_path(path)            a temporary path, for writers that want a file name
  atomic_dir(path)             a temporary directory renamed to `path` when complete
  write_{bytes,text,json}_atomic(path, data)

Paths: `as_path` turns a local path into a `pathlib.Path` (exactly as before) and a URL
(`gs://bucket/run`, `s3://`, `az://`, `hf://`) into an `etils.epath.Path`, whose backend (fsspec /
gcsfs, or tensorflow's gfile) writes the object store; both have the pathlib API used here. On a
URL, `atomic_write` writes a temporary object next to the destination and renames it (a GCS
rename is a server-side copy: the destination object appears whole or not at all), `rmtree`
removes a tree and `move_tree` moves a directory with its completion marker copied last and
removed first (an object store has no atomic directory rename: a reader that trusts the marker
never sees a part). `append_text` appends to a log (an object is rewritten whole on a URL).

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
from pathlib import Path
from typing import Any

import numpy as np

# URL schemes `etils.epath` writes, and the package each needs (`epath` uses tensorflow's gfile
# instead when tensorflow is installed)
URL_BACKENDS = {"gs": "gcsfs", "s3": "s3fs", "az": "adlfs", "hf": "huggingface_hub"}


def url_scheme(path) -> str | None:
    """The scheme of a URL path (`gs://b/x` -> "gs"), None for a local path."""
    s = os.fspath(path) if not isinstance(path, str) else path
    head, sep, _ = s.partition("://")
    return head.lower() if sep and head.isalnum() else None


def is_url(path) -> bool:
    return url_scheme(path) is not None


def as_path(path):
    """`pathlib.Path` for a local path; `etils.epath.Path` for a URL that epath writes (bucket
    URLs on a pod). An unsupported scheme, or one whose backend is not installed, is refused in
    one line naming what to install."""
    if not isinstance(path, str) and not isinstance(path, os.PathLike):
        raise TypeError(f"not a path: {path!r}")
    scheme = url_scheme(path)
    if scheme is None:
        return path if isinstance(path, Path) else Path(path)
    from dspark_jax.errors import ConfigError

    if scheme not in URL_BACKENDS:
        raise ConfigError(
            f"{os.fspath(path)}: {scheme}:// is not a storage etils.epath writes — use a local "
            f"path or one of {', '.join(s + '://' for s in URL_BACKENDS)}"
        )
    from etils import epath

    p = path if isinstance(path, epath.Path) else epath.Path(os.fspath(path))
    _check_backend(scheme, os.fspath(path))
    return p


def _check_backend(scheme: str, where: str) -> None:
    import importlib.util

    import fsspec

    if importlib.util.find_spec("tensorflow") is not None:
        return  # epath writes the URL through gfile
    try:
        fsspec.get_filesystem_class("gcs" if scheme == "gs" else scheme)
    except (ImportError, ValueError):
        from dspark_jax.errors import ConfigError

        raise ConfigError(
            f"{where}: writing {scheme}:// needs `pip install {URL_BACKENDS[scheme]}`"
        ) from None


def rmtree(path) -> None:
    """Remove the directory tree `path` (local or URL)."""
    p = as_path(path)
    if isinstance(p, Path):
        shutil.rmtree(p)
    else:
        p.rmtree()


def _files_under(p) -> list:
    """Every file below directory `p` (recursive listing through `iterdir`: fsspec's `walk`
    returns paths without their scheme)."""
    out = []
    for c in p.iterdir():
        out.extend(_files_under(c) if c.is_dir() else [c])
    return out


def _copy_file(src, dst) -> None:
    """Copy one file between any two of local paths and URLs (server-side between URLs)."""
    if not isinstance(src, Path) and not isinstance(dst, Path):
        src.copy(dst, overwrite=True)
        return
    with src.open("rb") as a, dst.open("wb") as b:
        shutil.copyfileobj(a, b, 1 << 22)


def copy_tree(src, dst, *, last: str | None = None) -> None:
    """Copy directory `src` into `dst` (local paths or URLs, in any combination), the file
    `last` (directly in `src`: a completion marker such as done.json) after all others."""
    src, dst = as_path(src), as_path(dst)
    marker = src / last if last else None
    files = [f for f in _files_under(src) if f != marker]
    for f in files + ([marker] if marker is not None and marker.exists() else []):
        out = dst / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        _copy_file(f, out)


def move_tree(src, dst, *, last: str = "done.json") -> None:
    """Move directory `src` to `dst` (which must not exist). Between local paths an atomic
    rename; otherwise every file is copied with the completion marker `last` (a file directly in
    `src`) copied after the others, then `src` is removed marker first, so that an interruption
    leaves `src` whole or `dst` marked complete."""
    src, dst = as_path(src), as_path(dst)
    if isinstance(src, Path) and isinstance(dst, Path):
        src.rename(dst)
        return
    if dst.exists():
        raise FileExistsError(f"{dst} exists")
    copy_tree(src, dst, last=last)
    marker = src / last
    if marker.exists():
        marker.unlink()
    rmtree(src)


def local_copy(url, *, stamp: str = "") -> Path:
    """A local directory holding the files of directory `url` (for readers that need a POSIX
    path: Hugging Face tokenizers, safetensors); a local path is returned as is. The copy is
    cached under `$DSPARK_CACHE` (default ~/.cache/dspark_jax/remote), keyed by the URL and
    `stamp` (e.g. the stage key its done.json records), and made atomically (`atomic_dir`)."""
    src = as_path(url)
    if isinstance(src, Path):
        return src
    cache = Path(os.environ.get("DSPARK_CACHE") or Path.home() / ".cache" / "dspark_jax")
    out = cache / "remote" / hashlib.sha256(f"{src}|{stamp}".encode()).hexdigest()[:20]
    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        copy_tree(src, tmp)
        if not out.exists():  # (another process may have made it meanwhile)
            with contextlib.suppress(OSError):
                os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


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
    path = as_path(path)
    if not isinstance(path, Path):
        yield from _atomic_write_url(path, mode)
        return
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


def _atomic_write_url(path, mode: str):
    """`atomic_write` on a URL: a temporary object next to `path`, renamed over it when the body
    finished (an object store upload is committed when its file is closed, even after an error
    in the body: hence the temporary object)."""
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


def append_text(path, text: str) -> None:
    """Append `text` to a log file; on a URL (no appends to an object) the log is rewritten
    whole, atomically."""
    p = as_path(path)
    if isinstance(p, Path):
        with open(p, "a") as f:
            f.write(text)
        return
    old = p.read_text() if p.exists() else ""
    with atomic_write(p) as f:
        f.write(old + text)


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
        self.cache_file = as_path(cache_file) if cache_file else None
        self._memo: dict[str, dict] = {}
        if self.cache_file and self.cache_file.is_file():
            try:
                self._memo = json.loads(self.cache_file.read_text())
            except (OSError, ValueError):
                self._memo = {}
        self._dirty = False

    def file(self, path: str | os.PathLike) -> str:
        if is_url(path):  # (on a bucket: size and modification time as the backend reports)
            p = as_path(path)
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
        root = as_path(path)
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
            and (is_url(self.cache_file) or self.cache_file.parent.is_dir())
        ):
            write_json_atomic(self.cache_file, self._memo)
            self._dirty = False
