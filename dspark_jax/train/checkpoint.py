"""Training checkpoints: orbax, asynchronous, atomic, verified on restore.

A checkpoint directory holds one orbax step directory per saved step. Each step has two items:

* `state`: a pytree of arrays (the trainer saves `{"trainable", "opt_state"}`), written with
  `StandardSave` (OCDBT, sharded arrays written by the processes that own them);
* `meta`: a JSON object (step, data position, RNG key, configs, best score, ...) plus a
  fingerprint of `state` (per-leaf sums) added here.

Atomicity is orbax's: a step is written into `<step>.orbax-checkpoint-tmp` and renamed to
`<step>` once every item is committed (then `_CHECKPOINT_METADATA` exists), so a process killed
mid-save leaves only a temporary directory, which is never listed. On a bucket (`gs://`: an
object store renames nothing atomically) orbax writes the step in place and marks it complete
with `commit_success.txt` last; a step without it is partial. Saves are asynchronous: `save`
returns once the arrays are copied off the accelerator; `wait` blocks until the write committed.

Restore never returns silent garbage: a step directory lacking orbax's commit files, one that
orbax cannot read, or one whose restored arrays do not match the saved fingerprint is skipped
with a `CheckpointWarning` in favour of the previous good step (the skipped newer steps are
renamed `<step>.corrupt-<time>`, so the resumed run can write those steps again); if every step
is bad, `CheckpointError` says so and which directory to remove.

A trainer's run directory (`config.json` sidecar, `metrics.jsonl`, `checkpoints/`, `best/`):
`check_resumable` refuses a resume under another configuration (a run written before a
TrainConfig field existed resumes when the field's behaviour-preserving value holds,
`ADDED_TRAIN_FIELDS`), `restore_train_state` restores the newest good step, `trim_metrics_log`
drops the log of the steps a resume redoes, and `load_best_params` loads `best/` after checking
(`drafters.compat.check_fits`) that it was trained for the target at hand.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from dspark_jax.compat import check_trained_block, check_trained_window
from dspark_jax.drafters.compat import check_fits, recorded_target
from dspark_jax.errors import CheckpointError, ConfigError
from dspark_jax.io import atomic_write
from dspark_jax.storage import as_path, is_url, url_scheme

log = logging.getLogger(__name__)

_COMMIT_FILE = "_CHECKPOINT_METADATA"
_BUCKET_COMMIT_FILE = "commit_success.txt"  # orbax's completion marker on a bucket
_ITEMS = ("state", "meta")


class CheckpointWarning(UserWarning):
    """A corrupt or partial checkpoint step was skipped."""


@jax.jit
def _leaf_sums(leaves):
    return jnp.stack(
        [jnp.sum(jnp.asarray(x, jnp.float32)) for x in leaves]
        + [jnp.sum(jnp.abs(jnp.asarray(x, jnp.float32))) for x in leaves]
    )


def fingerprint(tree) -> list[float]:
    """Per-leaf sums and absolute sums of a pytree of arrays (fp32), as host floats."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return []
    return [float(v) for v in np.asarray(jax.device_get(_leaf_sums(leaves)))]


def abstract_like(tree):
    """`ShapeDtypeStruct`s (with shardings) of a live pytree: the restore target."""

    def one(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)


def _barrier_prefix(directory: Path) -> str:
    """The key of this checkpoint directory's cross-process barriers. Orbax names its barriers by
    step alone, so two managers saving the same step at once (a run's `checkpoints/` and `best/`
    at an evaluation step) joined one barrier and the multi-process save failed ("Barrier
    _async_commit_complete.6 is already ongoing"). The last path components are the same on every
    host even where the run directory is mounted at different places."""
    return "-".join(directory.parts[-3:])


def checkpoint_dir(directory):
    """The checkpoint directory as orbax takes it: an absolute `pathlib.Path` for a local path, an
    `etils.epath.Path` for a bucket URL. Orbax writes arrays through tensorstore, which it points
    at `gs://` buckets only (other URLs it would treat as local paths): refused in one line."""
    if not is_url(directory):
        return Path(directory).absolute()
    if url_scheme(directory) != "gs":
        raise ConfigError(
            f"{directory}: orbax writes checkpoints to local paths or gs:// buckets only, not "
            f"{url_scheme(directory)}://"
        )
    return as_path(directory)


