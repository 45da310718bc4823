"""The engine: `ServingEngine` (slots, continuous batching, scheduled packed verification), the
one the server, `serve.py generate` and the evaluator use. It wires an `EngineConfig`
(engine.config), the device half `EnginePrograms` (engine.programs: state and jitted programs,
which timers call directly), the slot table, the round runner and the committer."""

from dspark_jax.engine.config import EngineConfig
from dspark_jax.engine.engine import ServingEngine
from dspark_jax.engine.programs import EnginePrograms
from dspark_jax.engine.requests import (
    Delta,
    EngineMetrics,
    QueueFull,
    RequestHandle,
    RequestOutput,
    RequestParams,
    SpecStats,
)
from dspark_jax.errors import PolicyError, RequestError

__all__ = [
    "Delta",
    "EngineConfig",
    "EngineMetrics",
    "EnginePrograms",
    "PolicyError",
    "QueueFull",
    "RequestError",
    "RequestHandle",
    "RequestOutput",
    "RequestParams",
    "ServingEngine",
    "SpecStats",
]
