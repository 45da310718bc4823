"""Stage bookkeeping of `train.py`'s pipeline: what each stage reads (its exact cache key), and
running stages so that nothing finished is lost (`dspark_jax.run.store`).

Each stage's key covers exactly what the stage reads: the configuration fields it uses (`_reads`,
including other sections' fields, e.g. calibrate reads evaluate.temperature), the content hash of
every input file and the identity of a TFDS dataset (`data_tfds.tfds_source`), and the keys of
the stages whose outputs it reads. A stage whose key matches its finished output is skipped. A
changed key builds the stage again in `work/` and swaps it in when finished; the previous output
is kept under `previous/` and comes back if its configuration does.

A run directory on a bucket (`run_dir=gs://...`): the bookkeeping (done.json, config.json, the
stage folders) lives in the bucket; a stage body, which writes with libraries that need POSIX
paths (tokenizers, safetensors, numpy memmaps), builds in a local scratch folder (`scratch_dir`)
that is uploaded into the bucket's work folder when the stage finished, before its done.json; a
finished stage is read from a cached local copy (`storage.local_copy`). Work that must survive the
machine (the target's and drafters' training checkpoints, regenerated shards: written by every
process) goes to `durable_dir`: the bucket's work folder itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import sys
import time
from pathlib import Path

import jax
from jax.experimental import multihost_utils

from dspark_jax import runtime
from dspark_jax.config.pipeline import STAGES, PipelineConfig, absolute_paths
from dspark_jax.errors import ConfigError
from dspark_jax.io import FileHasher, canonical_hash, write_json_atomic
from dspark_jax.run.eta import PipelineEta
from dspark_jax.run.rundir import RunDir
from dspark_jax.run.store import StageStore
from dspark_jax.run.validate import check_stage_names, validate_config
from dspark_jax.run.validate_inputs import validate_inputs
from dspark_jax.storage import as_path, copy_tree, is_url, local_copy
from dspark_jax.train.data_tfds import tfds_source

_TOKENIZER_FILES = ("tokenizer*.json", "*.jinja", "special_tokens_map.json", "vocab*", "merges*")
_CHECKPOINT_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json")


def _on_main(tag: str, fn):
    """Run a run-directory transition (`fn`) on process 0 only; in a multi-process run every
    process waits at a barrier until it is done, so all of them then see the same directory."""
    if jax.process_count() == 1:
        return fn()

    multihost_utils.sync_global_devices(f"dspark_stage_before_{tag}")
    out = fn() if jax.process_index() == 0 else None
    multihost_utils.sync_global_devices(f"dspark_stage_after_{tag}")
    return out


def _get(cfg, dotted: str):
    v = cfg
    for part in dotted.split("."):
        v = getattr(v, part)
    return dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v


class StagedRun:
    """Stage bookkeeping of a pipeline run; subclasses define `_stage_<name>()` bodies."""

    def __init__(self, cfg: PipelineConfig, *, log=print):
        validate_config(cfg)
        cfg = absolute_paths(cfg)
        self.cfg = cfg
        self.run = as_path(cfg.run_dir)  # a local path or a bucket URL
        self.log = log
        self.timings: dict[str, float] = {}
        self.status: dict[str, str] = {}
        self.rundir = RunDir(self.run, config=cfg)
        self.rundir.log = log  # the decoders' memory plans
        self.store = StageStore(self.run, keep=cfg.keep_versions, log=log)
        self.hasher = FileHasher(self.run / "file_hashes.json")
        self._building: dict[str, Path] = {}  # stage -> its work folder while it runs
        self._keys: dict[str, str] = {}
        self._tfds: dict | None = None  # data.tfds's identity (`tfds_source`), read once
        self.input_counts = validate_inputs(cfg)

    # -- cache keys -------------------------------------------------------------------------

    def _needs_corpus(self, stage: str) -> bool:
        c = self.cfg
        if stage == "tokenizer":
            return not (c.tokenizer.path or c.target.path)
        user_chats = bool(c.data.conversation_files or c.data.tfds)
        if stage == "target":
            return not c.target.path and not user_chats
        if stage == "regenerate":
            return not user_chats
        if stage == "evaluate":
            return not c.data.eval_prompt_files
        return False

    def _reads(self, stage: str) -> tuple[tuple[str, ...], dict, tuple[str, ...]]:
        """(config fields, {input: content hashes}, upstream stages) that `stage` reads."""
        c, h = self.cfg, self.hasher
        files: dict = {}
        corpus = ("corpus",) if self._needs_corpus(stage) else ()
        chats = {"conversations": {Path(f).name: h.file(f) for f in c.data.conversation_files}}
        if len(c.data.conversation_files) > 1:  # their order is the data's (and names may repeat)
            chats["conversation_order"] = [h.file(f) for f in c.data.conversation_files]
        if c.data.tfds:  # only then, so that the keys of runs without it stay as they were
            chats["tfds"] = self._tfds_source()
        if stage == "corpus":
            files["python"] = list(sys.version_info[:2])  # the corpus reads the stdlib
            files["needed"] = self._corpus_needed()
            return ("data.corpus",), files, ()
        if stage == "tokenizer":
            tok_dir = c.tokenizer.path or c.target.path
            if tok_dir:
                files["tokenizer"] = h.tree(tok_dir, _TOKENIZER_FILES)
                return (), files, ()
            return ("tokenizer.vocab_size",), files, corpus
        if stage == "target":
            if c.target.path:
                files["checkpoint"] = h.tree(c.target.path, _CHECKPOINT_FILES)
                return ("target.target_layer_ids",), files, ()
            files.update(chats)
            fields = tuple(
                f"target.{k}" for k in ("model", "train", "vocab_multiple", "render_windows",
                                        "min_loss_tokens", "heldout_one_in")
            )  # fmt: skip
            return fields, files, ("tokenizer", *corpus)
        if stage == "regenerate":
            files.update(chats)
            return ("regenerate", "calibrate.max_prompts"), files, ("tokenizer", "target", *corpus)
        if stage == "drafters":
            return (
                ("drafters", "calibrate.max_prompts", "calibrate.heldout_one_in"),
                files,
                ("tokenizer", "target", "regenerate"),
            )
        if stage == "calibrate":
            fields = (
                "calibrate",
                "evaluate.temperature",
                "evaluate.batch_size",
                "evaluate.max_len",
            )
            return fields, files, ("tokenizer", "target", "regenerate", "drafters")
        if stage == "evaluate":
            files["prompts"] = {Path(f).name: h.file(f) for f in c.data.eval_prompt_files}
            cost = self.rundir.cost_profile_path()  # the policies' cost model, when measured
            if cost.is_file():
                files["cost_profile"] = h.file(cost)
            up = ("tokenizer", "target", "drafters", "calibrate", *corpus)
            return ("name", "evaluate"), files, up
        raise ConfigError(f"unknown stage {stage!r} — stages: {', '.join(STAGES)}")

    def _tfds_source(self) -> dict:
        if self._tfds is None:
            self._tfds = tfds_source(self.cfg.data.tfds, self.cfg.data.tfds_data_dir or None)
        return self._tfds

    def inputs(self, stage: str) -> dict:
        fields, files, upstream = self._reads(stage)
        return {
            "fields": {f: _get(self.cfg, f) for f in fields},
            "files": files,
            "upstream": {u: self.key(u) for u in upstream},
        }

    def key(self, stage: str) -> str:
        if stage not in self._keys:
            self._keys[stage] = canonical_hash({"stage": stage, **self.inputs(stage)})
        return self._keys[stage]

    def _what_changed(self, stage: str) -> str:
        old = (self.store.done_info(stage) or {}).get("inputs")
        if not isinstance(old, dict):
            return ""
        new = self.inputs(stage)
        changed = []
        for part in ("fields", "files", "upstream"):
            a, b = old.get(part, {}), new[part]
            for k in sorted(set(a) | set(b)):
                if a.get(k) != b.get(k):
                    changed.append(k if part != "upstream" else f"{k} output")
        return ", ".join(changed)

    # -- bookkeeping ------------------------------------------------------------------------

    def stage_dir(self, stage: str) -> Path:
        """Where `stage`'s output is: its work folder while it runs, else the current output (on
        a bucket: a local scratch folder while it runs, a local copy of a finished output)."""
        if stage in self._building:
            return self._building[stage]
        cur = self.store.current(stage)
        if is_url(cur):
            info = self.store.read_done(cur)
            if info is not None:
                return local_copy(cur, stamp=str(info.get("key")))
        return cur

    def durable_dir(self, stage: str):
        """Where a running stage keeps work that must outlive this machine (checkpoints, shards
        written by every process): its work folder, in the bucket for a bucket run directory."""
        if stage in self._building and is_url(self.run):
            return self.store.work(stage, self.key(stage))
        return self.stage_dir(stage)

    def scratch_dir(self, stage: str, key: str) -> Path:
        """The local folder a stage of a bucket run directory builds in (`$DSPARK_CACHE`, default
        ~/.cache/dspark_jax, `scratch/<hash of the run URL>/<stage>.<key>`)."""
        cache = runtime.local_cache_dir()
        run = hashlib.sha256(str(self.run).encode()).hexdigest()[:16]
        return cache / "scratch" / run / f"{stage}.{key}"

    def is_done(self, stage: str) -> bool:
        return self.store.is_done(stage, self.key(stage))

    def done_info(self, stage: str) -> dict:
        return self.store.done_info(stage) or {}

    def run_stages(self, stages=STAGES, *, force=()):
        check_stage_names(stages, force)
        # a stage that is not run here must already be there for the stages that read it
        needed = {u for t in stages for u in self._reads(t)[2]} - set(stages)
        missing = [s for s in STAGES if s in needed and not self._recover(s)]
        if missing:
            raise ConfigError(
                f"stage(s) {', '.join(missing)} have no output for this configuration — run "
                f"them first (--stages {','.join(missing)},...) or drop --stages"
            )
        _on_main("setup", lambda: (self.run.mkdir(parents=True, exist_ok=True), self.hasher.save()))
        eta = PipelineEta(self.cfg, [s for s in STAGES if s in stages])
        for s in STAGES:
            if s not in stages:
                continue
            key = self.key(s)
            was_current = self.store.is_done(s, key)
            if s not in force and self._recover(s):
                eta.skipped(s)
                self.status[s] = "cached"
                self.log(f"[{s}] cached ({self.store.current(s)})")
                if not was_current:  # restored from previous/: the outputs changed
                    self._write_config()
                continue
            changed = self._what_changed(s)
            self.log(eta.line(s))
            self.log(f"[{s}] running" + (f" (changed: {changed})" if changed else ""))
            _on_main(f"begin_{s}", lambda s=s, key=key: self.store.begin(s, key, force=s in force))
            self._building[s] = self.store.work(s, key)
            if is_url(self.run):
                scratch = self.scratch_dir(s, key)
                if s in force and scratch.exists():
                    shutil.rmtree(scratch)
                scratch.mkdir(parents=True, exist_ok=True)
                self._building[s] = scratch
            t0 = time.perf_counter()
            try:
                info = getattr(self, f"_stage_{s}")()
            finally:
                self._building.pop(s)
            self.timings[s] = time.perf_counter() - t0
            info = {"seconds": self.timings[s], "inputs": self.inputs(s), **(info or {})}
            if is_url(self.run):  # the scratch folder into the bucket's work folder, then commit
                scratch = self.scratch_dir(s, key)
                _on_main(f"upload_{s}", lambda s=s, key=key, d=scratch: copy_tree(
                    d, self.store.work(s, key)))  # fmt: skip
                shutil.rmtree(scratch, ignore_errors=True)
            _on_main(
                f"commit_{s}",
                lambda s=s, key=key, info=info: self.store.commit(s, key, info, force=s in force),
            )
            self.rundir.forget()
            self._write_config()
            self.status[s] = "ran"
            eta.done(s, self.timings[s], info)
            self.log(f"[{s}] done in {self.timings[s]:.1f}s")
        if self.timings:
            self.log(f"[pipeline] done in {sum(self.timings.values()) / 60:.1f} min")
        self._write_config()
        return self.status

    def _recover(self, stage: str) -> bool:
        """`store.recover` done by process 0 (all processes then read the same answer)."""
        key = self.key(stage)
        _on_main(f"recover_{stage}", lambda: self.store.recover(stage, key))
        return self.store.is_done(stage, key)

    def _write_config(self):
        """config.json describes the run directory's outputs: written when a stage's output
        changed (ran or restored) and when the run finished, never before a stage fails."""
        _on_main("config", lambda: write_json_atomic(self.run / "config.json", self.cfg.to_json()))
