"""A `gs://` bucket that exists on this machine, for the pod-storage tests.

Why this backend: the code under test must reach storage only through URL paths (`etils.epath`
for files, orbax -> tensorstore for arrays), never through `os.path` / `open` / `pathlib`. Neither
`memory://` nor `file://` URLs serve: `epath` knows only `gs://`, `s3://`, `az://` and `hf://`
(`epath.Path("memory://x")` raises KeyError), orbax builds a remote tensorstore spec only for
`gs://` (any other URL goes to the local `file` kvstore as a path) and tensorstore's `memory`
kvstore lives in one `ts.Context` (orbax opens a new one per save and restore, so a restore would
find nothing: checked). No GCS emulator or gcsfs is installed. So the tests use real
`gs://bucket/...` URLs and swap in, below the URL layer, a store backed by a temporary directory:

* fsspec's `gs` / `gcs` protocol (which `epath` uses for `gs://` without tensorflow) is a
  `DirFileSystem` rooted there, so `epath.Path("gs://bkt/run/x")` is the file `<root>/bkt/run/x`;
  like a bucket it makes no empty folders (`mkdir` is a no-op);
* orbax's `gcs_utils.get_kvstore_for_gcs` returns tensorstore's `file` kvstore at the same
  place (instead of the `gcs` driver), and `is_hierarchical_namespace_enabled` says False
  (it would ask the GCS API).

Everything above those two seams runs the code path of a real bucket: orbax picks its GCS
atomicity (`commit_success.txt` markers instead of renaming a temporary directory), epath its
fsspec backend. A stray `os.path` / `open` on such a URL would write a relative directory
`gs:/bkt/...` under the current directory: `FakeBucket.stray()` lists what appeared there.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem


class FakeBucket:
    def __init__(self, root: Path, cwd: Path):
        self.root, self.cwd = root, cwd

    def local(self, url: str) -> Path:
        """Where `gs://...` lives on this machine (for the tests' own inspection only)."""
        assert url.startswith("gs://")
        return self.root / url[len("gs://") :]

    def stray(self) -> list[str]:
        """Files written under the current directory (a URL handled as a local path)."""
        return sorted(os.listdir(self.cwd))


def install(monkeypatch, tmp_path: Path) -> FakeBucket:
    root = tmp_path / "bucket-store"
    root.mkdir(exist_ok=True)
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)

    class _GcsOnDisk(DirFileSystem):
        protocol = ("gs", "gcs")

        def __init__(self, *args, **kwargs):  # gcsfs's kwargs (finalize_on_close) ignored
            super().__init__(path=str(root), fs=LocalFileSystem(auto_mkdir=True))

        # as on a bucket, a folder exists only while objects are under it: making one is a no-op
        # (writing a file creates its parents here), and code that needs an empty folder fails
        def mkdir(self, path, create_parents=True, **kwargs):
            pass

        def makedirs(self, path, exist_ok=False):
            pass

    from orbax.checkpoint._src.path import gcs_utils

    def kvstore(path):
        bucket, rest = gcs_utils.parse_gcs_path(path, add_trailing_slash=False)
        return {"driver": "file", "path": f"{root}/{bucket}/{rest}"}

    for proto in ("gs", "gcs"):
        monkeypatch.setitem(sys.modules["fsspec.registry"]._registry, proto, _GcsOnDisk)
    monkeypatch.setattr(gcs_utils, "get_kvstore_for_gcs", kvstore)
    monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda p: False)
    clear_caches()
    monkeypatch.chdir(cwd)
    return FakeBucket(root, cwd)


def clear_caches():
    """epath caches one filesystem per scheme: a test's bucket must not outlive the test (call
    again at teardown)."""
    from etils.epath import backend

    backend.fsspec_backend._get_filesystem.cache_clear()


if __name__ == "__main__":
    # `python fake_bucket.py <tmp_path> train.py-arguments...`: the train.py CLI with gs:// on the
    # fake bucket under <tmp_path> (a subprocess gets its own devices, as a user's run does)
    import pytest

    from dspark_jax.cli.train import main

    with pytest.MonkeyPatch.context() as mp:
        install(mp, Path(sys.argv[1]))
        sys.exit(main(sys.argv[2:]))
