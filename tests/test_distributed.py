"""Scale-out: the train step on a (data, fsdp, tensor) mesh of 8 simulated CPU devices follows the
one-device trajectory (toy drafter, and the real DSpark / DFlash / Eagle3 on fsdp x tensor
meshes); a checkpoint written on one mesh resumes on another; two processes joined by
jax.distributed on localhost train the real DSpark drafter on per-process data shards,
checkpoint and resume in lockstep."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import numpy as np
import pytest
from toy_train import base_config, make_samples, one_device_mesh, toy_trainer
from train_subprocess import drafter_trainer

from dspark_jax import parallel
from dspark_jax.config import MeshConfig
from tests.procs import free_port

HERE = Path(__file__).parent


def test_eight_device_mesh_matches_one_device_and_checkpoints_cross_meshes(tmp_path):
    assert jax.device_count() >= 8, "tests/conftest.py forces 8 host devices"
    # Adam's update g / (|g| + eps) amplifies reassociation noise in near-zero gradient entries,
    # so trajectories agree to float tolerance (not bitwise) and the learning rate is moderate.
    cfg = base_config(total_steps=4, learning_rate=1e-3)
    ref = toy_trainer(tmp_path / "one", cfg, mesh=one_device_mesh()).run()
    # fsdp x tensor over 8 devices (data x fsdp x tensor all > 1 hits the XLA bug below)
    mesh = parallel.make_mesh(MeshConfig(data=1, fsdp=2, tensor=4))
    t = toy_trainer(tmp_path / "eight", cfg, mesh=mesh)
    # parameters are really split by the logical-axis table, batches over data x fsdp
    heads = t.trainable["heads"][...]
    assert heads.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert len({d.id for d in heads.sharding.device_set}) == 8
    part = t.run(max_steps=2)
    t.close()
    chex.assert_trees_all_close(
        [h["loss"] for h in part.history], [h["loss"] for h in ref.history[:2]], rtol=1e-5
    )
    # the 8-device checkpoint resumes on one device and continues the same trajectory
    resumed = toy_trainer(tmp_path / "eight", cfg, mesh=one_device_mesh())
    assert resumed.resumed_from == 2
    rest = resumed.run()
    resumed.close()
    chex.assert_trees_all_close(
        [h["loss"] for h in rest.history], [h["loss"] for h in ref.history[2:]], rtol=1e-5
    )


REAL = [
    ("dspark", MeshConfig(data=1, fsdp=2, tensor=4)),
    ("dflash", MeshConfig(data=1, fsdp=4, tensor=2)),
    ("eagle3", MeshConfig(data=1, fsdp=2, tensor=4)),
]


@pytest.mark.slow  # ~40 s per drafter kind on 2 CPU cores
@pytest.mark.parametrize("kind,mesh_cfg", REAL, ids=[k for k, _ in REAL])
def test_real_drafter_on_fsdp_x_tensor_mesh_matches_one_device(tmp_path, kind, mesh_cfg):
    """Loss trajectory, gradient norms and final parameters on 8 devices == one device."""
    cfg = base_config(global_batch_size=4, micro_batch_size=4, total_steps=2, learning_rate=1e-3)
    data = make_samples(12, 256)
    runs = {}
    for name, mesh in (("one", one_device_mesh()), ("eight", parallel.make_mesh(mesh_cfg))):
        t = drafter_trainer(kind, tmp_path / name, cfg, mesh, data)
        res = t.run(save_at_end=False)
        runs[name] = (res.history, jax.tree.map(np.asarray, t.trainable))
        t.close()
    (h1, p1), (h8, p8) = runs["one"], runs["eight"]
    leaves = jax.tree.leaves(t.trainable)
    assert max(len(x.sharding.device_set) for x in leaves) == 8  # really spread over the mesh
    assert any(x.sharding.spec != jax.sharding.PartitionSpec() for x in leaves)
    pick = lambda h: [(r["loss"], r["grad_norm"]) for r in h]  # noqa: E731
    chex.assert_trees_all_close(pick(h8), pick(h1), rtol=1e-5)
    # Adam's g / (|g| + eps) turns reassociation noise in near-zero gradients into up to lr per
    # step: parameters agree to a small fraction of lr x steps (2e-3), losses to float precision
    chex.assert_trees_all_close(p8, p1, rtol=1e-4, atol=1e-4)


@pytest.mark.xfail(
    strict=True,
    reason="XLA (jax 0.10.2, CPU, Shardy and GSPMD) returns wrong gradients for this pattern on a "
    "2x2x2 (data, fsdp, tensor) mesh; remove the xfail when it passes",
)
def test_xla_gradient_on_a_2x2x2_mesh_is_correct():
    """Pure-JAX minimal repro of the partitioner bug that keeps the trainer tests off 2x2x2."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = parallel.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 8, 24)).astype(np.float32)
    fc = rng.normal(size=(24, 8)).astype(np.float32) * 0.3
    w = rng.normal(size=(8, 16)).astype(np.float32) * 0.3
    lm = rng.normal(size=(16, 32)).astype(np.float32) * 0.3

    def f(fc, w, lm, x):
        return jax.numpy.sum(jax.numpy.tanh((jax.numpy.tanh(x @ fc) @ w) @ lm))

    grad = jax.jit(jax.grad(f, argnums=(0, 1)))
    ref = grad(fc, w, lm, x)
    specs = (P(), P("fsdp", "tensor"), P("fsdp", "tensor"), P(("data", "fsdp")))
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((fc, w, lm, x), specs)]
    for got, want in zip(grad(*args), ref):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_two_processes_train_checkpoint_and_resume_in_lockstep(tmp_path):
    port = free_port()
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    procs, outs = [], []
    for i in range(2):
        out = tmp_path / f"p{i}.json"
        outs.append(out)
        cmd = [
            sys.executable,
            str(HERE / "train_subprocess.py"),
            "distributed",
            str(out),
            str(port),
            str(i),
            str(tmp_path / "shared"),
        ]
        log = open(tmp_path / f"p{i}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.time() + 300
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "\n".join((tmp_path / f"p{i}.log").read_text()[-2000:] for i in range(2))
    assert all(p.returncode == 0 for p in procs), logs
    r0, r1 = (json.loads(o.read_text()) for o in outs)
    for key in ("a", "b", "c"):
        assert r0[key] == r1[key], (key, r0[key], r1[key])  # both processes see the same losses
    assert r0["resumed_from"] == 3 and len(r0["b"]) == 2
    assert r0["a"] + r0["b"] == r0["c"]  # resume across processes continues exactly
    assert all(np.isfinite(r0["c"]))
    # per-process data shards: each process read only rows of its own (disjoint) shard
    assert r0["num_shards"] == r1["num_shards"] == 2
    assert not set(r0["shard"]) & set(r1["shard"])
    for r in (r0, r1):
        assert r["read"] and set(r["read"]) <= set(r["shard"]), (r["read"], r["shard"])
