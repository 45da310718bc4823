"""OpenAI-compatible HTTP server over one `ServingEngine` (FastAPI + uvicorn).

    app = create_app(engine, tokenizer, "dspark-tiny", stop_ids=run.stop_ids())
    server_run.run_server(app, "127.0.0.1", 8000)   # blocks; SIGINT/SIGTERM drain and exit

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (the tokenizer's chat template),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus, see `server_metrics`).

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
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark_jax.engine import faults
from dspark_jax.engine.http_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_response,
    parse_body,
)
from dspark_jax.engine.http_text import IncrementalDetokenizer, StopStrings
from dspark_jax.engine.requests import QueueFull, RequestParams
from dspark_jax.engine.server_metrics import ServerMetrics
from dspark_jax.errors import RequestError

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
    run = _Run(st, handle, req, params.stop_ids, t0)
    kind = "chat.completion" if chat else "text_completion"
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    base = {"id": rid, "object": kind + (".chunk" if chat and req.stream else ""),
            "created": int(time.time()), "model": st.model}  # fmt: skip
    if req.stream:
        return StreamingResponse(
            _sse_stream(run, base, req, len(ids), chat=chat), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )  # fmt: skip
    return await _unary(run, request, base, req, len(ids), chat=chat)


class _Run:
    """One request's deltas turned into text pieces; records the finish reason and stats."""

    def __init__(self, st: _State, handle, req, stop_ids, t0: float):
        self.st, self.handle, self.t0 = st, handle, t0
        self.detok = IncrementalDetokenizer(st.tok)
        self.stops = StopStrings(req.stop_strings())
        self.stop_ids = set(stop_ids)
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.error = faults.message("internal")  # the message of finish_reason "error"
        self.stats = None
        self._last = None
        self._engine_done = False
        self._recorded = False

    async def pieces(self) -> AsyncIterator[tuple[str, list[int]]]:
        """(text, token ids) per engine delta; stops at the end of the request."""
        m = self.st.metrics
        deltas = self.handle.astream()
        while True:
            try:
                d = await self._next(deltas)
            except StopAsyncIteration:
                break
            except TimeoutError:
                self.abort("timeout")
                return
            toks = [int(t) for t in d.tokens]
            if d.stats is not None:
                self.stats = d.stats
            if toks and self.finish_reason is None:
                now = time.perf_counter()
                if self._last is None:
                    m.ttft.observe(now - self.t0)
                else:
                    for _ in toks:
                        m.itl.observe((now - self._last) / len(toks))
                self._last = now
                m.generation_tokens.inc(len(toks))
                self.tokens += toks
                shown = toks
                if d.finished and d.finish_reason == "stop" and toks[-1] in self.stop_ids:
                    shown = toks[:-1]  # the stop token is not part of the text
                try:
                    text, hit = self.stops.push(self.detok.add(shown))
                except Exception as e:  # noqa: BLE001 - the tokenizer's own error types
                    self._detok_failed(e)
                    return
                if hit:
                    self.finish_reason = "stop"
                    if not d.finished:
                        self.handle.cancel()  # drain to the final delta for the stats
                if text or toks:
                    yield text, toks
            if d.finished:
                self._engine_done = True
                if d.error is not None:
                    self.error = d.error
                if self.finish_reason is None:
                    self.finish_reason = d.finish_reason or "stop"
                    try:
                        tail, _ = self.stops.push(self.detok.flush())
                    except Exception as e:  # noqa: BLE001 - the tokenizer's own error types
                        self._detok_failed(e)
                        return
                    tail += self.stops.flush()
                    if tail:
                        yield tail, []
                break
        self._record({"cancelled": "abort"}.get(self.finish_reason, self.finish_reason))

    def _detok_failed(self, exc: BaseException) -> None:
        """The tokenizer raised on this request's tokens: end it in the engine with an error
        (frees its slot; counted as "detokenize", also when the engine had finished it), the
        other requests unaffected."""
        self.st.engine.fail(self.handle.id, "detokenize", type(exc).__name__)
        self.finish_reason = "error"
        self.error = faults.message("detokenize", type(exc).__name__)
        self._record("error")

    async def _next(self, deltas):
        """The next delta; TimeoutError once `request_timeout_s` since arrival has passed."""
        if self.st.timeout_s is None:
            return await anext(deltas)
        left = self.t0 + self.st.timeout_s - time.perf_counter()
        if left <= 0:
            raise TimeoutError
        return await asyncio.wait_for(anext(deltas), left)

    def timeout_error(self) -> APIError:
        return APIError(504, f"the request did not finish within the server's limit of "
                             f"{self.st.timeout_s:g} s (--request-timeout) and was cancelled; "
                             "lower max_tokens or retry later",
                        headers={"x-should-retry": "false"})  # fmt: skip

    def _record(self, outcome: str) -> None:
        if not self._recorded:
            self._recorded = True
            self.st.metrics.finished(outcome)
            self.st.metrics.e2e.observe(time.perf_counter() - self.t0)

    def abort(self, reason: str = "cancelled") -> None:
        """The client went away or the request timed out: cancel it in the engine (frees the
        slot at the next round)."""
        if not self._engine_done:
            self.handle.cancel()
        if self.finish_reason is None:
            self.finish_reason = reason
        done = self.finish_reason not in ("cancelled", "timeout")
        self._record(self.finish_reason if done else "abort")

    def usage(self, prompt_len: int) -> dict[str, int]:
        n = len(self.tokens)
        return {"prompt_tokens": prompt_len, "completion_tokens": n,
                "total_tokens": prompt_len + n}  # fmt: skip

    def spec_stats(self) -> dict[str, Any] | None:
        s = self.stats
        if s is None:
            return None
        return {"rounds": int(s.rounds), "drafted": int(s.drafted), "verified": int(s.verified),
                "accepted": int(s.accepted), "emitted": int(s.emitted),
                "mean_accepted_length": float(s.mean_accepted_length)}  # fmt: skip


