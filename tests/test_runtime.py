"""`dspark_jax.runtime`: the one reader of the environment, and the line train.py / serve.py
print at start; the cost profiles shipped as package data."""

from __future__ import annotations

import json
from pathlib import Path

from dspark_jax import runtime
from dspark_jax.cli.serve_engine import SHIPPED_PROFILES, read_shipped
from dspark_jax.sched.cost import CostProfile


def test_every_setting_comes_from_the_given_environment(tmp_path):
    s = runtime.read({
        "DSPARK_HUGEPAGES": "off", "DSPARK_COMPILATION_CACHE": str(tmp_path),
        "DSPARK_XLA_CPU_TRAINING": "0", "DSPARK_XLA_CPU_THREEFRY": "false",
        "XLA_FLAGS": "--xla_foo", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
        "JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1",
    })  # fmt: skip
    assert s == runtime.Settings(
        hugepages=False, glibc_tunables="glibc.malloc.hugetlb=1", compilation_cache=tmp_path,
        xla_cpu_training=False, xla_cpu_threefry=False, xla_flags="--xla_foo",
        coordinator="h:1", num_processes="2", process_id="1",
    )  # fmt: skip
    d = runtime.read({})
    assert d.hugepages and d.xla_cpu_training and d.xla_cpu_threefry and not d.coordinator


def test_the_start_line_says_what_the_process_runs_with(tmp_path):
    s = runtime.read({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "XLA_FLAGS": " --x "})
    line = runtime.describe(tmp_path, True, s)
    assert line.startswith("runtime: huge pages on, ") and "\n" not in line
    assert f"compilation cache {tmp_path}" in line and "threefry unrolled" in line
    assert line.endswith("XLA_FLAGS=--x")
    off = runtime.describe(None, False, runtime.read({}))
    assert "huge pages off" in off and "compilation cache off" in off and "XLA_FLAGS" not in off


def test_shipped_cost_profiles_are_package_data():
    """Read through importlib.resources (a wheel has no benchmarks/ directory); the same
    profiles as benchmarks/results, which they copy."""
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    for name in SHIPPED_PROFILES:
        text = read_shipped(name)
        assert CostProfile.from_dict(json.loads(text)).tokens
        if (results / name).is_file():
            assert json.loads(text) == json.loads((results / name).read_text())


def test_simulated_devices_get_patient_collectives():
    from dspark_jax import runtime

    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert runtime.patient_cpu_collectives(env)
    assert f"{runtime.COLLECTIVE_TIMEOUT_FLAG}=900" in env["XLA_FLAGS"]
    assert not runtime.patient_cpu_collectives(env)  # given once; the user's own value kept
    plain = {"XLA_FLAGS": ""}
    assert not runtime.patient_cpu_collectives(plain) and plain["XLA_FLAGS"] == ""
