"""Faults inside the server's requests (issue 42, item 2) over a live uvicorn server and a real
`ServingEngine`: logits that turn NaN (a target whose embedding of one token id is NaN), a token
the tokenizer cannot decode, out of memory on admission (`EnginePrograms.set_fault`) and a client
that leaves mid-stream. Each ends only its own request (HTTP 500 with an OpenAI error body, or a
final error event), the others get exactly their greedy tokens, `/metrics` counts the errors by
cause and every slot is free afterwards."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx
import jax
import jax.numpy as jnp
import pytest

from dspark_jax.engine.engine import ServingEngine
from dspark_jax.models.generate import generate
from dspark_jax.server.app import create_app
from dspark_jax.server.run import serve_in_thread
from dspark_jax.testing import tiny_tokenizer
from tests.engine_models import agreeing_pair

POISON = 61  # NaN embedding: the greedy continuations of [1, 2] and [20, 21] reach it
UNDECODABLE = 58  # the tokenizer raises on it: only [33, 34]'s continuation has it
CLEAN = [[3, 9, 1], [5, 6, 7, 8, 2], [8, 9, 10, 11]]
MAX_NEW = 24


class _CannotDecode:
    """The tiny tokenizer, but decoding UNDECODABLE raises (like an id its vocabulary lacks)."""

    def __init__(self, tok):
        self._tok = tok

    def decode(self, ids, **kw):
        if UNDECODABLE in list(ids):
            raise ValueError(f"token id {UNDECODABLE} has no text")
        return self._tok.decode(ids, **kw)

    def __call__(self, *a, **kw):
        return self._tok(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tcfg, tp, dcfg, dp = agreeing_pair(vocab=64, gamma=4)
    emb = tp["embed_tokens"]
    tp["embed_tokens"] = emb.replace(emb[...].at[POISON].set(jnp.nan))
    eng = ServingEngine(tcfg, dcfg, tp, dp, num_slots=4, max_len=64, policy="fixed",
                        prompt_buckets=(8,), token_buckets=(20,), cache_buckets=(64,),
                        modes=("greedy",))  # fmt: skip
    eng.warmup()
    tok = _CannotDecode(tiny_tokenizer(tmp_path_factory.getbasetemp() / "tok_cache"))
    server, thread, port = serve_in_thread(create_app(eng, tok, "faulty", stop_ids=()))
    refs = {tuple(p): generate(tcfg, tp, [p], max_new_tokens=MAX_NEW)[0] for p in CLEAN}
    yield f"http://127.0.0.1:{port}", eng, refs
    server.should_exit = True
    thread.join(60)


def _body(prompt, stream=False):
    return {"model": "faulty", "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream}  # fmt: skip


def _unary(url, prompt):
    r = httpx.post(url + "/v1/completions", json=_body(prompt), timeout=60)
    return r.status_code, r.json()


def _stream_events(url, prompt):
    with httpx.stream("POST", url + "/v1/completions", json=_body(prompt, True), timeout=60) as r:
        return [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]


def _errors(url) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name == "dspark:request_errors_total":
                out[s.labels["cause"]] = s.value
    return out


def _all_free(eng, timeout=60.0):
    deadline = time.monotonic() + timeout
    while eng.has_work() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert eng.slots.running() == [] and not eng.slots.queue and not eng.slots.by_id


def test_faulty_requests_end_with_errors_and_the_others_are_exact(live):
    url, eng, refs = live
    before = _errors(url)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        clean = [pool.submit(_unary, url, p) for p in CLEAN]
        nan_unary = pool.submit(_unary, url, [1, 2])
        nan_stream = pool.submit(_stream_events, url, [20, 21])
        undecodable = pool.submit(_unary, url, [33, 34])
        for f, p in zip(clean, CLEAN):
            status, body = f.result()
            assert status == 200 and body["choices"][0]["token_ids"] == refs[tuple(p)]
            assert body["choices"][0]["finish_reason"] == "length"
        status, body = nan_unary.result()
        assert status == 500 and body["error"]["type"] == "internal_server_error"
        assert "non-finite" in body["error"]["message"]
        events = nan_stream.result()
        assert "non-finite" in events[-1]["error"]["message"] and events[-1]["error"]["code"] == 500
        assert all("choices" in e for e in events[:-1])
        status, body = undecodable.result()
        assert status == 500 and "tokenizer could not decode" in body["error"]["message"]
    _all_free(eng)
    after = _errors(url)
    assert after["nonfinite"] == before["nonfinite"] + 2
    assert after["detokenize"] == before["detokenize"] + 1


def test_out_of_memory_on_admission_is_a_500_and_the_server_serves_on(live):
    url, eng, refs = live
    before = _errors(url)["oom"]
    fired = []

    def oom_once(name, run):
        if name == "prefill" and not fired:
            fired.append(name)
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1GiB")
        return run()

    eng.programs.set_fault(oom_once)
    try:
        status, body = _unary(url, CLEAN[0])
    finally:
        eng.programs.set_fault(None)
    assert status == 500 and "out of memory" in body["error"]["message"]
    status, body = _unary(url, CLEAN[0])
    assert status == 200 and body["choices"][0]["token_ids"] == refs[tuple(CLEAN[0])]
    assert _errors(url)["oom"] == before + 1
    _all_free(eng)


def test_client_leaving_mid_stream_cancels_and_frees_the_slot(live, monkeypatch):
    """The engine's second round for the request waits until the server has seen the client
    leave and asked the engine to cancel, so the request cannot reach its length first (on a
    loaded machine the disconnect can take longer to notice than 50 tokens take to decode)."""
    url, eng, _ = live
    cancelled = eng.metrics().requests_finished_by_reason.get("cancelled", 0)
    asked, rounds = threading.Event(), []
    cancel = eng.cancel
    monkeypatch.setattr(eng, "cancel", lambda rid: (asked.set(), cancel(rid)))

    def hold_second_round(program, run):
        if program != "prefill":
            rounds.append(program)
            if len(rounds) == 2:
                asked.wait(60)
        return run()

    eng.programs.set_fault(hold_second_round)
    try:
        body = _body([9, 8, 7], stream=True) | {"max_tokens": 50}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # leave after the first chunk
        assert asked.wait(60), "the server never cancelled the request of the client that left"
        _all_free(eng)
    finally:
        asked.set()
        eng.programs.set_fault(None)
    assert eng.metrics().requests_finished_by_reason["cancelled"] == cancelled + 1