def _choice(chat: bool, text: str | None, finish: str | None, *, delta: bool) -> dict:
    if not chat:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    if delta:
        return {"index": 0, "delta": {} if text is None else {"content": text},
                "logprobs": None, "finish_reason": finish}  # fmt: skip
    msg = {"role": "assistant", "content": text or ""}
    return {"index": 0, "message": msg, "logprobs": None, "finish_reason": finish}


def _public_reason(reason: str | None) -> str | None:
    return {"cancelled": "stop"}.get(reason, reason)


async def _unary(run: _Run, request: Request, base, req, prompt_len, *, chat: bool):
    async def collect():
        parts = []
        async for text, _ in run.pieces():
            parts.append(text)
        return "".join(parts)

    work = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_disconnected(request))
    done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    if work not in done:
        work.cancel()
        run.abort()
        return Response(status_code=499)  # nobody reads it
    gone.cancel()
    text = work.result()
    if run.finish_reason == "error":
        raise APIError(500, run.error)
    if run.finish_reason == "timeout":
        raise run.timeout_error()
    choice = _choice(chat, text, _public_reason(run.finish_reason), delta=False)
    if req.return_token_ids:
        choice["token_ids"] = run.tokens
    body = dict(base, choices=[choice], usage=run.usage(prompt_len))
    body["spec_stats"] = run.spec_stats()
    return JSONResponse(body)


async def _disconnected(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _sse_stream(run: _Run, base, req, prompt_len, *, chat: bool):
    finished = False
    try:
        if chat:
            first = _choice(True, "", None, delta=True)
            first["delta"]["role"] = "assistant"
            yield _sse(dict(base, choices=[first], usage=None))
        async for text, toks in run.pieces():
            choice = _choice(chat, text, None, delta=True)
            if req.return_token_ids:
                choice["token_ids"] = toks
            yield _sse(dict(base, choices=[choice], usage=None))
        finished = True
        if run.finish_reason == "error":
            yield _sse({"error": {"message": run.error, "type": "internal_server_error",
                                  "code": 500}})  # fmt: skip
        elif run.finish_reason == "timeout":
            err = run.timeout_error()
            yield _sse({"error": {"message": err.message, "type": err.kind, "code": 504}})
        else:
            last = _choice(chat, None if chat else "", _public_reason(run.finish_reason),
                           delta=True)  # fmt: skip
            if req.return_token_ids:
                last["token_ids"] = []
            yield _sse(dict(base, choices=[last], usage=None, spec_stats=run.spec_stats()))
            if req.include_usage:
                yield _sse(dict(base, choices=[], usage=run.usage(prompt_len),
                                spec_stats=run.spec_stats()))  # fmt: skip
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # client disconnected (the response task was cancelled) or an error
            run.abort()
