"""Settings that would quietly ruin acceptance are refused before any work (issue 42, item 1):
γ above the trained block, a drafter for another target (dtype, context window, RoPE), STS for
another γ, a cost profile for another target or device, sampling knobs out of range. Each through
the Python API (one ConfigError naming the field and the fix) and a few through the real CLI
(exit 2, one `error:` line on stderr, no traceback, before any model loads)."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from dspark_jax import drafters
from dspark_jax.compat import check_cost_profile, device_name, load_cost_profile, target_shape_key
from dspark_jax.config.pipeline import PipelineConfig
from dspark_jax.drafters.compat import TargetId, check_fits
from dspark_jax.drafters.hf import load_hf_drafter, save_hf_drafter
from dspark_jax.engine import ServingEngine
from dspark_jax.errors import ConfigError
from dspark_jax.models import init_params
from dspark_jax.models.hf import save_target_hf
from dspark_jax.run.rundir import RunDir
from dspark_jax.run.validate import validate_config
from dspark_jax.sched.cost import CostProfile
from dspark_jax.sched.policies import AsyncTopK
from dspark_jax.sched.sts import STS
from dspark_jax.testing import tiny_drafter_config, tiny_target_config, tiny_tokenizer
from dspark_jax.train.checkpoint import Checkpointer, check_resumable

ROOT = pathlib.Path(__file__).resolve().parents[1]
GAMMA = 4


@pytest.fixture(scope="module")
def models():
    tcfg = tiny_target_config(vocab_size=128)
    tp = init_params(tcfg, 0)
    dcfg = tiny_drafter_config("dspark", tcfg)
    return tcfg, tp, dcfg, drafters.init_params(dcfg, target_params=tp)


def _engine(models, **kw):
    tcfg, tp, dcfg, dp = models
    return ServingEngine(tcfg, dcfg, tp, dp, num_slots=1, max_len=32, prompt_buckets=(8,), **kw)


def _cost(**record) -> CostProfile:
    return CostProfile((1, 64), (100.0, 50.0), **record)


def _refused(match: str):
    return pytest.raises(ConfigError, match=match)


# ---- the Python API ----------------------------------------------------------------------------


def test_gamma_and_policy_lengths_above_the_trained_block(models):
    with _refused(r"gamma \(fixed policy\)=5 exceeds the drafter's trained block size 4 — use"):
        _engine(models, policy="fixed", gamma=GAMMA + 1)
    policy = AsyncTopK(_cost(), cold_start_gamma=GAMMA + 2)
    with _refused(r"cold_start_gamma \(async policy\)=6 exceeds .* block size 4"):
        _engine(models, policy=policy)
    eng = _engine(models, policy="fixed", gamma=GAMMA)  # the block itself is fine
    with _refused("exceeds the drafter's trained block size"):  # and a swap is checked too
        eng.set_policy("fixed", gamma=GAMMA + 1)


def test_sts_fitted_for_another_gamma(models):
    for temps in ((1.0,) * (GAMMA - 1), (1.0,) * (GAMMA + 1)):
        with _refused(rf"{len(temps)} confidence_temperatures .* γ=4 — recalibrate for γ=4"):
            _engine(models, policy="threshold", sts=STS(temps))
    _engine(models, policy="threshold", sts=STS((0.5, 1.0, 2.0, 3.0)))


def test_cost_profile_for_another_target_or_device(models, tmp_path):
    tcfg = models[0]
    here = dict(target=target_shape_key(tcfg), device=device_name())
    _engine(models, policy="alg1", cost_profile=_cost(**here))
    _engine(models, policy="alg1", cost_profile=_cost())  # built in code: no record to check
    other = target_shape_key(tcfg.replace(hidden_size=128, head_dim=32))
    with _refused(f"measured for target '{other}', this target is .*decode_cost.py"):
        _engine(models, policy="alg1", cost_profile=_cost(target=other, device=device_name()))
    with _refused("measured on 'gpu:NVIDIA H200 x8', this process runs on"):
        _engine(models, policy="async", cost_profile=_cost(target=here["target"],
                                                            device="gpu:NVIDIA H200 x8"))  # fmt: skip
    # a file records what it was measured for (the record survives save / load) ...
    _cost(**here).save(tmp_path / "here.json")
    assert load_cost_profile(tmp_path / "here.json") == _cost(**here)
    # ... one written before they were recorded is used, with a warning (existing runs' profiles)
    _cost().save(tmp_path / "bare.json")
    assert load_cost_profile(tmp_path / "bare.json") == _cost()
    # ... and so are the packaged defaults (their behaviour unchanged)
    import dspark_jax.data

    shipped = pathlib.Path(dspark_jax.data.__file__).parent / "decode_cost.tiny.json"
    check_cost_profile(load_cost_profile(shipped), tcfg)


def test_drafter_parameters_in_another_dtype(models):
    tcfg, tp, dcfg, dp = models
    half = dp._replace(trainable=jax.tree.map(lambda x: x.astype(jnp.float16), dp.trainable))
    with _refused(r"drafter parameters are float16 but its config says dtype='float32' — load"):
        ServingEngine(tcfg, dcfg, tp, half, num_slots=1, max_len=32, prompt_buckets=(8,))


@pytest.mark.parametrize(
    "change, needle",
    [
        (dict(dtype="bfloat16"), "dtype: drafter trained on float32 target features"),
        (dict(max_position_embeddings=8192), r"context window \(max_position_embeddings\)"),
        (dict(rope_theta=10000.0), r"RoPE \(rope_theta / rope_scaling\)"),
        (dict(hidden_size=128, head_dim=32), r"hidden size \(hidden_size\)"),
        (dict(vocab_size=256), r"vocabulary \(vocab_size\)"),
        (dict(target_layer_ids=(0, 2)), "feature layer ids"),
    ],
)
def test_drafter_recorded_for_another_target(models, change, needle):
    tcfg, _, dcfg, _ = models
    served = tcfg.replace(**change)
    with _refused(needle + ".* — load the drafter trained for this target"):
        check_fits(served, trained_for=TargetId.of(tcfg))
    if "vocab_size" not in change:  # the engine refuses the pair too (its drafter's target)
        with _refused(needle):
            check_fits(served, dcfg)


def test_a_shorter_context_window_and_older_records_still_fit(models):
    tcfg, _, dcfg, _ = models
    check_fits(tcfg.replace(max_position_embeddings=256), trained_for=TargetId.of(tcfg))
    old = {k: v for k, v in TargetId.of(tcfg).to_json().items()
           if k not in ("dtype", "max_position_embeddings", "rope_theta", "rope_scaling")}  # fmt: skip
    check_fits(tcfg.replace(dtype="bfloat16"), trained_for=TargetId.from_json(old))


def test_a_run_recorded_before_the_new_target_fields_still_resumes(models, tmp_path):
    """`trained_for` gained dtype / context window / RoPE: an older run's record lacks them, and
    its resume is not refused for that; a field it does record must still agree."""
    tcfg = models[0]
    new = {"train": {}, "trained_for": TargetId.of(tcfg).to_json()}
    old = {k: v for k, v in new["trained_for"].items() if k not in ("dtype", "rope_theta")}
    (tmp_path / "config.json").write_text(json.dumps({"train": {}, "trained_for": old}))
    check_resumable(tmp_path, new)
    other = {"train": {}, "trained_for": TargetId.of(tcfg.replace(vocab_size=256)).to_json()}
    with _refused("trained_for differs"):
        check_resumable(tmp_path, other)


def test_sampling_knobs_of_the_pipeline_config():
    cfg = PipelineConfig()
    for section, field, value, needle in [
        ("regenerate", "temperature", 1e-6, "regenerate.temperature/top_k/top_p: temperature"),
        ("evaluate", "temperatures", (0.0, -1.0), r"evaluate.temperature\(s\): temperature"),
    ]:
        bad = dataclasses.replace(
            cfg, **{section: dataclasses.replace(getattr(cfg, section), **{field: value})}
        )
        with _refused(needle):
            validate_config(bad)


def test_hf_drafter_block_override_above_its_checkpoint(models, tmp_path):
    tcfg, tp, dcfg, dp = models
    save_hf_drafter(dcfg, dp, tmp_path / "d")
    with _refused("block_size=6 exceeds the drafter's trained block size 4"):
        load_hf_drafter(tmp_path / "d", target=tcfg, block_size=6)


# ---- a run directory ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as train.py leaves it, minus the training: an HF target and tokenizer by
    path, a best checkpoint recording its block size and target, a calibration for γ=4."""
    root = tmp_path_factory.mktemp("refusals")
    tok = tiny_tokenizer(tmp_path_factory.getbasetemp() / "tok_cache")
    tcfg = tiny_target_config(vocab_size=512)
    tp = init_params(tcfg, 0)
    target = root / "target"
    save_target_hf(tcfg, tp, target, tokenizer=tok)
    if not (target / "tokenizer.json").exists():
        tok.save_pretrained(target)
    cfg = PipelineConfig()
    cfg = dataclasses.replace(
        cfg,
        tokenizer=dataclasses.replace(cfg.tokenizer, path=str(target)),
        target=dataclasses.replace(cfg.target, path=str(target)),
        drafters=dataclasses.replace(
            cfg.drafters, kinds=("dspark",), block_size=GAMMA, markov_rank=16
        ),  # fmt: skip
    )
    run_path = root / "run"
    run_path.mkdir()
    (run_path / "config.json").write_text(json.dumps(cfg.to_json()))
    run = RunDir(run_path)
    tcfg, tp = run.target()
    dcfg = run.drafter_config("dspark", tcfg)
    params = drafters.init_params(dcfg, target_params=tp)
    tid = TargetId.of(tcfg, name=run.target_name(), vocab_hash=run.vocab_hash())
    ck = Checkpointer(run.drafter_dir("dspark") / "best", max_to_keep=1, async_save=False)
    meta = {"trained_for": tid.to_json(), "drafter": {"block_size": GAMMA}}
    ck.save(1, {"trainable": params.trainable}, {"config": meta})
    ck.close()
    STS((0.75, 1.5, 2.5, 4.0)).save(run.stage_dir("calibrate") / "sts.json")
    return run_path


