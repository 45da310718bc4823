"""Storage beyond the local filesystem: run directories and checkpoints on a bucket URL (a pod).

`as_path` turns a local path into a `pathlib.Path` (exactly as before) and a URL (`gs://bucket/run`,
`s3://`, `az://`, `hf://`) into an `etils.epath.Path`, whose backend (fsspec with gcsfs / s3fs /
..., or tensorflow's gfile when installed) writes the object store; both have the pathlib API the
rest of the code uses, and `dspark_jax.io`'s atomic writers take either. A scheme epath does not
write, or one whose backend is not installed, is refused in one line naming what to install.

An object store has no atomic directory rename and no append: `move_tree` moves a directory with
its completion marker (done.json) copied last and removed first, so that a reader that trusts the
marker never sees a part; `append_text` rewrites a log whole, atomically; `local_copy` gives
readers that need a POSIX path (tokenizers, safetensors) a cached local copy of a directory.

Checkpoints (orbax, through tensorstore) are written to `gs://` buckets only:
`train.checkpoint.checkpoint_dir`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import uuid
from pathlib import Path

from etils import epath

from dspark_jax import runtime
from dspark_jax.errors import ConfigError
from dspark_jax.io import atomic_write

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
    if scheme not in URL_BACKENDS:
        raise ConfigError(
            f"{os.fspath(path)}: {scheme}:// is not a storage etils.epath writes — use a local "
            f"path or one of {', '.join(s + '://' for s in URL_BACKENDS)}"
        )

    p = path if isinstance(path, epath.Path) else epath.Path(os.fspath(path))
    _check_backend(scheme, os.fspath(path))
    return p


def _check_backend(scheme: str, where: str) -> None:
    """Refuse in one line a URL whose epath backend is not installed (fsspec + gcsfs / s3fs /
    ..., or tensorflow's gfile)."""
    if importlib.util.find_spec("tensorflow") is not None:
        return  # epath writes the URL through gfile
    try:
        import fsspec  # optional: a URL backend (fsspec + gcsfs / s3fs), not a dependency

        fsspec.get_filesystem_class("gcs" if scheme == "gs" else scheme)
    except (ImportError, ValueError):
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
    cache = runtime.local_cache_dir()
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
