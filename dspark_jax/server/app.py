"""OpenAI-compatible HTTP server over one `ServingEngine` (FastAPI + uvicorn).

    app = create_app(engine, tokenizer, "dspark-tiny", stop_ids=run.stop_ids())
    run.run_server(app, "127.0.0.1", 8000)   # blocks; SIGINT/SIGTERM drain and exit

This module parses, validates and admits requests; `server.request` runs each admitted one and
writes its response. Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (the tokenizer's chat template),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus, see `server.metrics`).

Contract:
* with an `api_key`, every route but `/health` needs `Authorization: Bearer <key>` (else 401);
* every request is validated before it reaches the engine (strict JSON body, sampling knobs,
  prompt non-empty and fitting `max_len` with its `max_tokens`); a user mistake is a 4xx
  OpenAI-style error body, a body over `max_body_bytes` a 413 (read no further, chunked or not),
  a full engine queue a 429 and a draining server a 503 (both with `Retry-After`);
* a request not finished `request_timeout_s` after it arrived is cancelled in the engine and
  answered 504 (`x-should-retry: false`), or, once streaming, ends with a 504 error event;
* stop token ids go to the engine (the tokenizer's EOS ids unless `ignore_eos`, plus the
  request's ids); stop strings are matched here on the incrementally detokenized text, and the
  request is cancelled in the engine as soon as one is found;
* a client that disconnects (streaming or not) has its request cancelled, which frees its slot
  at the engine's next round;
* a request that fails inside the engine (non-finite logits, a device error, out of memory) or
  whose tokens the tokenizer cannot decode ends with a 500 OpenAI error body naming the cause,
  or, once streaming, a final error event; the other requests are unaffected and
  `dspark:request_errors` counts it by cause (`engine.faults`);
* every response carries `usage` and, next to it, `spec_stats` (rounds, drafted, verified,
  accepted tokens and the mean accepted length of this request); streams end with
  `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import time
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark_jax.engine.requests import QueueFull, RequestParams
from dspark_jax.errors import RequestError
from dspark_jax.server.metrics import ServerMetrics
from dspark_jax.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_response,
    parse_body,
)
from dspark_jax.server.request import Run, sse_stream, unary

MAX_BODY_BYTES = 4 << 20


class _State:
    """What the handlers share: the engine, the tokenizer and the server's limits."""

    def __init__(self, engine, tokenizer, model_name, stop_ids, max_len, vocab_size, drain_s,
                 max_body_bytes, request_timeout_s):  # fmt: skip
        self.engine = engine
        self.tok = tokenizer
        self.model = model_name
        self.eos_ids = tuple(int(i) for i in stop_ids)
        self.max_len = int(max_len)
        self.vocab = int(vocab_size)
        self.drain_s = float(drain_s)
        self.max_body = int(max_body_bytes)
        self.timeout_s = float(request_timeout_s) if request_timeout_s else None
        self.draining = False
        self.created = int(time.time())
        self.metrics = ServerMetrics(lambda: _as_dict(engine.metrics()), model_name)


def _as_dict(snapshot) -> dict[str, Any]:
    if dataclasses.is_dataclass(snapshot):
        return dataclasses.asdict(snapshot)
    return dict(snapshot)


