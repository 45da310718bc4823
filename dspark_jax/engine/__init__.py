"""Engines: `ServingEngine` (slots, continuous batching, scheduled packed verification; the one
the server and the evaluator use) and the older static-batch `SpeculativeDecoder`."""

from dspark_jax.engine.requests import (
    Delta,
    EngineMetrics,
    QueueFull,
    RequestError,
    RequestHandle,
    RequestOutput,
    RequestParams,
    SpecStats,
)
from dspark_jax.engine.scheduling import PolicyError
from dspark_jax.engine.serving import ServingEngine

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
