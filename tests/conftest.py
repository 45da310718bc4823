"""Test session setup: 8 simulated CPU devices (must happen before jax initialises a backend)."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# the simulated devices' collectives wait for each other's threads: on 2 loaded cores that can
# take longer than XLA:CPU's default 40 s, after which it aborts the process
if "collective_call_terminate_timeout" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_collective_call_terminate_timeout_seconds=900"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Property tests draw a fixed example sequence: CI is reproducible and a failure can be replayed.
from hypothesis import settings  # noqa: E402

settings.register_profile("dspark", derandomize=True, database=None)
settings.load_profile("dspark")

import pytest  # noqa: E402


def _mapped_regions() -> int | None:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return None


def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs_near_the_map_limit():
    """Every compiled XLA:CPU program holds memory mappings (~6 for a small one) until its jit
    cache entry goes, and the whole suite in one process compiles thousands: a pytest process
    that reached the kernel's `vm.max_map_count` died inside an XLA compilation (segfault). After
    each test module past half the limit, the compiled programs are dropped (`jax.clear_caches`;
    later tests recompile what they need). The e-l test files in one process: 15368, 17790, 24151,
    31178, 46370 mapped regions after the first five modules, a segfault in test_lossless without
    this, 143 passed with it."""
    yield
    n = _mapped_regions()
    if n is not None and n > _map_limit() // 2:
        import jax

        jax.clear_caches()