def create_app(
    engine,
    tokenizer,
    model_name: str,
    *,
    stop_ids: Sequence[int] = (),
    max_len: int | None = None,
    vocab_size: int | None = None,
    drain_timeout_s: float = 30.0,
    manage_engine: bool = True,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    request_timeout_s: float | None = None,
) -> FastAPI:
    """The FastAPI app. With `manage_engine`, the app's lifespan starts the engine (after
    `warmup()`, which the caller may already have run) and drains it on shutdown. `api_key`
    (None or "": no authentication), `max_body_bytes` and `request_timeout_s` (None or 0: no
    limit) are the access limits of the module docstring."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if request_timeout_s is not None and request_timeout_s < 0:
        raise ValueError(f"request_timeout_s must be >= 0, got {request_timeout_s}")
    max_len = max_len or engine.token_limit  # prompt + completion tokens of one request
    vocab_size = vocab_size or engine.tcfg.vocab_size
    st = _State(engine, tokenizer, model_name, stop_ids, max_len, vocab_size, drain_timeout_s,
                max_body_bytes, request_timeout_s)  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            st.draining = True
            if manage_engine:
                await asyncio.to_thread(engine.shutdown, drain=True, timeout=st.drain_s)

    app = FastAPI(title="dspark-jax", lifespan=lifespan)
    app.state.server = st
    _add_error_handlers(app)
    _add_routes(app, st)
    if api_key:
        app.add_middleware(_BearerAuth, api_key=api_key)
    return app


class _BearerAuth:
    """ASGI middleware: every HTTP route but /health needs `Authorization: Bearer <key>`,
    compared in constant time; a 401 goes out before the body is read."""

    OPEN = frozenset({"/health"})

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = b"Bearer " + api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.OPEN:
            return await self.app(scope, receive, send)
        got = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(got, self.expected):
            return await self.app(scope, receive, send)
        why = "missing" if not got else "invalid"
        resp = error_response(401, f"{why} API key: send the header 'Authorization: Bearer "
                                   "<key>' with the server's --api-key / DSPARK_API_KEY",
                              headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        await resp(scope, receive, send)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-style JSON error body."""

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(request, exc):
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def _add_routes(app: FastAPI, st: _State) -> None:
    """/health, /v1/models, /metrics, /v1/completions and /v1/chat/completions."""

    @app.get("/health")
    async def health():
        if st.draining:
            return error_response(503, "the server is shutting down")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models():
        card = {"id": st.model, "object": "model", "created": st.created,
                "owned_by": "dspark-jax", "max_model_len": st.max_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        return Response(st.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(st, request, CompletionRequest)
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            ids = st.tok(prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = list(prompt)
            bad = [i for i in ids if not 0 <= i < st.vocab]
            if bad:
                raise _reject(st, APIError(400, f"prompt token ids must lie in [0, {st.vocab}); "
                                                f"got {bad[:4]}", param="prompt"))  # fmt: skip
        return await _serve(st, request, req, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await _parse(st, request, ChatCompletionRequest)
        try:
            text = st.tok.apply_chat_template(
                req.template_messages(), tokenize=False,
                add_generation_prompt=req.add_generation_prompt,
            )  # fmt: skip
        except Exception as e:  # jinja raises its own errors for messages it cannot render
            raise _reject(st, APIError(400, f"messages: the chat template failed: {e}",
                                       param="messages")) from None  # fmt: skip
        ids = st.tok(text, add_special_tokens=False)["input_ids"]
        return await _serve(st, request, req, ids, chat=True)


def _reject(st: _State, err: APIError) -> APIError:
    st.metrics.rejected({429: "queue_full", 503: "unavailable"}.get(err.status, "invalid"))
    return err


async def _parse(st: _State, request: Request, model):
    if st.draining:
        raise _reject(st, APIError(503, "the server is shutting down; retry on another replica"))
    raw = await _read_body(st, request)
    try:
        req = parse_body(model, raw)
    except APIError as e:
        raise _reject(st, e) from None
    if req.model is not None and req.model != st.model:
        raise _reject(st, APIError(404, f"the model {req.model!r} does not exist; this server "
                                        f"serves {st.model!r}", param="model"))  # fmt: skip
    return req


async def _read_body(st: _State, request: Request) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `st.max_body`: from its
    Content-Length before reading, else while the chunks arrive."""

    def too_large(size: str) -> APIError:
        return _reject(st, APIError(413, f"the request body is {size} bytes; this server accepts "
                                         f"at most {st.max_body} (--max-body-bytes)"))  # fmt: skip

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > st.max_body:
        raise too_large(declared)
    parts, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > st.max_body:
            raise too_large(f"at least {n}")
        parts.append(chunk)
    return b"".join(parts)


def _params(st: _State, req, prompt_len: int) -> RequestParams:
    if prompt_len == 0:
        raise APIError(400, "the prompt is empty; send at least one token", param="prompt")
    if prompt_len >= st.max_len:
        raise APIError(400, f"this model's maximum context length is {st.max_len} tokens and "
                            f"the prompt has {prompt_len}; shorten the prompt",
                       param="prompt")  # fmt: skip
    max_tokens = req.max_tokens if req.max_tokens is not None else st.max_len - prompt_len
    if prompt_len + max_tokens > st.max_len:
        raise APIError(400, f"this model's maximum context length is {st.max_len} tokens; the "
                            f"prompt ({prompt_len}) plus max_tokens ({max_tokens}) exceeds it — "
                            f"lower max_tokens to <= {st.max_len - prompt_len}",
                       param="max_tokens")  # fmt: skip
    extra = req.extra_stop_ids()
    bad = [i for i in extra if not 0 <= i < st.vocab]
    if bad:
        raise APIError(400, f"stop token ids must lie in [0, {st.vocab}); got {bad[:4]}",
                       param="stop_token_ids")  # fmt: skip
    stop_ids = tuple(dict.fromkeys(([] if req.ignore_eos else list(st.eos_ids)) + extra))
    return RequestParams(
        max_new_tokens=max_tokens, temperature=req.temperature, top_k=max(req.top_k, 0),
        top_p=req.top_p, min_p=req.min_p, seed=req.seed, stop_ids=stop_ids,
    )  # fmt: skip


async def _serve(st: _State, request: Request, req, ids: list[int], *, chat: bool):
    t0 = time.perf_counter()
    try:
        params = _params(st, req, len(ids))
        handle = st.engine.submit(list(ids), params)
    except APIError as e:
        raise _reject(st, e) from None
    except QueueFull as e:
        raise _reject(st, APIError(429, f"the request queue is full ({e}); retry later")) from None
    except RequestError as e:
        raise _reject(st, APIError(400, str(e))) from None
    except RuntimeError as e:  # the engine is not running (shutting down)
        raise _reject(st, APIError(503, f"the engine is not accepting requests: {e}")) from None
    st.metrics.prompt_tokens.inc(len(ids))
    run = Run(st, handle, req, params.stop_ids, t0)
    kind = "chat.completion" if chat else "text_completion"
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    base = {"id": rid, "object": kind + (".chunk" if chat and req.stream else ""),
            "created": int(time.time()), "model": st.model}  # fmt: skip
    if req.stream:
        return StreamingResponse(
            sse_stream(run, base, req, len(ids), chat=chat), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )  # fmt: skip
    return await unary(run, request, base, req, len(ids), chat=chat)
