"""What ends a request with `finish_reason "error"`, by cause, and the message its caller gets.

A fault inside a step ends only the requests it touched; the engine keeps serving the others
(`ServingEngine.step`). The causes `/metrics` counts (`dspark:request_errors`):

* "nonfinite": the request's logits turned NaN/Inf (a per-row flag of the round's outputs,
  `device.finite_rows`; the other rows are unaffected, `models.layers` stores no non-finite K/V);
* "oom": the device ran out of memory in a call (XLA's RESOURCE_EXHAUSTED, or MemoryError);
* "device": any other exception from a device call (a failed compile, a runtime error);
* "detokenize": the server could not turn the request's tokens into text;
* "internal": an unexpected exception in the engine's host code.
"""

from __future__ import annotations

import jax

from dspark_jax.errors import ConfigError, PolicyError, RequestError

# the host's own checks (a policy's lengths out of range ..): raised to the caller of step(),
# never taken for a device fault
HOST_ERRORS = (ConfigError, PolicyError, RequestError)

CAUSES = ("nonfinite", "oom", "device", "detokenize", "internal")

_MESSAGES = {
    "nonfinite": "the model's logits for this request became non-finite (NaN/Inf)",
    "oom": "the device ran out of memory while running this request",
    "device": "the device failed while running this request",
    "detokenize": "the tokenizer could not decode a generated token",
    "internal": "the engine failed while generating this request",
}


def message(cause: str, detail: str = "") -> str:
    """The one-line error a caller of a request that ended with `cause` gets."""
    base = _MESSAGES[cause]
    return f"{base} ({detail})" if detail else base


def device_cause(exc: BaseException) -> str:
    """The cause, "oom" or "device", of an exception raised by (or reading) a device call."""
    text = f"{type(exc).__name__}: {exc}"
    oom = isinstance(exc, MemoryError) or "RESOURCE_EXHAUSTED" in text
    return "oom" if oom or "out of memory" in text.lower() else "device"


def state_lost(state) -> bool:
    """Whether a device state can no longer be read: a failed call consumed its donated
    buffers, or the buffers hold the failure (an asynchronous error surfaces on reading)."""
    leaves = jax.tree.leaves(state)
    if any(x.is_deleted() for x in leaves):
        return True
    try:
        jax.block_until_ready(leaves)
    except Exception:  # noqa: BLE001 - any error: the buffers are unusable
        return True
    return False