class Checkpointer:
    """Save and restore `(state pytree, meta dict)` per step under `directory`.

    Keeps the newest `max_to_keep` steps. Every process of a multi-process run must call `save`
    and `restore` together (orbax synchronizes them); arrays keep the shardings of the restore
    target, so a checkpoint written on one mesh restores onto another.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 2, async_save=True):
        self.directory = checkpoint_dir(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            create=True,
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                barrier_sync_key_prefix=_barrier_prefix(self.directory)
            ),
        )
        self._mgr = ocp.CheckpointManager(self.directory, item_names=_ITEMS, options=options)

    # -- writing ---------------------------------------------------------------------------------

    def save(self, step: int, state, meta: dict[str, Any], *, force: bool = True) -> None:
        """Start saving `state` and `meta` as `step` (returns before the write completes)."""
        meta = dict(meta, step=int(step), fingerprint=fingerprint(state))
        self._mgr.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=force,
        )

    def wait(self) -> None:
        """Block until every started save has committed."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        self._mgr.wait_until_finished()
        self._mgr.close()

    def drop_steps_after(self, step: int) -> list[int]:
        """Delete the steps newer than `step` (e.g. best checkpoints of a future that a resume
        from `step` recomputes); returns them."""
        self._mgr.wait_until_finished()
        newer = [s for s in self._mgr.all_steps() if s > step]
        for s in newer:
            self._mgr.delete(s)
        return newer

    # -- reading ---------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, oldest first (temporary directories of interrupted saves excluded)."""
        return sorted(s for s in self._mgr.all_steps() if self._committed(s))

    def _committed(self, step: int) -> bool:
        d = self.directory / str(step)
        if is_url(self.directory) and not (d / _BUCKET_COMMIT_FILE).exists():
            return False
        return (d / _COMMIT_FILE).exists() and all((d / item).is_dir() for item in _ITEMS)

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON item of one step (no arrays are read)."""
        return self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def _restore_one(self, step: int, abstract_state):
        if not self._committed(step):
            raise CheckpointError(f"step {step} is partial (orbax commit files missing)")
        out = self._mgr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
            ),
        )
        state, meta = out["state"], out["meta"]
        if not isinstance(meta, dict) or meta.get("step") != step:
            raise CheckpointError(f"step {step}: metadata is missing or names another step")
        saved = np.asarray(meta.get("fingerprint", []), np.float64)
        got = np.asarray(fingerprint(state), np.float64)
        if saved.shape != got.shape or not np.allclose(got, saved, rtol=1e-4, atol=1e-5):
            raise CheckpointError(
                f"step {step}: restored arrays do not match the saved fingerprint"
            )
        return state, meta

    def _quarantine(self, bad_steps: list[int]) -> None:
        """Rename skipped steps newer than the restored one to `<step>.corrupt-<time>` (kept for
        inspection, never listed again), so the resumed run can save those steps afresh."""
        if not bad_steps:
            return
        if jax.process_index() == 0:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for b in bad_steps:
                src = self.directory / str(b)
                if src.exists():
                    src.rename(self.directory / f"{b}.corrupt-{stamp}")
                    log.warning("moved bad checkpoint %s aside to %s.corrupt-%s", src, b, stamp)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("dspark_checkpoint_quarantine")
        self._mgr.reload()

    def restore(self, abstract_state, step: int | None = None):
        """`(step, state, meta)` of the newest good step (or exactly `step`); None if empty.

        `abstract_state` is the structure to restore into (`abstract_like(live_state)`): same
        tree, shapes and dtypes as saved; arrays land with its shardings. A bad newest step is
        skipped with a `CheckpointWarning`; `CheckpointError` when no step is good (or the
        requested `step` is bad).
        """
        candidates = [step] if step is not None else self.steps()[::-1]
        present = sorted(self._mgr.all_steps())
        if step is None:
            for s in sorted(set(present) - set(candidates), reverse=True):
                warnings.warn(
                    f"checkpoint step {s} in {self.directory} is partial (commit files missing); "
                    "skipping it",
                    CheckpointWarning,
                    stacklevel=2,
                )
        if not candidates:
            if present:
                raise CheckpointError(
                    f"{self.directory} holds only partial checkpoints {present}; remove them to "
                    "start afresh"
                )
            return None
        errors = []
        for s in candidates:
            try:
                state, meta = self._restore_one(s, abstract_state)
            except Exception as e:  # orbax / tensorstore / json raise many types
                errors.append(f"step {s}: {type(e).__name__}: {str(e)[:300]}")
                if step is not None:
                    break
                warnings.warn(
                    f"checkpoint step {s} in {self.directory} is unreadable or corrupt ({e!s:.200});"
                    " falling back to the previous step",
                    CheckpointWarning,
                    stacklevel=2,
                )
                continue
            if step is None:
                self._quarantine([b for b in present if b > s])
            return s, state, meta
        raise CheckpointError(
            f"no usable checkpoint in {self.directory}: "
            + "; ".join(errors)
            + ". Remove the bad step directories (or the whole directory to start afresh)."
        )


# ------------------------------------------------------------------------------------------------
# Resuming a trainer's run directory (`config.json` sidecar, `metrics.jsonl`, `best/`)

# TrainConfig fields added after run directories were written, each with the value that
# reproduces how a run written before the field existed behaved (a function of that run's saved
# TrainConfig). Such a run resumes when the current value equals it; otherwise the refusal names
# the field and the value to set. A field added later goes here with its behaviour-preserving
# value (a field that cannot change the trajectory goes to TrainConfig.RESUMABLE_CHANGES).
ADDED_TRAIN_FIELDS: dict[str, Any] = {
    "target_dtype": lambda old: old.get("compute_dtype"),  # the target ran in the compute dtype
    "anchor_chunk": lambda old: -1,  # the drafter config's own anchor chunking
}
# sidecar entries added later that describe the run without changing its trajectory
ADDED_SIDECAR_KEYS = ("trained_for",)


def check_resumable(run_dir: Path, sidecar: dict[str, Any], resumable=()) -> None:
    """Refuse (ConfigError) to resume `run_dir` when its `config.json` describes another
    trajectory than `sidecar` (TrainConfig fields in `resumable` may differ)."""
    side = as_path(run_dir) / "config.json"
    if not side.exists():
        return
    try:
        old = json.loads(side.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{side} is corrupt ({e}); restore it or use a new run_dir") from e
    cur = json.loads(json.dumps(sidecar, default=str))
    diffs = []
    for k in sorted(set(old) | set(cur)):
        a, b = old.get(k), cur.get(k)
        if k == "train" and isinstance(a, dict) and isinstance(b, dict):
            for f in sorted(set(a) | set(b)):
                if f in resumable or a.get(f) == b.get(f):
                    continue
                if f not in a and f in ADDED_TRAIN_FIELDS:
                    was = ADDED_TRAIN_FIELDS[f](a)
                    if b.get(f) == was:
                        continue
                    raise ConfigError(
                        f"{run_dir} was trained before TrainConfig.{f} existed, as {f}={was!r}; "
                        f"set TrainConfig.{f}={was!r} to resume it (now {b.get(f)!r}), or use a "
                        "new run_dir"
                    )
                diffs.append(f"train.{f}: {a.get(f)!r} -> {b.get(f)!r}")
        elif k in ADDED_SIDECAR_KEYS and k not in old:
            continue
        elif k == "trained_for" and isinstance(a, dict) and isinstance(b, dict):
            # fields TargetId gained later (dtype, context window, RoPE) are not in older runs
            if any(a[f] != b.get(f) for f in a):
                diffs.append("trained_for differs")
        elif a != b:
            diffs.append(f"{k} differs")
    if diffs:
        raise ConfigError(
            f"{run_dir} holds a run with another configuration ({'; '.join(diffs)}); "
            "use a new run_dir, pass resume=False to a fresh directory, or restore the config"
        )


def trim_metrics_log(path: Path, last_step: int) -> None:
    """Drop the lines of `metrics.jsonl` after `last_step` (a resumed run redoes those steps)
    and a torn last line of a killed run."""
    path = as_path(path)
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line of a killed run
        if rec.get("step", 0) <= last_step:
            keep.append(line)
    with atomic_write(path) as f:
        f.write("".join(x + "\n" for x in keep))


def restore_train_state(ckpt: Checkpointer, best_ckpt: Checkpointer, live_state, cfg):
    """`(step, state, meta)` of the newest good training checkpoint (restored into the shapes,
    dtypes and shardings of `live_state`), or None. Refuses a checkpoint whose data position is
    not step x `cfg.global_batch_size`; drops the best checkpoints after the restored step (they
    belong to the discarded future: the resumed run recomputes them bit for bit)."""
    got = ckpt.restore(abstract_like(live_state))
    if got is None:
        return None
    step, state, meta = got
    if int(meta["data_position"]) != step * cfg.global_batch_size:
        raise CheckpointError(
            f"checkpoint {step}: data position {meta['data_position']} does not match "
            f"step x global_batch_size; the batch size changed, use a new run_dir"
        )
    best_ckpt.drop_steps_after(step)
    log.info("resumed from %s step %d", ckpt.directory, step)
    return step, state, meta


def load_best_params(
    run_dir: str | os.PathLike,
    abstract_trainable,
    *,
    target_cfg=None,
    drafter_cfg=None,
    target_name: str = "",
    vocab_hash: str = "",
):
    """`(step, trainable, meta)` of the best checkpoint in `run_dir/best` (restored into the
    structure, dtypes and shardings of `abstract_trainable`).

    With `target_cfg` and `drafter_cfg`: first checks (`drafters.compat.check_fits`, no array
    read) that the checkpoint was trained for this target (`target_name`, tokenizer
    `vocab_hash`; "" = unknown); ConfigError naming every difference if not."""
    ckpt = Checkpointer(as_path(run_dir) / "best", async_save=False)
    if target_cfg is not None and drafter_cfg is not None and ckpt.steps():
        side = ckpt.read_meta(ckpt.steps()[-1]).get("config") or {}
        check_fits(
            target_cfg,
            drafter_cfg,
            trained_for=recorded_target(side),
            name=target_name,
            vocab_hash=vocab_hash,
        )
        trained = side.get("drafter") or {}
        check_trained_block(drafter_cfg.block_size, trained.get("block_size"),
                            where=str(ckpt.directory))  # fmt: skip
        check_trained_window(drafter_cfg.context_window, trained.get("context_window"),
                             where=str(ckpt.directory))  # fmt: skip
    got = ckpt.restore({"trainable": abstract_trainable})
    if got is None:
        raise CheckpointError(f"{run_dir}/best holds no checkpoint; was an evaluation ever run?")
    step, state, meta = got
    return step, state["trainable"], meta
