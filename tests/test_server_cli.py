"""`serve.py serve` / `serve.py bench` arguments and loading, without starting a server:
HF checkpoints load, DSpark defaults to Algorithm 1 and the log says which cost profile it fell
back to; user mistakes end with one line and exit code 2."""

from __future__ import annotations

import argparse
import logging

import pytest

from dspark_jax import drafters
from dspark_jax.drafters.hf import save_hf_drafter
from dspark_jax.engine import server_cli
from dspark_jax.models import init_params
from dspark_jax.models.hf import save_target_hf
from dspark_jax.sched.policies import CausalGreedy, FixedGamma
from dspark_jax.testing import tiny_drafter_config, tiny_target_config
from dspark_jax.train.tokenizer import tiny_tokenizer


def _args(*argv):
    ap = argparse.ArgumentParser()
    server_cli.add_subcommands(ap.add_subparsers(dest="cmd", required=True))
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
    return str(root / "target"), out


def test_checkpoints_load_with_alg1_and_the_fallback_is_logged(ckpts, caplog):
    target, drafter = ckpts
    args = _args("serve", "--target", target, "--drafter", drafter["dspark"], "--num-slots", "2",
                 "--max-len", "128", "--model-name", "m")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="dspark.serve"):
        engine, tok, stop_ids, name = server_cli.build_engine(args)
    assert name == "m" and engine.num_slots == 2 and engine.max_len == 128
    assert isinstance(engine.scheduler.policy, CausalGreedy)
    assert 2 in stop_ids  # <|im_end|>
    text = caplog.text
    assert "no cost profile for this model" in text and "decode_cost" in text
    assert "uncalibrated" in text  # no STS with bare checkpoints: said, not silent


def test_drafter_without_confidences_defaults_to_fixed(ckpts, caplog):
    target, drafter = ckpts
    args = _args("serve", "--target", target, "--drafter", drafter["dflash"], "--num-slots", "1",
                 "--max-len", "64")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="dspark.serve"):
        engine, *_ = server_cli.build_engine(args)
    assert isinstance(engine.scheduler.policy, FixedGamma)
    assert "no confidences" in caplog.text


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["serve", "--run-dir", "/nonexistent/run"], "does not exist"),
        (["serve", "--target", "/nonexistent/t", "--drafter", "dspark"], "checkpoint directory"),
        (["bench", "--url", "http://10.1.2.3:8000"], "only targets this machine"),
        (["bench", "--url", "http://127.0.0.1:9", "--requests", "0"], "--requests"),
    ],
)
def test_user_errors_are_one_line_exit_2(argv, needle, capsys):
    assert server_cli.run(_args(*argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and needle in err and "\n" not in err
