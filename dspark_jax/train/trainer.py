"""Drafter training loop: optax AdamW, micro-step accumulation, online/offline target features,
orbax checkpoints with exact resume, held-out simulated τ, best-by-τ checkpoint.

    trainer = Trainer.for_drafter(train_cfg, drafter_cfg, target_params,
                                  train_data=samples, eval_data=held_out, run_dir="runs/x")
    result = trainer.run()          # resumes from run_dir/checkpoints if present

or, generic over any loss with the contract of `dspark_jax.train.losses` (`train.steps`):

    Trainer(train_cfg, loss_fn, trainable, frozen, train_data=..., target_cfg=...,
            target_params=..., run_dir=...)

The parts live next door: construction in `train.trainer_setup`, the optimizer in
`train.optimizer`, the jitted steps and their statics in `train.steps`, the memory plan in
`train.memory`, checkpoints and the resume checks of a run directory in `train.checkpoint`,
metric reduction and τ in `spec.metrics`, the drafter/target check in `drafters.compat`.

One optimizer step = `accum_steps` calls of the jitted micro-step (one compilation per sequence
bucket: forward of the frozen target in online mode, loss, gradient, fp32 accumulation) and one
call of the jitted update (compiled once: mean gradient, global-norm clip, AdamW, schedule).
The gradient is the equal-weight mean over micro-batches of each micro-batch's token-weighted
loss (docs/METHOD.md §4.3); a micro-batch is the global one over every device and process.

Determinism: the data order is a function of the stream position, the loss RNG of micro-step a
of update s is fold_in(fold_in(key(seed), s), a), and the optimizer state is restored exactly,
so a resumed run reproduces the uninterrupted loss trajectory bit for bit (same devices/flags).

Construction (validate -> plan memory -> place -> open the run directory) is the
`train.trainer_setup.TrainerSetup` mixin; this file is the loop (run, evaluate, save, resume)
and the constructors.

Run directory: `config.json` (sidecar: every config of the run and the target the drafter is
trained for), `metrics.jsonl` (one line per train step / evaluation), `checkpoints/` (latest
steps for resume), `best/` (trainable params of the best evaluation by `TrainConfig.best_metric`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import time
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from dspark_jax import parallel
from dspark_jax.config import DrafterConfig, MeshConfig, TargetConfig, TrainConfig
from dspark_jax.drafters import init_params
from dspark_jax.drafters.compat import check_fits
from dspark_jax.errors import ConfigError
from dspark_jax.spec.metrics import heldout_summary
from dspark_jax.storage import append_text, as_path
from dspark_jax.train import loader as loader_lib
from dspark_jax.train import losses
from dspark_jax.train import memory as memory_lib
from dspark_jax.train import steps as steps_lib
from dspark_jax.train.checkpoint import (
    check_resumable,
    load_best_params,
    restore_train_state,
)
from dspark_jax.train.trainer_setup import TrainerSetup

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainResult:
    step: int  # optimizer steps done in total (including before a resume)
    history: list[dict[str, Any]]  # train metrics of the steps run by this call
    evals: list[dict[str, Any]]  # evaluations run by this call
    best_score: float | None
    best_step: int | None
    resumed_from: int | None
    tokens: int = 0  # real (unpadded) training tokens of the steps run by this call
    seconds: float = 0.0  # wall time of those steps (with evaluations, without the final save)


def _jsonable(v):
    a = np.asarray(v)
    if a.ndim == 0:
        return float(a) if a.dtype.kind == "f" else int(a)
    return a.tolist()


class Trainer(TrainerSetup):
    """Trains `trainable` under `loss_fn` with the frozen parts (`frozen`, the target) held fixed.

    Construction validates everything (configs, drafter/target compatibility, datasets, an
    existing run directory's config, the memory plan) before writing anything, places the state
    on the mesh, then opens the run directory and restores its newest good checkpoint when
    `resume` (default). `run()` trains to the end of the schedule (or `max_steps` more steps) and
    always leaves a checkpoint of where it stopped.

    Parameters are placed on `mesh` (default: every device, data parallel) through the
    logical-axis table of `dspark_jax.parallel`; batches are split over ("data", "fsdp").
    `trainable` is kept in fp32 (master weights); `frozen` and `target_params` are stored in the
    compute dtype (the target in `target_dtype`). Only `trainable` enters the optimizer state.
    `target_name` / `vocab_hash` (of the target's tokenizer, `drafters.compat.vocab_hash`) are
    recorded with the target the drafter is trained for ("" = unknown). `loss_weights` (a
    pytree of arrays, or None) is the loss's last argument — the steps take it as data, so
    `set_loss_weights` changes it without a recompilation.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        loss_fn: steps_lib.LossFn,
        trainable,
        frozen,
        *,
        train_data,
        run_dir: str | os.PathLike,
        target_cfg: TargetConfig | None = None,
        target_params=None,
        eval_data=None,
        mesh: jax.sharding.Mesh | None = None,
        drafter_cfg: DrafterConfig | None = None,
        resume: bool = True,
        sidecar: dict[str, Any] | None = None,
        target_name: str = "",
        vocab_hash: str = "",
        loss_weights=None,
    ):
        self.cfg = cfg = memory_lib.resolve_dtypes(cfg)  # "auto": bf16 on accelerators, f32 on CPU
        self.drafter_cfg, self.target_cfg = drafter_cfg, target_cfg
        self.mesh = mesh if mesh is not None else parallel.make_mesh(MeshConfig())
        self.run_dir = as_path(run_dir)  # a local path or a bucket URL (`storage.as_path`)
        self.is_main = jax.process_index() == 0
        target_params = self._validate(train_data, eval_data, target_params, frozen, resume)
        self.spec = steps_lib.StepStatics.of(cfg, loss_fn, target_cfg)
        self.update_statics = steps_lib.UpdateStatics.of(cfg, self.total_steps)
        self.sidecar = self._sidecar(sidecar, target_name, vocab_hash)
        if resume and (self.run_dir / "checkpoints").exists():
            check_resumable(self.run_dir, self.sidecar, TrainConfig.RESUMABLE_CHANGES)
        self._plan_memory(trainable, frozen, target_params)
        self._place(trainable, frozen, target_params)
        self._loss_weights = None if loss_weights is None else self._placed(loss_weights)
        self._open_run_dir(resume)

    @classmethod
    def for_drafter(
        cls,
        cfg: TrainConfig,
        drafter_cfg: DrafterConfig,
        target_params,
        *,
        train_data,
        run_dir,
        eval_data=None,
        mesh=None,
        seed: int | None = None,
        resume: bool = True,
        target_name: str = "",
        vocab_hash: str = "",
    ) -> Trainer:
        """A DSpark / DFlash / Eagle3 drafter (`drafter_cfg.kind`) initialised for its target
        (`drafter_cfg.target`), trained with `train.losses.loss_fn`. `target_params` is the
        target's `nnx.State` (also the source of the frozen embedding / LM head copies).

        The loss weights and decay enter the steps as arrays (`losses.LossWeights`): drafters
        that differ only in those share the compiled steps."""
        if cfg.anchor_chunk >= 0 and drafter_cfg.kind != "eagle3":
            # a chunk of all anchors or more is no chunking
            chunk = cfg.anchor_chunk if cfg.anchor_chunk < drafter_cfg.num_anchors else 0
            drafter_cfg = drafter_cfg.replace(anchor_chunk=chunk)
        check_fits(drafter_cfg.target, drafter_cfg, target_params=target_params)
        params = init_params(drafter_cfg, seed=seed, target_params=target_params)
        return cls(
            cfg,
            functools.partial(losses.loss_fn, losses.loss_structure(drafter_cfg)),
            params.trainable,
            params.frozen,
            train_data=train_data,
            eval_data=eval_data,
            run_dir=run_dir,
            target_cfg=drafter_cfg.target,
            target_params=target_params,
            mesh=mesh,
            drafter_cfg=drafter_cfg,
            resume=resume,
            target_name=target_name,
            vocab_hash=vocab_hash,
            loss_weights=losses.LossWeights.of(drafter_cfg),
        )

    @property
    def loss_weights(self):
        return self._loss_weights

    def set_loss_weights(self, weights) -> None:
        """Train on with other loss weights (same structure and shapes: no recompilation). The
        run directory's config.json keeps the values the run started with."""
        old = self._loss_weights
        same = old is not None and jax.tree.structure(weights) == jax.tree.structure(old)
        if not same or any(
            np.shape(a) != np.shape(b)
            for a, b in zip(jax.tree.leaves(weights), jax.tree.leaves(old))
        ):
            raise ConfigError(
                "set_loss_weights needs weights shaped like the ones this Trainer was built with "
                f"({old!r}) — build them with losses.LossWeights.of(drafter_cfg)"
            )
        self._loss_weights = self._placed(weights)

    def _placed(self, weights):
        # numpy first: a Python float would enter weakly typed, a new signature (a recompile)
        return jax.device_put(jax.tree.map(np.asarray, weights), parallel.replicated(self.mesh))

    # -- checkpoints -------------------------------------------------------------------------------

    def _state(self):
        return {"trainable": self.trainable, "opt_state": self.opt_state}

    def _restore(self) -> None:
        got = restore_train_state(self.ckpt, self.best_ckpt, self._state(), self.cfg)
        if got is None:
            return
        step, state, meta = got
        self.trainable, self.opt_state = state["trainable"], state["opt_state"]
        self.step = self.resumed_from = self._saved_step = step
        self.base_key = jax.random.wrap_key_data(np.asarray(meta["rng"], np.uint32))
        self.best_score, self.best_step = meta.get("best_score"), meta.get("best_step")

    def save(self) -> None:
        """Start an asynchronous checkpoint of the current step (every process must call it)."""
        meta = {
            "data_position": self.step * self.cfg.global_batch_size,
            "rng": np.asarray(jax.random.key_data(self.base_key)).tolist(),
            "best_score": self.best_score,
            "best_step": self.best_step,
            "config": self.sidecar,
        }
        self.ckpt.save(self.step, self._state(), meta)
        self._saved_step = self.step

    def close(self) -> None:
        self.ckpt.close()
        self.best_ckpt.close()

    # -- steps -------------------------------------------------------------------------------------

    def _micro_args(self, grad_acc, metric_acc, batch, step, micro):
        return (self.spec, self.trainable, self.frozen, self.target_params, grad_acc, metric_acc,
                batch, self.base_key, np.int32(step), np.int32(micro),
                self._loss_weights)  # fmt: skip

    def _device_batch(self, source, mb: loader_lib.MicroBatch, after=None) -> dict[str, jax.Array]:
        return steps_lib.device_batch(self.mesh, source, mb, self.cfg.pad_id, after)

    def _init_accumulators(self, batch):
        grad_acc = self._zeros(self.trainable)
        if self._metric_keys is None:
            self._metric_keys = steps_lib.metric_shapes(
                self.spec, self.trainable, self.frozen, self.target_params, batch, self.base_key,
                self._loss_weights,
            )  # fmt: skip
        metric_acc = {
            k: jax.device_put(np.zeros(s, np.float32), parallel.replicated(self.mesh))
            for k, s in self._metric_keys.items()
        }
        return grad_acc, metric_acc

    # -- training ----------------------------------------------------------------------------------

    def run(self, max_steps: int | None = None, *, save_at_end: bool = True) -> TrainResult:
        """Train until the schedule ends (or `max_steps` more steps), evaluating, logging and
        checkpointing at the configured intervals; ends with a committed checkpoint (unless
        `save_at_end=False`, for benchmarks)."""
        cfg = self.cfg
        end = (
            self.total_steps if max_steps is None else min(self.total_steps, self.step + max_steps)
        )
        history: list[dict[str, Any]] = []
        evals: list[dict[str, Any]] = []
        pending: list[tuple[int, dict[str, jax.Array]]] = []
        bar = None
        if cfg.progress_bar and self.is_main and end > self.step:
            bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step")
        grad_acc = metric_acc = None
        t0, tokens = time.perf_counter(), 0

        def flush():
            if not pending:
                return
            host = jax.device_get([m for _, m in pending])
            lines = []
            for (s, _), m in zip(pending, host):
                rec = {"step": s, "split": "train", **{k: _jsonable(v) for k, v in m.items()}}
                history.append(rec)
                lines.append(rec)
            pending.clear()
            self._log(lines)
            if bar is not None:
                last = lines[-1]
                bar.set_postfix(loss=f"{last['loss']:.4f}", lr=f"{last['lr']:.2e}")

        while self.step < end:
            s = self.step
            micro = self.loader.micro_batches(s * cfg.global_batch_size)
            for a, mb in enumerate(micro):
                # gathered after the last micro-step or update (each returns grad_acc)
                batch = self._device_batch(self.train_source, mb, grad_acc)
                if grad_acc is None:
                    grad_acc, metric_acc = self._init_accumulators(batch)
                grad_acc, metric_acc = self._micro(
                    *self._micro_args(grad_acc, metric_acc, batch, s, a)
                )
                tokens += int(self.train_source.lengths[mb.indices[mb.indices >= 0]].sum())
            self.trainable, self.opt_state, grad_acc, metric_acc, metrics = self._apply(
                self.update_statics,
                self.trainable,
                self.opt_state,
                grad_acc,
                metric_acc,
                np.int32(s),
            )
            self.step = s + 1
            pending.append((self.step, metrics))
            if bar is not None:
                bar.update(1)
            if cfg.log_interval and self.step % cfg.log_interval == 0:
                flush()
            if cfg.eval_interval and self.step % cfg.eval_interval == 0 and self.eval_plan:
                flush()
                evals.append(self.evaluate())
            if cfg.checkpoint_interval and self.step % cfg.checkpoint_interval == 0:
                flush()
                self.save()
        flush()  # fetches the last step's metrics: every dispatched step has finished
        dt = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        if save_at_end and self._saved_step != self.step:
            self.save()
        self.ckpt.wait()
        self.best_ckpt.wait()
        log.info("trained to step %d (%.1f tokens/s)", self.step, tokens / max(dt, 1e-9))
        return TrainResult(
            self.step, history, evals, self.best_score, self.best_step, self.resumed_from,
            tokens, dt,
        )  # fmt: skip

    def evaluate(self) -> dict[str, Any]:
        """Held-out metrics at the current step; saves `best/` when `best_metric` improved."""
        sums: dict[str, np.ndarray] = {}
        for i, mb in enumerate(self.eval_plan):
            batch = self._device_batch(self.eval_source, mb)
            m = jax.device_get(
                self._eval(
                    self.spec,
                    self.trainable,
                    self.frozen,
                    self.target_params,
                    batch,
                    self.base_key,
                    np.int32(i),
                    self._loss_weights,
                )  # fmt: skip
            )
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + np.asarray(v, np.float64)
        res = heldout_summary(sums, len(self.eval_plan))
        rec = {"step": self.step, "split": "eval", **{k: _jsonable(v) for k, v in res.items()}}
        score = res.get(self.cfg.best_metric)
        if score is None:
            log.warning("eval metrics lack %r; no best checkpoint kept", self.cfg.best_metric)
        elif math.isfinite(score) and (self.best_score is None or score > self.best_score):
            self.best_score, self.best_step = float(score), self.step
            rec["best"] = True
            self.best_ckpt.save(
                self.step,
                {"trainable": self.trainable},
                {"metrics": rec, "config": self.sidecar},
            )
        self._log([rec])
        return rec

    def _log(self, records: list[dict[str, Any]]) -> None:
        if not self.is_main or not records:
            return
        append_text(self.run_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))


__all__ = ["TrainResult", "Trainer", "load_best_params"]
