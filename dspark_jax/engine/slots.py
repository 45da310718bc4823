"""Host bookkeeping of the serving engine: requests, the slot table, request validation."""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import NamedTuple

import numpy as np

from dspark_jax.engine.requests import RequestHandle, RequestParams, SpecStats
from dspark_jax.errors import RequestError


class Resume(NamedTuple):
    """Where a request preempted by recompute continues: `prompt` (its prompt + tokens but the
    last) is prefilled again, `anchor` (its last token) is taken instead of a new draw, and its
    proposals go on from round `rounds` (so their noise keys, and its tokens, do not change)."""

    prompt: list[int]
    anchor: int
    rounds: int


@dataclasses.dataclass(eq=False)
class Request:
    id: str
    prompt: list[int]
    params: RequestParams
    handle: RequestHandle
    seed: int = 0
    slot: int | None = None
    pos: int = 0  # position of the anchor (last committed token)
    tokens: list[int] = dataclasses.field(default_factory=list)
    stats: SpecStats = dataclasses.field(default_factory=SpecStats)
    num_accepted: list[int] = dataclasses.field(default_factory=list)
    proposed: list[int] = dataclasses.field(default_factory=list)
    eos: list[bool] = dataclasses.field(default_factory=list)
    conf_logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    cancel_requested: bool = False
    fail_cause: str | None = None  # with cancel_requested: end with "error" (`engine.faults`)
    done: bool = False
    fill: object = None  # `runner.Fill` while its prompt is prefilled over several steps
    # a preempted request's resume point (paged layout, `Resume`): what to prefill
    # again, the anchor it had and its round counter; None once its prefill has resumed
    resume: Resume | None = None

    def __post_init__(self):
        self.stop_set = frozenset(int(s) for s in self.params.stop_ids)
        if self.params.seed is not None:
            self.seed = int(self.params.seed)


class SlotTable:
    """Which request holds which slot, the waiting queue (FIFO) and each slot's pending
    confidence logits [γ] (host copy, refreshed by every round's single device read)."""

    def __init__(self, num_slots: int, gamma: int):
        self.owner: list[Request | None] = [None] * num_slots
        self.queue: deque[Request] = deque()
        self.conf = np.zeros((num_slots, gamma), np.float32)
        self.by_id: dict[str, Request] = {}

    def enqueue(self, req: Request) -> None:
        self.queue.append(req)
        self.by_id[req.id] = req

    def find(self, request_id: str) -> Request | None:
        return self.by_id.get(request_id)

    def running(self) -> list[Request]:
        """Every request holding a slot, those still prefilling included."""
        return [r for r in self.owner if r is not None]

    def decoding(self) -> list[Request]:
        """The requests holding a slot whose prefill is done (they join the rounds)."""
        return [r for r in self.owner if r is not None and r.fill is None]

    def prefilling(self) -> list[Request]:
        return [r for r in self.owner if r is not None and r.fill is not None]

    def admit(self) -> list[Request]:
        """Move waiting requests into free slots (FIFO, lowest slot first)."""
        out = []
        for s, r in enumerate(self.owner):
            if r is None and self.queue:
                req = self.queue.popleft()
                req.slot, req.pos = s, len(req.prompt)
                self.owner[s] = req
                out.append(req)
        return out

    def release(self, req: Request) -> None:
        if req.slot is not None and self.owner[req.slot] is req:
            self.owner[req.slot] = None
        self.by_id.pop(req.id, None)


def validate_request(prompt_ids, params, config, vocab: int, context: int = 0) -> list[int]:
    """Check a request at the boundary against the engine's `EngineConfig` and the target's
    vocabulary size and context (`context`: its max_position_embeddings, 0 = unknown); returns
    the prompt as a list of ints."""
    if not isinstance(params, RequestParams):
        raise RequestError(f"params must be a RequestParams, got {type(params).__name__}")
    try:
        arr = np.asarray(list(prompt_ids))
    except TypeError as e:
        raise RequestError(f"prompt must be a sequence of token ids ({e})") from None
    if arr.size == 0:
        raise RequestError("empty prompt: give at least one token id")
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise RequestError(
            f"prompt must be a flat list of integer token ids, got dtype {arr.dtype}"
        )
    if arr.min() < 0 or arr.max() >= vocab:
        raise RequestError(
            f"prompt token ids must lie in [0, {vocab}); got range [{arr.min()}, {arr.max()}]"
        )
    mx = params.max_new_tokens
    if not isinstance(mx, (int, np.integer)) or isinstance(mx, bool) or mx <= 0:
        raise RequestError(f"max_new_tokens must be an integer >= 1, got {mx!r}")
    need = arr.size + int(mx) + config.gamma + 1
    if context and arr.size + int(mx) > context:
        raise RequestError(
            f"prompt ({arr.size} tokens) + max_new_tokens ({mx}) exceeds the target's context "
            f"of {context} tokens (max_position_embeddings); shorten the prompt or lower "
            f"max_new_tokens to <= {max(context - arr.size, 0)}"
        )
    if need > config.max_len:
        limit = config.max_len - config.gamma - 1
        wider = (
            f", or build the engine with max_len up to {context + config.gamma + 1} (the "
            f"target's context {context} + γ + 1)"
            if context and limit < context
            else ""
        )
        raise RequestError(
            f"prompt ({arr.size} tokens) + max_new_tokens ({mx}) exceeds the engine's limit of "
            f"{limit} tokens per request (max_len={config.max_len} less γ + 1 = "
            f"{config.gamma + 1} lookahead positions); shorten the prompt or max_new_tokens" + wider
        )
    if getattr(config, "kv_layout", "slots") == "paged":
        pages = -(-need // config.page_size)
        if pages > config.num_pages:
            raise RequestError(
                f"request needs {pages} pages of {config.page_size} positions ({need} positions) "
                f"but the page pool holds num_pages={config.num_pages}; shorten the prompt or "
                "max_new_tokens"
            )
    t, k, p, m = params.temperature, params.top_k, params.top_p, params.min_p
    if not (np.isfinite(t) and t >= 0):
        raise RequestError(f"temperature must be a finite number >= 0, got {t!r}")
    if 0 < t < 1e-4:
        raise RequestError(f"temperature {t} is too small; use 0 for greedy or >= 1e-4")
    if not isinstance(k, (int, np.integer)) or k < 0:
        raise RequestError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
    if not (0 < p <= 1):
        raise RequestError(f"top_p must be in (0, 1], got {p!r}")
    if not (0 <= m <= 1):
        raise RequestError(f"min_p must be in [0, 1], got {m!r}")
    if params.seed is not None and not (
        isinstance(params.seed, (int, np.integer)) and 0 <= params.seed < 2**32
    ):
        raise RequestError(f"seed must be an integer in [0, 2**32), got {params.seed!r}")
    for s in params.stop_ids:
        if not isinstance(s, (int, np.integer)) or not 0 <= s < vocab:
            raise RequestError(f"stop_ids must be token ids in [0, {vocab}), got {s!r}")
    try:
        config.mode_for([params])
    except RuntimeError:
        raise RequestError(
            f"this engine was built with sampling modes {config.modes}, which cannot serve "
            "these sampling knobs; use temperature=0 (greedy) or build it with more modes"
        ) from None
    return [int(x) for x in arr]
