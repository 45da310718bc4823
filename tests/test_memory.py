"""Memory plan: dtype resolution, the per-device estimate against XLA's compiled memory analysis,
and the refusal (naming the field to change)."""

from __future__ import annotations

import pytest
from toy_train import base_config, make_samples, one_device_mesh, tiny_target

from dspark_jax.config import ConfigError, DrafterConfig
from dspark_jax.train import memory
from dspark_jax.train.trainer import Trainer


def test_auto_dtypes_follow_the_backend():
    cfg = base_config(compute_dtype="auto")
    assert memory.resolve_dtypes(cfg, "cpu").compute_dtype == "float32"
    tpu = memory.resolve_dtypes(cfg, "tpu")
    assert (tpu.compute_dtype, tpu.target_dtype) == ("bfloat16", "bfloat16")
    mixed = memory.resolve_dtypes(base_config(compute_dtype="auto", target_dtype="float32"), "gpu")
    assert (mixed.compute_dtype, mixed.target_dtype) == ("bfloat16", "float32")
    assert memory.resolve_dtypes(base_config(compute_dtype="bfloat16"), "cpu").target_dtype == (
        "bfloat16"
    )
    with pytest.raises(ConfigError, match="target_dtype must be"):
        base_config(target_dtype="float16")
    with pytest.raises(ConfigError, match="memory_check must be"):
        base_config(memory_check="maybe")


def _dspark(tcfg, **kw):
    base = dict(num_layers=2, block_size=4, num_anchors=16, mask_token_id=255, markov_rank=16)
    return DrafterConfig.dspark(tcfg, **{**base, **kw})


def _trainer(tmp_path, cfg, dcfg=None, mesh=None, name="run"):
    tcfg, tparams = tiny_target()
    return Trainer.for_drafter(
        cfg,
        dcfg or _dspark(tcfg),
        tparams,
        train_data=make_samples(8, 256, lengths=(40, 120)),
        run_dir=tmp_path / name,
        mesh=mesh or one_device_mesh(),
    )


def test_estimate_agrees_with_xla_memory_analysis(tmp_path, capsys):
    """On CPU the compiled analysis is opt-in ("compiled"); the plan's activations + logits are
    within a factor 2 of XLA's temporaries and its params + optimizer state bound its arguments."""
    cfg = base_config(
        global_batch_size=4, micro_batch_size=4, seq_buckets=(128,), memory_check="compiled"
    )
    t = _trainer(tmp_path, cfg)
    out = capsys.readouterr().out
    assert "memory plan per device (4 seq x 128 tokens" in out and "XLA memory analysis" in out
    plan, got = t.memory_plan, t.compiled_memory
    assert got is not None and got["temp"] > 0
    est = plan.activations + plan.logits
    print(plan.to_json(), got)
    assert 0.5 <= est / got["temp"] <= 2.0, (est, got)
    # arguments: params (fp32 master, frozen, target) + accumulators + batch; no Adam moments
    assert plan.params <= got["argument"] <= plan.params + plan.optimizer
    # anchor_chunk from TrainConfig reaches the drafter and shrinks the logits by the chunk ratio
    small = _trainer(tmp_path, cfg.replace(anchor_chunk=4, memory_check="estimate"), name="c")
    assert small.drafter_cfg.anchor_chunk == 4
    assert small.memory_plan.logits * 4 == plan.logits
    for x in (t, small):
        x.close()


def test_a_plan_over_the_device_memory_is_refused_naming_the_field(tmp_path):
    tcfg, _ = tiny_target()
    cfg = base_config(global_batch_size=8, micro_batch_size=8, seq_buckets=(128,))
    roomy = _trainer(tmp_path, cfg.replace(device_memory_gib=1.0), name="ok")
    plan = roomy.memory_plan
    roomy.close()
    fixed, per_seq = plan.params + plan.optimizer, (plan.activations + plan.logits) / 8
    # room for ~2.5 sequences per device: micro_batch_size=2 is the fix
    gib = (fixed + 2.5 * per_seq) / memory.HEADROOM / memory.GIB
    with pytest.raises(ConfigError, match=r"set TrainConfig.micro_batch_size=2 \(gradient acc"):
        _trainer(tmp_path, cfg.replace(device_memory_gib=gib), name="a")
    # under one sequence (all anchors at once): a smaller anchor chunk is the fix
    gib = (fixed + 0.6 * per_seq) / memory.HEADROOM / memory.GIB
    with pytest.raises(ConfigError, match=r"anchor_chunk=\d+ \(anchors per"):
        _trainer(tmp_path, cfg.replace(device_memory_gib=gib), name="b")
    # not even the parameters fit
    with pytest.raises(ConfigError, match="alone exceed it: shard them"):
        _trainer(tmp_path, cfg.replace(device_memory_gib=fixed / memory.GIB / 2), name="c")
    # memory_check="off" trusts the user
    _trainer(tmp_path, cfg.replace(device_memory_gib=1e-6, memory_check="off"), name="d").close()
    assert not any((tmp_path / n).exists() for n in "abc")  # refused before writing anything
