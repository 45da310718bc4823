"""The XLA:CPU setting: added only when safe, never over the user's own, and accepted by XLA."""

import os
import subprocess
import sys

from dspark_jax import xla_cpu


def test_added_once_and_never_over_the_users_setting(monkeypatch):
    monkeypatch.setattr(xla_cpu, "_jaxlib_release", lambda: xla_cpu.CHECKED_JAXLIB[0])
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    added = xla_cpu.apply_cpu_defaults(env)
    assert added == f"{xla_cpu.OPTION}={xla_cpu.VALUE}"
    assert env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=2 {added}"
    assert xla_cpu.apply_cpu_defaults(env) is None  # a second call adds nothing
    assert env["XLA_FLAGS"].count(xla_cpu.OPTION) == 1

    users = {"XLA_FLAGS": f"{xla_cpu.OPTION}=dot"}
    assert xla_cpu.apply_cpu_defaults(users) is None
    assert users["XLA_FLAGS"] == f"{xla_cpu.OPTION}=dot"

    off = {xla_cpu.ENV: "off"}
    assert xla_cpu.apply_cpu_defaults(off) is None and "XLA_FLAGS" not in off


def test_not_added_for_a_jaxlib_it_was_not_checked_on(monkeypatch):
    # XLA aborts the process on an option it does not know: an unchecked release gets nothing
    for release in [(0, 6), (1, 0), None]:
        monkeypatch.setattr(xla_cpu, "_jaxlib_release", lambda r=release: r)
        env = {}
        assert xla_cpu.apply_cpu_defaults(env) is None and env == {}


def test_the_installed_jaxlib_accepts_the_flags_it_is_given():
    """A fresh process with exactly the flags `apply_cpu_defaults` makes starts a CPU backend
    and runs a program (XLA would abort at start on an unknown option)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", xla_cpu.ENV)}
    code = (
        "import os; from dspark_jax.xla_cpu import apply_cpu_defaults; "
        "print(apply_cpu_defaults()); import jax, jax.numpy as jnp; "
        "x = jnp.arange(6.0).reshape(2, 3); print(float(jax.nn.logsumexp(x @ x.T)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(env, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    added, value = out.stdout.split()
    if xla_cpu._jaxlib_release() in xla_cpu.CHECKED_JAXLIB:
        assert added == f"{xla_cpu.OPTION}={xla_cpu.VALUE}"
    assert abs(float(value) - 50.0) < 1e-3
