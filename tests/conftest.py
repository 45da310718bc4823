"""Test session setup: 8 simulated CPU devices (must happen before jax initialises a backend)."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Property tests draw a fixed example sequence: CI is reproducible and a failure can be replayed.
from hypothesis import settings  # noqa: E402

settings.register_profile("dspark", derandomize=True, database=None)
settings.load_profile("dspark")