def test_run_dir_refusals(run_dir):
    cfg = RunDir(run_dir).config
    assert RunDir(run_dir).sts() == STS((0.75, 1.5, 2.5, 4.0))
    six = dataclasses.replace(cfg, drafters=dataclasses.replace(cfg.drafters, block_size=6))
    with _refused(r"drafters.block_size=6 but the drafter was trained with block_size=4 .*"
                  "— set drafters.block_size=4"):  # fmt: skip
        RunDir(run_dir, config=six).drafter("dspark")
    with _refused("4 confidence_temperatures but the drafter drafts γ=6"):  # fitted for γ=4
        RunDir(run_dir, config=six).sts()
    other = _cost(target="qwen3 L2 H8", device="gpu:NVIDIA H200 x8")
    (run_dir / "cost_profile.json").write_text(other.to_json())
    try:
        with _refused("cost_profile.json was measured on 'gpu:NVIDIA H200 x8'"):
            RunDir(run_dir).cost_profile()
    finally:
        (run_dir / "cost_profile.json").unlink()


# ---- the real CLI ------------------------------------------------------------------------------


def _cli(*args):
    env = dict(os.environ, TQDM_DISABLE="1")
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)  # fmt: skip


def test_cli_refuses_before_loading_any_model(run_dir, tmp_path):
    """One subprocess per entry point: serve.py serve / generate and train.py; each exits 2 with
    one `error:` line, no traceback, before the target is loaded (no 'loaded' log line)."""
    gpu = tmp_path / "gpu.json"
    _cost(target="qwen3 L2 H8", device="gpu:NVIDIA H200 x8").save(gpu)
    cases = [
        (["serve.py", "serve", "--run-dir", str(run_dir), "--gamma", "9"],
         "--gamma=9 exceeds the drafter's trained block size 4"),
        (["serve.py", "generate", "--run-dir", str(run_dir), "--prompt", "hi", "--policy",
          "dspark", "--cost-profile", str(gpu)], "was measured on 'gpu:NVIDIA H200 x8'"),
        (["train.py", "--config", "configs/micro.py", "--run-dir", str(tmp_path / "r"), "--set",
          "regenerate.temperature=0.00001"], "regenerate.temperature/top_k/top_p"),
    ]  # fmt: skip
    for argv, needle in cases:
        p = _cli(*argv)
        err = p.stderr.strip().splitlines()
        assert p.returncode == 2, (argv, p.stderr[-2000:])
        assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], p.stderr
        assert "Traceback" not in p.stdout + p.stderr and "loaded" not in p.stdout + p.stderr
    assert not (tmp_path / "r").exists()  # train.py wrote nothing
