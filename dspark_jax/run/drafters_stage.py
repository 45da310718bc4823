"""The drafters stage of `train.py`'s pipeline (`Pipeline._stage_drafters` delegates here):
each drafter kind trained against the run's target on the regenerated conversations. Each function
takes the `Pipeline` (`p`) for its config, loaders and log.
"""

from __future__ import annotations

import shutil
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from dspark_jax.errors import ConfigError
from dspark_jax.models.transformer import param_count
from dspark_jax.run.regenerate_stage import regen_target
from dspark_jax.train.data import encode_conversations, process_block
from dspark_jax.train.features import write_feature_cache
from dspark_jax.train.host_data import HostShards, HostTable, gather_hosts
from dspark_jax.train.memory import resolve_dtypes
from dspark_jax.train.trainer import Trainer


def run_drafters(p) -> dict:
    """The drafters stage's body: every drafter trained on the regenerated conversations, with
    the target's features online or from offline caches (one per run, or one per process)."""
    d = p.cfg.drafters
    tcfg, tparams = p.target()
    tok = p.tokenizer()
    rc = p.render_config(max_length=max(d.train.seq_buckets), min_loss_tokens=d.min_loss_tokens)
    # per host: each process reads and tokenizes only its block of the rows
    offline, per_host = d.train.feature_mode == "offline", p._per_host()
    train_convs = p._regenerated_block() if per_host else p._regenerated()[0]
    samples, stats = encode_conversations(tok, train_convs, rc)
    p.log(f"  {stats.summary()}")
    feature_dir = p.stage_dir("drafters") / "features"
    if per_host and offline:  # each process computes the features of its own rows
        train_s, eval_s = _host_feature_caches(p, feature_dir, samples)
    elif per_host:  # online: the one-process run's batches, gathered on the mesh
        table = HostTable.of(p.mesh, [samples])
        n_eval = max(d.train.global_batch_size, table.size // d.eval_one_in)
        eval_s = table.source(np.arange(min(n_eval, table.size)))
        train_s = table.source(np.arange(n_eval, table.size))
    else:
        n_eval = max(d.train.global_batch_size, len(samples) // d.eval_one_in)
        eval_s, train_s = samples[:n_eval], samples[n_eval:]
        if offline:  # one target pass shared by every drafter
            train_s, eval_s = _feature_caches(p, feature_dir, tcfg, tparams, train_s, eval_s)
    info = {}
    for kind in d.kinds:
        dcfg = p.rundir.drafter_config(kind, tcfg)
        trainer = Trainer.for_drafter(
            d.train, dcfg, tparams, train_data=train_s,
            eval_data=eval_s, run_dir=p.durable_dir("drafters") / kind,
            mesh=p.mesh, target_name=p.rundir.target_name(),
            vocab_hash=p.rundir.vocab_hash(),
        )  # fmt: skip
        p.log(f"  training {kind}: {param_count(trainer.trainable)} trainable parameters")
        res = trainer.run()
        best_step, best_score = res.best_step, res.best_score
        if not (trainer.run_dir / "best").is_dir() or best_step is None:
            # fewer steps than eval_interval, or resumed after the last step: evaluate now so
            # that the stage always ends with a best checkpoint
            trainer.evaluate()
            trainer.best_ckpt.wait()
            best_step, best_score = trainer.best_step, trainer.best_score
        if best_step is None:
            raise ConfigError(
                f"the {kind} drafter's evaluation gave no finite simulated τ, so there is no "
                "best checkpoint — lower drafters.train.learning_rate or raise "
                "drafters.train.total_steps"
            )
        info[kind] = {"best_step": best_step, "best_sim_tau": best_score}
    # derived data (one target pass to rebuild), not an output; per host, each process
    # removes its own caches (another may still be reading its own)
    mine = feature_dir / f"p{jax.process_index():05d}" if per_host else feature_dir
    if mine.is_dir():
        shutil.rmtree(mine)
    if per_host and offline:  # every process's caches are gone before the folder goes
        multihost_utils.sync_global_devices("feature caches removed")
        if jax.process_index() == 0 and feature_dir.is_dir():
            feature_dir.rmdir()
    return info


def _host_feature_caches(p, out, samples):
    """Offline features per host: this process's held-out and training samples (the first
    and the rest of its block; every process holds out its share of the one-process
    count), their features computed by its own copy of the target on its local devices
    (as regeneration runs) into its own caches, read as `host_data.HostShards`."""
    d, k, n = p.cfg.drafters, jax.process_index(), jax.process_count()
    total = int(gather_hosts(np.asarray([len(samples)], np.int64)).sum())
    n_eval = len(process_block(max(d.train.global_batch_size, total // d.eval_one_in), k, n))
    tcfg, tparams = regen_target(p)
    train_r, eval_r = _feature_caches(
        p, out / f"p{k:05d}", tcfg, tparams, samples[n_eval:], samples[:n_eval], local=True
    )
    p.rundir._cache.pop("regen_target", None)  # the run's target stays; this copy goes
    return HostShards(train_r), HostShards(eval_r)


def _feature_caches(p, out, tcfg, tparams, train_s, eval_s, local=False):
    """The target's features of the training and held-out samples, computed once
    (`train.features`, in the target's training dtype; resumed after an interruption)
    and read by every drafter's Trainer instead of running the target in each step."""
    t = resolve_dtypes(p.cfg.drafters.train)
    t0 = time.perf_counter()
    kw = dict(buckets=t.seq_buckets, batch_size=t.micro_batch_size, dtype=t.target_dtype)
    if local:  # this process's own samples, computed in this process alone
        kw.update(process_index=0, process_count=1)
    readers = [
        write_feature_cache(out / name, tcfg, tparams, samples, progress=True, **kw)
        for name, samples in (("train", train_s), ("eval", eval_s))
    ]
    mb = sum(f.stat().st_size for f in out.rglob("*.npy")) / 2**20
    p.log(f"  target features of {len(train_s) + len(eval_s)} samples: {mb:.0f} MiB in "
          f"{time.perf_counter() - t0:.0f} s, shared by the drafters")  # fmt: skip
    return readers[0], readers[1]
