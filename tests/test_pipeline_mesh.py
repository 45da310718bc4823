"""The micro preset and the serving CLIs on 8 simulated devices, as a user runs them on one host
with several devices: the drafters, calibrate and evaluate stages on an fsdp x tensor mesh and on
a data-parallel mesh give the one-device run's τ tables, and `serve.py generate` on
`--mesh 1,2,4` gives the one-device tokens (greedy speculative decoding = greedy decoding of the
target)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import compile_like_this_process

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("corpus", "tokenizer", "target", "regenerate", "drafters", "calibrate", "evaluate")


def _env(devices: int) -> dict:
    env = dict(os.environ, TQDM_DISABLE="1", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    if devices > 1:
        # 8 simulated devices share 2 cores: a collective's threads can wait longer than XLA's
        # default 40 s abort while another process compiles (seen on a loaded machine). A mesh
        # run compiles at the pytest processes' level (tests/conftest.py: 0, compiling 30-45%
        # shorter): none of its programs is the one-device run's (which it could otherwise read
        # from the cache), and its numbers are compared with that run's at the tolerance a
        # mesh's reduction order needs anyway.
        env["XLA_FLAGS"] = (
            f"--xla_force_host_platform_device_count={devices} "
            "--xla_cpu_collective_call_terminate_timeout_seconds=900"
        )
        env = compile_like_this_process(env)
    return env


def _script(name: str, args, devices: int, timeout=900) -> str:
    p = subprocess.run(
        [sys.executable, str(ROOT / name), *args],
        cwd=ROOT, env=_env(devices), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    return p.stdout


@pytest.fixture(scope="module")
def one_device_run(micro_run, tmp_path_factory) -> Path:
    """A copy of the session's micro run on one device (tests/conftest.py's `micro_run`)."""
    run = tmp_path_factory.mktemp("one") / "micro"
    shutil.copytree(micro_run[0], run)
    return run


def _report(run: Path) -> dict:
    return json.loads((run / "evaluate" / "report.json").read_text())


# a data-parallel mesh of 8 needs batches of whole sequences per device: the drafters' batches
# of 8 (the one-device reference reruns the drafters, calibrate and evaluate with the same). The
# speed section is left out there: with no inference mesh it times one device, as the reference.
# DSpark alone: the fsdp x tensor variant trains all three drafters on a mesh, and the suite's
# time is what decides (each drafter is trained twice here, once per device count).
BATCH8 = ("drafters.train.global_batch_size=8", "drafters.train.micro_batch_size=8",
          "drafters.train.eval_batch_size=8", "evaluate.speed_prompts=0",
          "drafters.kinds=dspark")  # fmt: skip


def _sets(settings) -> list[str]:
    return [a for s in settings for a in ("--set", s)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh, settings, inference_mesh",
    [((1, 2, 4), (), {"data": 1, "fsdp": 2, "tensor": 4}), ((8, 1, 1), BATCH8, None)],
    ids=["fsdp2_tensor4", "data8"],
)
def test_micro_preset_on_8_devices_gives_the_one_device_tau(
    one_device_run, tmp_path, mesh, settings, inference_mesh
):
    ref_run = one_device_run
    if settings:
        ref_run = tmp_path / "one"
        shutil.copytree(one_device_run, ref_run)
        args = ["--config", "configs/micro.py", "--run-dir", str(ref_run), *_sets(settings)]
        assert "drafters: ran" in _script("train.py", args, 1)
    run = tmp_path / "micro"
    data, fsdp, tensor = mesh
    mesh_sets = (f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}")
    args = ["--config", "configs/micro.py", "--run-dir", str(run), *_sets(settings + mesh_sets)]
    # the drafters onwards on the mesh, on the reference's target and regenerated data (the
    # target stage and regeneration on a mesh: tests/test_multiprocess_stages.py and
    # tests/test_launch_regenerate.py, over two processes)
    shutil.copytree(ref_run, run)
    ran = STAGES[4:]
    args += ["--force", ",".join(ran)]
    out = _script("train.py", args, 8)
    assert ", ".join(f"{s}: ran" for s in ran) in out  # none of them cached
    rep, ref = _report(run), _report(ref_run)
    for kind, row in ref["tau"].items():
        for name, tau in row["datasets"].items():
            assert rep["tau"][kind]["datasets"][name] == pytest.approx(tau, abs=1e-9), (kind, name)
    for t, tab in ref["tau_by_temperature"].items():
        for kind, row in tab["tau"].items():
            assert rep["tau_by_temperature"][t]["tau"][kind]["macro"] == pytest.approx(
                row["macro"], abs=1e-9
            )
    assert rep["mesh"] == inference_mesh
    if not settings:  # the batch-1 timing runs on the run's inference mesh and says so
        assert rep["speed_breakdown"]["mesh"] == inference_mesh
        assert rep["speed_batch1"]["mesh"] == inference_mesh
        assert rep["speed_batch1"]["speedup"] > 0


@pytest.mark.slow
def test_serve_generate_on_a_1_2_4_mesh(one_device_run):
    """(`serve.py serve` on a mesh: tests/test_multiprocess_stages.py, over two processes.)"""
    args = ["generate", "--run-dir", str(one_device_run), "--prompt", "What is 12 plus 30?",
            "--max-new-tokens", "16", "--temperature", "0"]  # fmt: skip
    plain = _script("serve.py", args, 8)
    meshed = _script("serve.py", [*args, "--mesh", "1,2,4"], 8)
    strip = lambda s: [ln for ln in s.splitlines() if "tokens/s" not in ln]  # wall time differs
    assert strip(meshed) == strip(plain) and "τ=" in meshed
