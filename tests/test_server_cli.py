"""`serve.py serve` / `bench` / `export` arguments and loading, without starting a server:
HF checkpoints load, DSpark defaults to Algorithm 1 and the log says which cost profile it fell
back to; an exported drafter carries its STS calibration and its target; user mistakes end with
one line and exit code 2."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

import jax
import pytest

from dspark_jax import drafters
from dspark_jax.cli import serve_engine, serve_http
from dspark_jax.config.pipeline import PipelineConfig
from dspark_jax.drafters.compat import TargetId, vocab_hash
from dspark_jax.drafters.hf import load_hf_drafter_extras, save_hf_drafter
from dspark_jax.models import init_params
from dspark_jax.models.hf import save_target_hf
from dspark_jax.run.rundir import RunDir
from dspark_jax.sched.policies import CausalGreedy, FixedGamma
from dspark_jax.sched.sts import STS
from dspark_jax.testing import tiny_drafter_config, tiny_target_config, tiny_tokenizer
from dspark_jax.train.checkpoint import Checkpointer


def _args(*argv):
    ap = argparse.ArgumentParser()
    serve_http.add_subcommands(ap.add_subparsers(dest="cmd", required=True))
    return ap.parse_args(list(argv))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_ckpt")
    tok = tiny_tokenizer(tmp_path_factory.getbasetemp() / "tok_cache")
    tcfg = tiny_target_config(vocab_size=512)
    tp = init_params(tcfg, 0)
    save_target_hf(tcfg, tp, root / "target", tokenizer=tok)
    if not (root / "target" / "tokenizer.json").exists():
        tok.save_pretrained(root / "target")
    out = {}
    for kind in ("dspark", "dflash"):
        dcfg = tiny_drafter_config(kind, tcfg, mask_token_id=3)
        save_hf_drafter(dcfg, drafters.init_params(dcfg, target_params=tp), root / kind)
        out[kind] = str(root / kind)
    dcfg = tiny_drafter_config("dspark", tcfg, mask_token_id=3)
    dp = drafters.init_params(dcfg, target_params=tp)
    tid = TargetId.of(tcfg, name="target", vocab_hash=vocab_hash(tok))
    save_hf_drafter(dcfg, dp, root / "cal", sts=STS((0.5, 2.0, 1.5, 3.0)), trained_for=tid)
    out["cal"] = str(root / "cal")
    other = dataclasses.replace(tid, vocab_hash="0123456789abcdef")  # another tokenizer's
    save_hf_drafter(dcfg, dp, root / "other_vocab", trained_for=other)
    out["other_vocab"] = str(root / "other_vocab")
    return str(root / "target"), out


def test_checkpoints_load_with_alg1_and_the_fallback_is_logged(ckpts, caplog):
    target, drafter = ckpts
    args = _args("serve", "--target", target, "--drafter", drafter["dspark"], "--num-slots", "2",
                 "--max-len", "128", "--model-name", "m")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="dspark.serve"):
        engine, tok, stop_ids, name = serve_engine.build_engine(args)
    assert name == "m" and engine.num_slots == 2 and engine.token_limit == 128
    assert isinstance(engine.scheduler.policy, CausalGreedy)
    assert 2 in stop_ids  # <|im_end|>
    text = caplog.text
    assert "no cost profile for this model" in text and "decode_cost" in text
    assert "uncalibrated" in text  # no STS with bare checkpoints: said, not silent
    # no layout flag: pages, the pool's plan logged (rows x max_len positions on a CPU)
    assert engine.config.kv_layout == "paged" and engine.page_pool is not None
    pages = 2 * -(-(128 + engine.gamma + 1) // 16)
    assert f"KV pool: {pages} pages x 16 = {pages * 16} tokens" in text
    assert "concurrent requests (of 2 rows) by request tokens: 2 at 128" in text


def test_drafter_without_confidences_defaults_to_fixed(ckpts, caplog):
    target, drafter = ckpts
    args = _args("serve", "--target", target, "--drafter", drafter["dflash"], "--num-slots", "1",
                 "--max-len", "64")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="dspark.serve"):
        engine, *_ = serve_engine.build_engine(args)
    assert isinstance(engine.scheduler.policy, FixedGamma)
    assert "no confidences" in caplog.text


def test_drafter_checkpoint_with_temperatures_serves_them(ckpts, caplog):
    target, drafter = ckpts
    args = _args("serve", "--target", target, "--drafter", drafter["cal"], "--policy", "alg1",
                 "--num-slots", "1", "--max-len", "64")  # fmt: skip
    assert serve_engine._load(args)[6] == STS((0.5, 2.0, 1.5, 3.0))
    with caplog.at_level(logging.INFO, logger="dspark.serve"):
        engine, *_ = serve_engine.build_engine(args)
    assert isinstance(engine.scheduler.policy, CausalGreedy)
    assert "confidence_temperatures" in caplog.text and "uncalibrated" not in caplog.text


def test_drafter_for_another_tokenizer_is_one_line(ckpts, capsys):
    target, drafter = ckpts
    args = _args("serve", "--target", target, "--drafter", drafter["other_vocab"])
    assert serve_http.run(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "vocabulary hash" in err and "\n" not in err


def test_max_len_defaults_to_the_context_and_the_drafter_window_narrows(ckpts, tmp_path, capsys):
    target, drafter = ckpts
    args = _args("serve", "--target", target, "--drafter", drafter["dflash"], "--num-slots", "1",
                 "--drafter-context-window", "16")  # fmt: skip
    engine, *_ = serve_engine.build_engine(args)
    assert engine.token_limit == engine.tcfg.max_position_embeddings == 512
    assert engine.dcfg.context_window == 16
    # a drafter trained with a window of 8 is refused a wider one, in one line
    dcfg = tiny_drafter_config("dflash", tiny_target_config(vocab_size=512), mask_token_id=3,
                               context_window=8)  # fmt: skip
    save_hf_drafter(dcfg, drafters.init_params(dcfg), tmp_path / "w8")
    args = _args("serve", "--target", target, "--drafter", str(tmp_path / "w8"),
                 "--num-slots", "1", "--drafter-context-window", "16")  # fmt: skip
    assert serve_http.run(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "wider than the 8 positions" in err and "\n" not in err


def _fake_run(root, target, kinds=("dspark",)):
    """A run directory as train.py leaves it, minus the training: the HF target and tokenizer
    by path, a best checkpoint of freshly initialized drafter params, a calibration."""
    cfg = PipelineConfig()
    cfg = dataclasses.replace(
        cfg,
        tokenizer=dataclasses.replace(cfg.tokenizer, path=target),
        target=dataclasses.replace(cfg.target, path=target),
        drafters=dataclasses.replace(cfg.drafters, kinds=kinds, block_size=4, markov_rank=16),
    )
    root.mkdir()
    (root / "config.json").write_text(json.dumps(cfg.to_json()))
    run = RunDir(root)
    tcfg, tp = run.target()
    dcfg = run.drafter_config("dspark", tcfg)
    params = drafters.init_params(dcfg, target_params=tp)
    tid = TargetId.of(tcfg, name=run.target_name(), vocab_hash=run.vocab_hash())
    ck = Checkpointer(run.drafter_dir("dspark") / "best", max_to_keep=1, async_save=False)
    ck.save(1, {"trainable": params.trainable}, {"config": {"trained_for": tid.to_json()}})
    ck.close()
    STS((0.75, 1.5, 2.5, 4.0)).save(run.stage_dir("calibrate") / "sts.json")
    return params, tid


def test_export_writes_a_drafter_that_serves_with_its_calibration(ckpts, tmp_path, capsys):
    target, _ = ckpts
    params, tid = _fake_run(tmp_path / "run", target)
    out = tmp_path / "export"
    assert serve_http.run(_args("export", "--run-dir", str(tmp_path / "run"),
                                "--out", str(out))) == 0  # fmt: skip
    assert str(out) in capsys.readouterr().out
    assert load_hf_drafter_extras(out) == (STS((0.75, 1.5, 2.5, 4.0)), tid)
    args = _args("serve", "--target", target, "--drafter", str(out))
    *_, dparams, sts, _, _, _ = serve_engine._load(args)
    assert sts == STS((0.75, 1.5, 2.5, 4.0))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(dparams)):
        assert (a == b).all()
    # a non-empty --out is refused, and so are an unknown run / an untrained drafter
    for argv, needle in [
        (["--run-dir", str(tmp_path / "run"), "--out", str(out)], "not an empty directory"),
        (["--run-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "x")], "does not exist"),
        (["--run-dir", str(tmp_path / "run"), "--drafter", "eagle3", "--out",
          str(tmp_path / "y")], "no trained eagle3 drafter"),
    ]:  # fmt: skip
        assert serve_http.run(_args("export", *argv)) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and needle in err and "\n" not in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_api_key_flag_else_environment(monkeypatch):
    from dspark_jax import runtime

    monkeypatch.setattr(runtime, "settings", lambda: runtime.read({"DSPARK_API_KEY": "env-k"}))
    assert serve_http.api_key(_args("serve", "--run-dir", "r")) == "env-k"
    assert serve_http.api_key(_args("serve", "--run-dir", "r", "--api-key", "flag-k")) == "flag-k"
    assert serve_http.api_key(_args("serve", "--run-dir", "r", "--api-key", "")) == ""
    assert _args("serve", "--run-dir", "r").host == "127.0.0.1"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["serve", "--run-dir", "/nonexistent/run"], "does not exist"),
        (["serve", "--target", "/nonexistent/t", "--drafter", "dspark"], "checkpoint directory"),
        (["bench", "--url", "http://10.1.2.3:8000"], "only targets this machine"),
        (["bench", "--url", "http://127.0.0.1:9", "--requests", "0"], "--requests"),
        (["serve", "--run-dir", "/nonexistent/run", "--max-body-bytes", "0"], "--max-body-bytes"),
        (["serve", "--run-dir", "/nonexistent/run", "--max-len", "-1"], "--max-len"),
        (
            ["serve", "--run-dir", "/nonexistent/run", "--request-timeout", "-1"],
            "--request-timeout",
        ),
    ],
)
def test_user_errors_are_one_line_exit_2(argv, needle, capsys):
    assert serve_http.run(_args(*argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and needle in err and "\n" not in err
