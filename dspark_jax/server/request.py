"""One request of the HTTP server (`server/app.py`), from its engine handle to the response:
`Run` turns the engine's deltas into text pieces (incremental detokenizing, stop strings, the
finish reason, errors and stats recorded in the server's metrics); `unary` answers with one
OpenAI response body, `sse_stream` with server-sent events; a client that leaves cancels the
request in the engine."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from dspark_jax.engine import faults
from dspark_jax.server.protocol import APIError
from dspark_jax.server.text import IncrementalDetokenizer, StopStrings


class Run:
    """One request's deltas turned into text pieces; records the finish reason and stats in
    `st`, the server's state (`server._State`: engine, tokenizer, metrics, timeout)."""

    def __init__(self, st, handle, req, stop_ids, t0: float):
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


async def unary(run: Run, request: Request, base, req, prompt_len, *, chat: bool):
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


async def sse_stream(run: Run, base, req, prompt_len, *, chat: bool):
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
