"""How a `Trainer` is built (a mixin of `train.trainer`, the pattern of `engine.loop`):
validate everything that needs no device memory -> plan and check memory -> place the state and
the jitted steps on the mesh -> open the run directory (checkpointers, resume, `config.json`).
Nothing is written to the run directory before every check passed.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import optax

from dspark_jax import parallel
from dspark_jax.config import DrafterConfig
from dspark_jax.drafters.compat import TargetId, check_fits
from dspark_jax.errors import ConfigError
from dspark_jax.io import atomic_write
from dspark_jax.train import memory as memory_lib
from dspark_jax.train import steps as steps_lib
from dspark_jax.train.checkpoint import Checkpointer, trim_metrics_log
from dspark_jax.train.optimizer import make_optimizer


def _drafter_json(cfg: DrafterConfig) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d["target"] = cfg.target.to_json()
    return d


class TrainerSetup:
    """`Trainer`'s construction steps; they set the state `Trainer`'s loop reads."""

    # -- construction: validate -> place -> open the run directory ---------------------------------

    def _validate(self, train_data, eval_data, target_params, frozen, resume):
        """Every check that needs no device memory; returns the target params the steps use
        (None offline). Nothing is written before all of them passed."""
        cfg, target_cfg, drafter_cfg = self.cfg, self.target_cfg, self.drafter_cfg
        target_params = steps_lib.check_features(
            cfg, target_cfg, target_params, train_data, eval_data
        )
        if drafter_cfg is not None and target_cfg is not None:
            check_fits(target_cfg, drafter_cfg, target_params=target_params, frozen=frozen)
        self.data = steps_lib.plan_data(cfg, self.mesh, train_data, eval_data)
        self.train_source, self.loader = self.data.train_source, self.data.loader
        self.eval_source, self.eval_plan = self.data.eval_source, self.data.eval_plan
        self.total_steps = cfg.total_steps or cfg.num_epochs * self.loader.steps_per_epoch
        ckpt_dir = self.run_dir / "checkpoints"
        if not resume and ckpt_dir.exists() and any(ckpt_dir.iterdir()):
            raise ConfigError(
                f"{ckpt_dir} already holds checkpoints and resume=False; use a new run_dir (or "
                "resume=True to continue that run)"
            )
        return target_params

    def _sidecar(self, extra, target_name: str, vocab_hash: str) -> dict[str, Any]:
        """`config.json`: every config of the run and the target the drafter is trained for."""
        tcfg, dcfg = self.target_cfg, self.drafter_cfg
        side = {
            "train": self.cfg.to_json(),
            "target": None if tcfg is None else tcfg.to_json(),
            "drafter": None if dcfg is None else _drafter_json(dcfg),
            "total_steps": self.total_steps,
            **(extra or {}),
        }
        if tcfg is not None:
            tid = TargetId.of(tcfg, name=target_name, vocab_hash=vocab_hash)
            side["trained_for"] = tid.to_json()
        return side

    def _plan_memory(self, trainable, frozen, target_params) -> None:
        """The per-device memory plan: printed, and refused when it cannot fit, before anything
        is placed."""
        cfg = self.cfg
        self._param_sh = steps_lib.shardings(trainable, self.mesh)
        self._frozen_sh = steps_lib.shardings(frozen, self.mesh)
        self._target_sh = None
        if target_params is not None:
            self._target_sh = steps_lib.shardings(target_params, self.mesh)
        self.memory_plan = memory_lib.plan_memory(
            cfg,
            self.mesh,
            trainable=trainable,
            trainable_shardings=self._param_sh,
            frozen=frozen,
            frozen_shardings=self._frozen_sh,
            target_params=target_params,
            target_shardings=self._target_sh,
            target_cfg=self.target_cfg,
            drafter_cfg=self.drafter_cfg,
        )
        self.compiled_memory: dict[str, int] | None = None
        if cfg.memory_check != "off":
            if self.is_main:
                print(self.memory_plan.summary(), flush=True)
            memory_lib.check_memory(
                cfg, self.memory_plan, self.mesh, self.target_cfg, self.drafter_cfg
            )

    def _place(self, trainable, frozen, target_params) -> None:
        """State on the mesh (fp32 master weights, frozen parts in their dtypes), the optimizer
        state sharded like its parameters, the jitted steps."""
        cfg, repl = self.cfg, parallel.replicated(self.mesh)
        param_sh = self._param_sh
        tdt = jnp.bfloat16 if cfg.target_dtype == "bfloat16" else jnp.float32
        self.trainable = jax.device_put(steps_lib.cast_floats(trainable, jnp.float32), param_sh)
        self.frozen = jax.device_put(
            steps_lib.cast_floats(frozen, self.spec.dtype), self._frozen_sh
        )
        self.target_params = None
        if target_params is not None:
            self.target_params = jax.device_put(
                steps_lib.cast_floats(target_params, tdt), self._target_sh
            )
        tx = make_optimizer(cfg, self.total_steps)
        # Adam moments live where their parameters live; counters are replicated.
        opt_sh = optax.tree_utils.tree_map_params(
            tx,
            lambda _, sh: sh,
            jax.eval_shape(tx.init, self.trainable),
            param_sh,
            transform_non_params=lambda _: repl,
        )
        self.opt_state = jax.jit(tx.init, out_shardings=opt_sh)(self.trainable)
        jitted = steps_lib.jitted
        self._zeros = jitted(steps_lib.zeros_f32, (), (), param_sh)
        self._micro = jitted(
            steps_lib.train_micro_step, ("statics",), ("grad_acc", "metric_acc"), (param_sh, repl)
        )
        self._apply = jitted(
            steps_lib.train_apply_step,
            ("statics",),
            ("trainable", "opt_state", "grad_acc", "metric_acc"),
            (param_sh, opt_sh, param_sh, repl, repl),
        )
        self._eval = jitted(steps_lib.eval_step, ("statics",), (), repl)
        self.base_key = jax.random.key(cfg.seed)
        self.step = 0
        self.best_score: float | None = None
        self.best_step: int | None = None
        self.resumed_from: int | None = None
        self._metric_keys = None
        self._saved_step: int | None = None

    def _open_run_dir(self, resume: bool) -> None:
        """Checkpointers, the resume, the compiled memory check, `config.json` (process 0)."""
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt = Checkpointer(
            self.run_dir / "checkpoints",
            max_to_keep=cfg.keep_checkpoints,
            async_save=cfg.async_checkpoint,
        )
        self.best_ckpt = Checkpointer(
            self.run_dir / "best", max_to_keep=1, async_save=cfg.async_checkpoint
        )
        if resume:
            self._restore()
        check = cfg.memory_check
        if check == "compiled" or (check == "auto" and jax.default_backend() != "cpu"):
            self._check_compiled_memory()
        if self.is_main:
            with atomic_write(self.run_dir / "config.json") as f:
                json.dump(self.sidecar, f, indent=1, default=str)
            trim_metrics_log(self.run_dir / "metrics.jsonl", self.step)

    def _check_compiled_memory(self) -> None:
        """Compile the micro-step for the largest bucket ahead of time and compare XLA's
        per-device memory analysis with the plan; refuse when XLA's total exceeds the limit."""
        shape = (self.cfg.micro_batch_size, max(self.cfg.seq_buckets))
        batch = steps_lib.abstract_batch(self.mesh, self.data, shape)
        grad_acc, metric_acc = self._init_accumulators(batch)
        lowered = self._micro.lower(*self._micro_args(grad_acc, metric_acc, batch, 0, 0))
        self.compiled_memory = memory_lib.check_compiled(
            lowered.compile(), self.memory_plan, self.cfg, self.mesh, self.target_cfg,
            self.drafter_cfg, verbose=self.is_main,
        )  # fmt: skip
