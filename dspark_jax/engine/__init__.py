"""The engine: `ServingEngine` (slots, continuous batching, scheduled packed verification), the
one the server, `serve.py generate` and the evaluator use."""

from dspark_jax.engine.requests import (
    Delta,
    EngineMetrics,
    QueueFull,
    RequestHandle,
    RequestOutput,
    RequestParams,
    SpecStats,
)
from dspark_jax.engine.serving import ServingEngine
from dspark_jax.errors import PolicyError, RequestError

__all__ = [
    "Delta",
    "EngineMetrics",
    "PolicyError",
    "QueueFull",
    "RequestError",
    "RequestHandle",
    "RequestOutput",
    "RequestParams",
    "ServingEngine",
    "SpecStats",
]
