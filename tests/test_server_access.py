"""Server access and limits over live uvicorn servers: the API key, the body size, the request
limits, the per-request timeout, 429 / 503 with Retry-After. The engine is never started (no
compilation): its requests wait in the queue, which is what the timeout and queue tests need."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from dspark_jax import drafters, runtime
from dspark_jax.engine.engine import ServingEngine
from dspark_jax.models import init_params
from dspark_jax.server.app import create_app
from dspark_jax.server.protocol import MAX_STOP_CHARS, MAX_STOP_IDS, MAX_STOPS
from dspark_jax.server.run import serve_in_thread
from dspark_jax.testing import tiny_drafter_config, tiny_target_config, tiny_tokenizer

MODEL = "dspark-tiny"
MAX_LEN = 128
KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 4096
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.getbasetemp() / "tok_cache")


@pytest.fixture(scope="module")
def engine():
    tcfg = tiny_target_config(vocab_size=512)
    tp = init_params(tcfg, 0)
    dcfg = tiny_drafter_config("dspark", tcfg, mask_token_id=3)
    dp = drafters.init_params(dcfg, target_params=tp)
    return ServingEngine(tcfg, dcfg, tp, dp, num_slots=2, max_len=MAX_LEN, policy="fixed",
                         prompt_buckets=(32,), token_buckets=(20,), max_queue=2)  # fmt: skip


def _serve(app):
    server, thread, port = serve_in_thread(app)
    return server, thread, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def guarded(engine, tok):
    """(url, app) of a server with an API key, a small body limit and a 1 s request timeout."""
    app = create_app(engine, tok, MODEL, stop_ids=[2], manage_engine=False, api_key=KEY,
                     max_body_bytes=MAX_BODY, request_timeout_s=TIMEOUT_S)  # fmt: skip
    server, thread, url = _serve(app)
    yield url, app
    server.should_exit = True
    thread.join(30)


def _queue_empty(engine, timeout=5.0):
    deadline = time.monotonic() + timeout
    while engine.metrics().queue_len and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.metrics().queue_len == 0


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["type"] and err["message"]
    return err


ROUTES = [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
          ("POST", "/v1/chat/completions"), ("GET", "/no/such/route")]  # fmt: skip


@pytest.mark.parametrize("method, path", ROUTES)
@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {KEY}", KEY, f"Bearer {KEY}x"])
def test_every_route_but_health_needs_the_key(guarded, method, path, auth):
    url, _ = guarded
    headers = {} if auth is None else {"Authorization": auth}
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1} if method == "POST" else None
    r = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
    err = _error(r, 401)
    assert "API key" in err["message"] and err["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer"


def test_health_is_open_and_the_key_opens_the_rest(guarded):
    url, _ = guarded
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert httpx.get(url + "/v1/models", headers=AUTH, timeout=30).json()["data"][0]["id"] == MODEL
    assert httpx.get(url + "/metrics", headers=AUTH, timeout=30).status_code == 200
    ok = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert ok.models.list().data[0].id == MODEL
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        bad.models.list()


def test_oversized_body_is_413_before_parsing(guarded, engine):
    url, _ = guarded
    before = engine.metrics().requests_submitted
    big = json.dumps({"model": MODEL, "prompt": "x" * MAX_BODY}).encode()
    r = httpx.post(url + "/v1/completions", content=big, headers=AUTH, timeout=30)
    assert str(MAX_BODY) in _error(r, 413)["message"]

    def chunks():  # no Content-Length: the limit holds while the chunks arrive
        yield b'{"model": "dspark-tiny", "prompt": "'
        for _ in range(64):
            yield b"y" * 256
        yield b'"}'

    r = httpx.post(url + "/v1/completions", content=chunks(), headers=AUTH, timeout=30)
    assert "content-length" not in r.request.headers
    assert "--max-body-bytes" in _error(r, 413)["message"]
    assert engine.metrics().requests_submitted == before


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"n": 2}, "n=2 is not supported"),
        ({"stop": [f"s{i}" for i in range(MAX_STOPS + 1)]}, f"at most {MAX_STOPS}"),
        ({"stop": "z" * (MAX_STOP_CHARS + 1)}, f"at most {MAX_STOP_CHARS}"),
        ({"stop_token_ids": [5] * (MAX_STOP_IDS + 1)}, f"at most {MAX_STOP_IDS}"),
        # {limit}: the engine's token limit, max_len less the γ + 1 lookahead a round writes
        ({"prompt": [5] * MAX_LEN}, "maximum context length is {limit} tokens"),
        ({"max_tokens": MAX_LEN}, "lower max_tokens to <= {limit_less_prompt}"),
    ],
)
def test_request_limits_are_400_naming_the_limit(guarded, engine, extra, needle):
    url, _ = guarded
    before = engine.metrics().requests_submitted
    body = {"model": MODEL, "prompt": [5]} | extra
    r = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=30)
    limit = engine.token_limit
    needle = needle.format(limit=limit, limit_less_prompt=limit - 1)
    assert limit < MAX_LEN and needle in _error(r, 400)["message"]
    assert engine.metrics().requests_submitted == before


def test_timeout_cancels_in_the_engine_and_answers_504(guarded, engine):
    url, _ = guarded
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4}
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=30)
    err = _error(r, 504)
    assert TIMEOUT_S <= time.monotonic() - t0 < TIMEOUT_S + 10
    assert "--request-timeout" in err["message"] and r.headers["x-should-retry"] == "false"
    _queue_empty(engine)  # cancelled in the engine

    # streaming: the response has begun (200), so the stream ends with a 504 error event
    with httpx.stream("POST", url + "/v1/completions", headers=AUTH, timeout=30,
                      json=body | {"stream": True}) as r:  # fmt: skip
        assert r.status_code == 200
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 504
    _queue_empty(engine)

    # the openai client raises, and does not retry (x-should-retry: false)
    before = engine.metrics().requests_submitted
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=2)
    with pytest.raises(openai.InternalServerError, match="request-timeout"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=4)
    assert engine.metrics().requests_submitted == before + 1
    _queue_empty(engine)


def test_full_queue_is_429_and_draining_is_503_with_retry_after(engine, tok):
    app = create_app(engine, tok, MODEL, stop_ids=[2], manage_engine=False)
    server, thread, url = _serve(app)
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30):
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30):
                r = httpx.post(url + "/v1/completions", json=body, timeout=30)
                assert "queue is full" in _error(r, 429)["message"]
                assert int(r.headers["retry-after"]) >= 1
        _queue_empty(engine)
        app.state.server.draining = True
        for r in (httpx.post(url + "/v1/completions", json=body, timeout=30),
                  httpx.get(url + "/health", timeout=30)):  # fmt: skip
            assert "shutting down" in _error(r, 503)["message"]
            assert int(r.headers["retry-after"]) >= 1
    finally:
        app.state.server.draining = False
        server.should_exit = True
        thread.join(30)


def test_api_key_from_the_environment():
    assert runtime.read({"DSPARK_API_KEY": " k1 "}).api_key == "k1"
    assert runtime.read({}).api_key == ""
    assert "k1" not in repr(runtime.read({"DSPARK_API_KEY": "k1"}))
