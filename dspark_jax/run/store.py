"""Stage outputs in a run directory, with nothing trained ever deleted silently.

Layout of `<run>`:

    <stage>/                     the current output of a finished stage; `done.json` (written
                                 last) records the stage's key and the inputs it was built from
    work/<stage>.<key>/          a stage being built (partial work that survives interruption:
                                 checkpoints, shards); resumed when the same key runs again
    previous/<stage>.<key>/      earlier finished outputs, moved aside when a changed input made
                                 the stage run again; moved back if that configuration returns

A stage is built in its work folder and swapped into place only when it finished, so a failed
run leaves the previous output (report, checkpoints) where it was. At most `keep` older
versions per stage are kept in `previous/` (and `work/`); older ones are removed, with a log line.
`--force` discards a stage's partial work and its current output, except that a finished target
or drafter checkpoint is moved to `previous/<stage>.<key>.forced-<time>`, never deleted.

`<run>` may be a bucket URL (`storage.as_path`): an object store has no atomic directory
rename, so a folder is moved with `storage.move_tree` (done.json copied last and removed first):
an interrupted move leaves a destination without done.json, never taken for a finished output.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from dspark_jax.io import write_json_atomic
from dspark_jax.storage import as_path, is_url, move_tree, rmtree

PROTECTED = ("target", "drafters")  # trained weights: moved aside even under --force


class StageStore:
    def __init__(self, run: Path, *, keep: int, log=print):
        self.run = as_path(run)
        self.keep = keep
        self.log = log

    # -- paths ------------------------------------------------------------------------------

    def current(self, stage: str) -> Path:
        return self.run / stage

    def work(self, stage: str, key: str) -> Path:
        return self.run / "work" / f"{stage}.{key}"

    def previous(self, stage: str, key: str) -> Path:
        return self.run / "previous" / f"{stage}.{key}"

    def _rel(self, p: Path) -> str:
        try:
            return str(p.relative_to(self.run))
        except ValueError:
            return str(p)

    @staticmethod
    def read_done(d: Path) -> dict | None:
        try:
            got = json.loads((d / "done.json").read_text())
        except (OSError, ValueError):
            return None
        return got if isinstance(got, dict) else None

    def done_info(self, stage: str) -> dict | None:
        return self.read_done(self.current(stage))

    def is_done(self, stage: str, key: str) -> bool:
        info = self.done_info(stage)
        return info is not None and info.get("key") == key

    # -- transitions ----------------------------------------------------------------------

    def recover(self, stage: str, key: str) -> bool:
        """Make a finished output of `key` current if one exists aside (a previous version, or a
        work folder that finished just before an interruption). True if `stage` is now done."""
        if self.is_done(stage, key):
            return True
        for src, what in ((self.previous(stage, key), "restored"), (self.work(stage, key), "")):
            info = self.read_done(src)
            if info is not None and info.get("key") == key:
                self._swap_in(stage, src, force=False)
                if what:
                    self.log(f"[{stage}] {what} the output of this configuration from "
                             f"{self._rel(src)}")  # fmt: skip
                return True
        return False

    def begin(self, stage: str, key: str, *, force: bool) -> Path:
        """The work folder for building `stage` with `key` (partial work of the same key is kept
        unless `force`)."""
        w = self.work(stage, key)
        if force and w.exists():
            rmtree(w)
        if w.exists() and any(w.iterdir()):
            self.log(f"[{stage}] resuming the partial work in {self._rel(w)}")
        w.mkdir(parents=True, exist_ok=True)
        return w

    def commit(self, stage: str, key: str, info: dict, *, force: bool) -> None:
        """Finish `stage`: write its done.json (atomically, last) and swap it into place."""
        w = self.work(stage, key)
        write_json_atomic(w / "done.json", {"key": key, "time": time.time(), **info})
        self._swap_in(stage, w, force=force)

    def _swap_in(self, stage: str, src: Path, *, force: bool) -> None:
        cur = self.current(stage)
        if cur.exists():
            old = self.read_done(cur)
            old_key = (old or {}).get("key") or (
                f"legacy-{old['hash']}" if old and "hash" in old else None
            )
            if old_key is None:  # unfinished leftovers of an older layout
                old_key = f"unfinished-{int(time.time())}"
            if force and (stage not in PROTECTED or old is None):
                rmtree(cur)
                self.log(f"[{stage}] discarded the previous output (--force {stage})")
            else:
                dst = self.previous(stage, old_key)
                if force or dst.exists():
                    dst = dst.with_name(f"{dst.name}.forced-{int(time.time())}")
                dst.parent.mkdir(parents=True, exist_ok=True)
                move_tree(cur, dst)
                self.log(f"[{stage}] kept the previous output in {self._rel(dst)}")
        move_tree(src, cur)
        # (a bucket has no empty folders to remove)
        if src.parent.name == "work" and not is_url(src) and not any(src.parent.iterdir()):
            src.parent.rmdir()  # no partial work left
        self.prune(stage)

    def prune(self, stage: str) -> None:
        """Keep at most `keep` versions of `stage` in previous/ and in work/ (newest first)."""
        for parent in (self.run / "previous", self.run / "work"):
            if not parent.is_dir():
                continue
            olds = [p for p in parent.glob(f"{stage}.*") if p.is_dir()]
            olds.sort(key=_age, reverse=True)
            for p in olds[self.keep :]:
                rmtree(p)
                self.log(f"[{stage}] removed {self._rel(p)} (keep_versions={self.keep})")


def _age(p) -> float:
    """When folder `p` was last changed: its mtime; on a bucket (folders are implicit) the time
    its done.json records, else 0 (unfinished work sorts oldest)."""
    if not is_url(p):
        return p.stat().st_mtime
    info = StageStore.read_done(p) or {}
    t = info.get("time")
    return float(t) if isinstance(t, (int, float)) else 0.0
