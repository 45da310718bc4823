"""train.py and serve.py as a user runs them: every user mistake ends with a non-zero exit code
and one `error: ...` line, never a traceback (unless --debug)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _cli(script: str, *args: str, cwd=None, timeout=300):
    env = dict(os.environ, TQDM_DISABLE="1")
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        cwd=cwd or ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _assert_user_error(p, *needles: str):
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-2000:]
    assert "Traceback" not in out, out[-3000:]
    for n in needles:
        assert n in out, out[-2000:]


def _prompts(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    return {
        "malformed": _prompts(d / "malformed.jsonl", '{"turns": ["ok"]}\n{"turns": [1, 2\n'),
        "empty": _prompts(d / "empty.jsonl", ""),
        "syntax": _prompts(d / "preset.py", "def config(:\n"),
    }


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--set", "nope=1"], "unknown config key 'nope'"),
        (["--set", "drafters.train.total_steps=abc"], "cannot parse"),
        (["--set", "drafters.steps=3"], "unknown config key 'drafters.steps'"),
        (["--set", "evaluate.temperature=-1"], "evaluate.temperature=-1.0 is out of range"),
        (["--set", "drafters.markov_head_type=gatd"], "markov_head_type='gatd' is unknown"),
        (["--set", "data.eval_prompt_files=/no/such.jsonl"], "does not exist"),
        (["--set", "data.eval_prompt_files={malformed}"], "malformed.jsonl:2"),
        (["--set", "data.eval_prompt_files={empty}"], "empty.jsonl"),
        (["--stages", "evaluat"], "unknown stage"),
        (["--force", "target", "--stages", "evaluate"], "no output for this configuration"),
    ],
)
def test_train_cli_user_errors(tmp_path, bad_files, args, needle):
    args = [a.format(**bad_files) for a in args]
    p = _cli("train.py", "--config", "configs/micro.py", "--run-dir", str(tmp_path / "r"), *args)
    _assert_user_error(p, needle, "error: ")
    assert p.returncode == 2
    assert not (tmp_path / "r" / "config.json").exists()  # nothing written before the error


def test_configuration_mistakes_are_reported_before_jax_loads(tmp_path):
    """The preset, the --set overrides and the stage names are checked before jax is imported
    (a mistake costs ~0.4 s, not the ~2.5 s of loading jax)."""
    code = (  # `python -c` in cwd=ROOT imports the repository's train.py
        "import sys, train; "
        "rc = train.main(sys.argv[1:]); print('jax loaded:', 'jax' in sys.modules); sys.exit(rc)"
    )
    base = ["--config", "configs/micro.py", "--run-dir", str(tmp_path / "r")]
    for extra, needle in (
        (["--set", "nope=1"], "unknown config key"),
        (["--set", "evaluate.temperature=-1"], "out of range"),
        (["--stages", "evaluat"], "unknown stage"),
    ):
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)
        p = subprocess.run([sys.executable, "-c", code, *base, *extra], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
        _assert_user_error(p, needle)
        assert "jax loaded: False" in p.stdout, p.stdout + p.stderr


def test_train_cli_bad_preset_and_debug(tmp_path, bad_files):
    _assert_user_error(_cli("train.py", "--config", "nope.py"), "config file nope.py not found")
    _assert_user_error(_cli("train.py", "--config", bad_files["syntax"]), "syntax error")
    p = _cli("train.py", "--config", "configs/micro.py", "--set", "nope=1", "--debug")
    assert p.returncode == 2 and "Traceback" in p.stderr  # --debug shows it


def test_serve_cli_user_errors(tmp_path):
    run = tmp_path / "run"
    _assert_user_error(
        _cli("serve.py", "generate", "--run-dir", str(run), "--prompt", "hi"), "does not exist"
    )
    run.mkdir()
    _assert_user_error(
        _cli("serve.py", "generate", "--run-dir", str(run), "--prompt", "hi"),
        "not a run directory",
    )
    (run / "config.json").write_text("{not json")
    _assert_user_error(
        _cli("serve.py", "generate", "--run-dir", str(run), "--prompt", "hi"), "not valid JSON"
    )
    (run / "config.json").write_text(json.dumps({"drafters": {"stepz": 3}}))
    _assert_user_error(_cli("serve.py", "generate", "--run-dir", str(run), "--prompt", "hi"))
    (run / "config.json").write_text(json.dumps({"name": "x"}))
    # a run directory whose stages never ran: the missing tokenizer is named
    _assert_user_error(
        _cli("serve.py", "generate", "--run-dir", str(run), "--prompt", "hi"), "no tokenizer"
    )
    for n in ("0", "-3", "many"):
        p = _cli("serve.py", "generate", "--run-dir", str(run), "--prompt", "hi",
                 "--max-new-tokens", n)  # fmt: skip
        _assert_user_error(p, "--max-new-tokens")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A small run: target + one DSpark drafter (no calibration / evaluation)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    sets = [
        "target.train.total_steps=4", "regenerate.max_prompts=8", "regenerate.max_new_tokens=8",
        "drafters.kinds=dspark", "drafters.train.total_steps=2", "drafters.train.eval_interval=5",
        "drafters.train.checkpoint_interval=5",
        "calibrate.max_prompts=2",
    ]  # fmt: skip
    args = ["--config", "configs/micro.py", "--run-dir", str(run)]
    for s in sets:
        args += ["--set", s]
    p = _cli("train.py", *args, "--stages", "corpus,tokenizer,target,regenerate,drafters",
             timeout=900)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return run


@pytest.mark.slow
def test_serve_generate_on_moved_run_and_its_errors(trained_run, tmp_path):
    # drafters.train.total_steps < eval_interval: the stage still evaluated and kept a best checkpoint
    assert (trained_run / "drafters" / "dspark" / "best").is_dir()
    moved = tmp_path / "copied-run"
    import shutil

    shutil.copytree(trained_run, moved)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    p = _cli("serve.py", "generate", "--run-dir", "../copied-run", "--prompt", "What is 2 plus 3?",
             "--max-new-tokens", "8", "--temperature", "0", cwd=elsewhere)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "tokens" in p.stdout
    base = ["generate", "--run-dir", str(moved), "--prompt", "hi", "--max-new-tokens", "4"]
    cases = [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--top-k", "-2"], "top_k"),
        (["--drafter", "eagle3"], "no trained eagle3 drafter"),
        (["--policy", "dspark"], "cost profile"),
    ]
    for extra, needle in cases:
        _assert_user_error(_cli("serve.py", *base, *extra), needle)
    long_prompt = "word " * 3000
    _assert_user_error(
        _cli("serve.py", "generate", "--run-dir", str(moved), "--prompt", long_prompt),
        "does not fit the target's context",
    )
