"""Subprocess driver for the kill/resume and multi-process tests (not collected by pytest).

python tests/train_subprocess.py kill RUN_DIR HANG_AT
    Train the toy drafter (config of `kill_config()`); right after update HANG_AT (1-based)
    wait for the pending checkpoint, print "HANG" and sleep until killed.

python tests/train_subprocess.py distributed OUT_JSON PORT PROCESS_ID SHARED_DIR
    One of two processes (2 CPU devices each) joined by jax.distributed over loopback:
    trains 3 steps and checkpoints (run A), resumes A in a new Trainer for 2 more steps, and
    trains 5 steps uninterrupted (run C); writes the per-step losses as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]


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


def distributed_mode(out_json: str, port: int, process_id: int, shared: str) -> None:
    import jax

    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=120,
    )
    from toy_train import base_config, toy_trainer

    from dspark_jax import parallel
    from dspark_jax.config import MeshConfig

    assert jax.device_count() == 4 and jax.local_device_count() == 2
    mesh = parallel.make_mesh(MeshConfig(data=2, fsdp=2))
    cfg = base_config(global_batch_size=8, micro_batch_size=4, total_steps=5)
    a = toy_trainer(os.path.join(shared, "a"), cfg, mesh=mesh)
    ra = a.run(max_steps=3)
    a.close()
    b = toy_trainer(os.path.join(shared, "a"), cfg, mesh=mesh)
    resumed = b.resumed_from
    rb = b.run()
    b.close()
    c = toy_trainer(os.path.join(shared, "c"), cfg, mesh=mesh)
    rc = c.run(save_at_end=False)
    c.close()
    out = {
        "process": process_id,
        "a": [h["loss"] for h in ra.history],
        "b": [h["loss"] for h in rb.history],
        "c": [h["loss"] for h in rc.history],
        "resumed_from": resumed,
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
