"""Subprocess driver for the kill/resume and multi-process tests (not collected by pytest).

python tests/train_subprocess.py kill RUN_DIR HANG_AT
    Train the toy drafter (config of `kill_config()`); right after update HANG_AT (1-based)
    wait for the pending checkpoint, print "HANG" and sleep until killed.

python tests/train_subprocess.py distributed OUT_JSON PORT PROCESS_ID SHARED_DIR
    One of two processes (2 CPU devices each) joined by jax.distributed over loopback, training
    the real DSpark drafter (tiny config) on a (data=2, fsdp=2) mesh with per-process data shards:
    trains 3 steps and checkpoints (run A), resumes A in a new Trainer for 2 more steps, and
    trains 5 steps uninterrupted (run C); writes the per-step losses, the source rows this process
    read and the rows of its data shard as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time

# run as a script, its own folder (tests/: toy_train) is importable; the callers put the
# repository on PYTHONPATH


def kill_config():
    from toy_train import base_config

    return base_config(total_steps=8, checkpoint_interval=3)


def kill_mode(run_dir: str, hang_at: int) -> None:
    import jax
    from toy_train import toy_trainer

    t = toy_trainer(run_dir, kill_config())
    apply = t._apply

    def hanging_apply(*args):
        out = apply(*args)
        if int(args[-1]) + 1 == hang_at:
            jax.block_until_ready(out)
            t.ckpt.wait()
            print("HANG", flush=True)
            time.sleep(600)
        return out

    t._apply = hanging_apply
    t.run()


class RecordingSource:
    """A training source that records which rows were read (to check per-process shards)."""

    def __init__(self, samples):
        from dspark_jax.train.loader import InMemorySource

        self.inner = InMemorySource(samples)
        self.lengths, self.num_loss_tokens = self.inner.lengths, self.inner.num_loss_tokens
        self.read: set[int] = set()

    def __len__(self):
        return len(self.inner)

    def get(self, i):
        self.read.add(int(i))
        return self.inner.get(i)


def tiny_drafter(kind: str, tcfg):
    """Tiny real drafter configs (1 layer, γ = 3) for the tiny target (vocab 256)."""
    from dspark_jax.config import DrafterConfig

    if kind == "eagle3":
        return DrafterConfig.eagle3(tcfg, block_size=3)
    small = dict(num_layers=1, block_size=3, num_anchors=8, mask_token_id=255)
    if kind == "dflash":
        return DrafterConfig.dflash(tcfg, **small)
    return DrafterConfig.dspark(tcfg, **small, markov_rank=16)


def drafter_trainer(kind, run_dir, cfg, mesh, train_data):
    """Trainer.for_drafter over the tiny target (online features)."""
    from toy_train import tiny_target

    from dspark_jax.train.trainer import Trainer

    tcfg, tparams = tiny_target()
    return Trainer.for_drafter(
        cfg, tiny_drafter(kind, tcfg), tparams, train_data=train_data, run_dir=run_dir, mesh=mesh
    )


def distributed_mode(out_json: str, port: int, process_id: int, shared: str) -> None:
    import jax

    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=120,
    )
    from toy_train import base_config, make_samples

    from dspark_jax import parallel
    from dspark_jax.config import MeshConfig

    assert jax.device_count() == 4 and jax.local_device_count() == 2
    mesh = parallel.make_mesh(MeshConfig(data=2, fsdp=2))
    cfg = base_config(global_batch_size=8, micro_batch_size=4, total_steps=5, learning_rate=3e-3)
    data = RecordingSource(make_samples(24, 256))

    def run(name, **kw):
        t = drafter_trainer("dspark", os.path.join(shared, name), cfg, mesh, data)
        resumed, res = t.resumed_from, t.run(**kw)
        t.close()
        return t, resumed, [h["loss"] for h in res.history]

    a, _, la = run("a", max_steps=3)
    _, resumed, lb = run("a")
    _, _, lc = run("c", save_at_end=False)
    out = {
        "process": process_id,
        "a": la,
        "b": lb,
        "c": lc,
        "resumed_from": resumed,
        "num_shards": a.loader.num_shards,
        "read": sorted(data.read),
        "shard": a.loader.shard_rows(process_id).tolist(),
    }
    with open(out_json, "w") as f:
        json.dump(out, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "kill":
        kill_mode(sys.argv[2], int(sys.argv[3]))
    elif mode == "distributed":
        distributed_mode(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
