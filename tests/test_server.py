"""The HTTP server end to end: the real `openai` client against a live uvicorn server on a free
127.0.0.1 port, backed by a real `ServingEngine` on tiny models (one warm-up for the module)."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import openai
import pytest

from dspark_jax import drafters
from dspark_jax.engine.engine import ServingEngine
from dspark_jax.engine.requests import RequestParams
from dspark_jax.models import init_params
from dspark_jax.models.generate import generate
from dspark_jax.server.app import create_app
from dspark_jax.server.run import serve_in_thread
from dspark_jax.testing import tiny_drafter_config, tiny_target_config, tiny_tokenizer
from dspark_jax.train.tokenizer import special_token_ids

MODEL = "dspark-tiny"
MAX_LEN = 128


def _engine(tcfg, tp, **kw):
    dcfg = tiny_drafter_config("dspark", tcfg, mask_token_id=3)
    dp = drafters.init_params(dcfg, target_params=tp)
    opts = dict(num_slots=4, max_len=MAX_LEN, policy="fixed", prompt_buckets=(32,),
                token_buckets=(20,), max_queue=16)  # fmt: skip
    return ServingEngine(tcfg, dcfg, tp, dp, **(opts | kw))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.getbasetemp() / "tok_cache")


@pytest.fixture(scope="module")
def target():
    tcfg = tiny_target_config(vocab_size=512)
    return tcfg, init_params(tcfg, 0)


@pytest.fixture(scope="module")
def live(tok, target):
    """(base url, engine, stop ids) of a started server; stopped (engine drained) at the end."""
    eng = _engine(*target)
    eng.warmup()
    stop = special_token_ids(tok)["eos_ids"]
    app = create_app(eng, tok, MODEL, stop_ids=stop)
    server, thread, port = serve_in_thread(app)
    yield f"http://127.0.0.1:{port}", eng, stop
    server.should_exit = True
    thread.join(60)
    assert not thread.is_alive()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live[0] + "/v1", api_key="unused", max_retries=0)


def _ids(resp) -> list[int]:
    return resp.choices[0].model_extra["token_ids"]


def _idle(eng, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = eng.metrics()
        if m.running == 0 and m.queue_len == 0:
            return m
        time.sleep(0.02)
    raise AssertionError(f"engine not idle after {timeout} s: {eng.metrics()}")


def _metric(url, name, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def test_completion_greedy_equals_engine_and_plain_greedy(live, client, tok, target):
    url, eng, stop = live
    prompt = "The answer is"
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    (ref,) = eng.generate([ids], RequestParams(20, temperature=0.0, stop_ids=tuple(stop)))
    assert _ids(r) == ref.tokens
    plain = generate(target[0], target[1], [ids], max_new_tokens=20, stop_ids=stop)[0]
    assert _ids(r) == plain
    assert r.choices[0].text == tok.decode(ref.tokens, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.tokens)
    spec = r.model_extra["spec_stats"]
    assert spec["rounds"] >= 1 and spec["drafted"] == 4 * spec["rounds"]
    assert 0 <= spec["accepted"] <= spec["verified"] <= spec["drafted"]
    assert spec["mean_accepted_length"] >= 1.0


def test_chat_streaming_equals_non_streaming(live, client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].model_extra["spec_stats"] == full.model_extra["spec_stats"]


def test_raw_stream_is_sse_ending_with_done(live):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 6, "stream": True,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    with httpx.stream("POST", live[0] + "/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]" and all(x.startswith("data: ") for x in lines)
    events = [json.loads(x[6:]) for x in lines[:-1]]
    assert sum(len(e["choices"][0]["token_ids"] or []) for e in events) == 6
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_concurrent_streams_each_equal_their_greedy(live, client, tok):
    url, eng, stop = live
    prompts = [[5 + i, 40 + 3 * i, 7, 9 + i] for i in range(7)]  # more streams than slots
    refs = eng.generate(prompts, RequestParams(24, temperature=0.0, stop_ids=tuple(stop)))

    def run(p):
        s = client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0,
                                      stream=True, extra_body={"return_token_ids": True})  # fmt: skip
        ids, text = [], ""
        for c in s:
            ids += c.choices[0].model_extra.get("token_ids") or []
            text += c.choices[0].text
        return ids, text

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(run, prompts))
    for (ids, text), ref in zip(outs, refs):
        assert ids == ref.tokens
        assert text == tok.decode(ref.tokens, skip_special_tokens=True)
    _idle(eng)


def test_sampled_with_seed_is_reproducible(client):
    kw = dict(model=MODEL, prompt="Once", max_tokens=16, temperature=0.9, top_p=0.95, seed=123,
              extra_body={"top_k": 50, "min_p": 0.01, "return_token_ids": True})  # fmt: skip
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert _ids(a) == _ids(b) and len(_ids(a)) >= 1


def test_stop_strings_and_stop_ids(live, client, tok):
    kw = dict(model=MODEL, prompt=[11, 12, 13], max_tokens=30, temperature=0)
    free = client.completions.create(
        **kw, extra_body={"return_token_ids": True, "ignore_eos": True}
    )
    text, ids = free.choices[0].text, _ids(free)
    stop_str = text[4:6]
    r = client.completions.create(**kw, stop=[stop_str], extra_body={"ignore_eos": True})
    assert r.choices[0].text == text[: text.find(stop_str)]
    assert r.choices[0].finish_reason == "stop"
    stop_id = ids[5]
    cut = ids.index(stop_id) + 1
    r = client.completions.create(
        **kw, extra_body={"stop_token_ids": [stop_id], "ignore_eos": True, "return_token_ids": True}
    )
    assert _ids(r) == ids[:cut] and r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == tok.decode(ids[: cut - 1], skip_special_tokens=True)
    _idle(live[1])


@pytest.mark.parametrize(
    "body, status, needle",
    [
        (b'{"model": "dspark-tiny", "prompt": "x", "max_tokens": ', 400, "malformed JSON"),
        (b'{"model": "dspark-tiny", "prompt": "x", "temperature": "hot"}', 400, "temperature"),
        (b'{"model": "dspark-tiny", "prompt": "x", "top_p": 1.5}', 400, "top_p"),
        (b'{"model": "dspark-tiny", "prompt": "x", "n": 2}', 400, "n=2"),
        (b'{"model": "dspark-tiny", "prompt": ""}', 400, "empty"),
        (b'{"model": "dspark-tiny", "prompt": [1, 999999]}', 400, "token ids"),
        (b'{"model": "dspark-tiny", "prompt": "x", "max_tokens": 500}', 400, "max_tokens"),
        (b'{"model": "other", "prompt": "x"}', 404, "does not exist"),
    ],
)
def test_errors_are_openai_shaped_4xx(live, body, status, needle):
    before = live[1].metrics().requests_submitted
    r = httpx.post(live[0] + "/v1/completions", content=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] and err["code"] == status
    assert live[1].metrics().requests_submitted == before  # refused before any work


def test_errors_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=MODEL, prompt=[5] * (MAX_LEN + 3), max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="min_p"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"min_p": 3})
    assert client.models.list().data[0].id == MODEL


def test_stream_disconnect_cancels_and_frees_the_slot(live):
    url, eng, _ = live
    aborted = _metric(url, "vllm:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": [9, 8, 7], "max_tokens": 120, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first chunk
    m = _idle(eng)
    assert m.requests_finished_by_reason.get("cancelled", 0) >= 1
    assert _metric(url, "vllm:request_success_total", finished_reason="abort") == aborted + 1


def test_metrics_follow_the_engine(live, client):
    url, eng, _ = live
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=8, temperature=0)
    m = _idle(eng)
    assert _metric(url, "vllm:num_requests_running") == 0
    assert _metric(url, "vllm:num_requests_waiting") == 0
    assert _metric(url, "vllm:spec_decode_num_draft_tokens_total") == m.draft_tokens
    assert _metric(url, "vllm:spec_decode_num_accepted_tokens_total") == m.accepted_tokens
    assert _metric(url, "dspark:spec_decode_num_verified_tokens_total") == m.verified_tokens
    per_pos = sum(_metric(url, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(j))
                  for j in range(4))  # fmt: skip
    assert per_pos == m.accepted_tokens
    assert _metric(url, "dspark:spec_decode_verified_tokens_per_round_count") == m.rounds
    assert _metric(url, "vllm:time_to_first_token_seconds_count") >= 1
    assert _metric(url, "vllm:inter_token_latency_seconds_count") >= 1
    assert _metric(url, "dspark:request_rejected_total", reason="invalid") >= 1


def test_full_queue_is_429_and_abandoned_requests_leave_the_queue(tok, target):
    """An engine that is never started keeps requests queued: the third is refused with 429;
    clients that give up (streaming or not) take their requests out of the queue."""
    eng = _engine(*target, max_queue=2)
    app = create_app(eng, tok, MODEL, stop_ids=[2], manage_engine=False)
    server, thread, port = serve_in_thread(app)
    url = f"http://127.0.0.1:{port}"
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + "/v1/completions", json=body | {"stream": False}, timeout=0.5)
            deadline = time.monotonic() + 5  # the timed-out request is cancelled server-side
            while eng.metrics().queue_len != 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert eng.metrics().queue_len == 1
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30):
                r = httpx.post(url + "/v1/completions", json=body, timeout=30)
                assert r.status_code == 429 and "queue is full" in r.json()["error"]["message"]
                assert int(r.headers["retry-after"]) >= 1
        deadline = time.monotonic() + 5
        while eng.metrics().queue_len and time.monotonic() < deadline:
            time.sleep(0.02)
        assert eng.metrics().queue_len == 0 and eng.metrics().running == 0
        assert _metric(url, "dspark:request_rejected_total", reason="queue_full") == 1
        assert _metric(url, "vllm:request_success_total", finished_reason="abort") == 3
    finally:
        server.should_exit = True
        thread.join(30)


def test_reduced_load_test(live):
    import asyncio

    from dspark_jax.eval.load_test import run_load

    res = asyncio.run(run_load(live[0], requests=100, concurrencies=(1, 4, 8), seed=1))
    s = res["summary"]
    assert s["ok"], res["failures"]
    assert s["valid_sent"] == s["valid_completed"] > 0
    assert s["server_5xx"] == 0 and s["leaked_slots"] == 0 and s["leaked_queue"] == 0
    assert res["sent"]["abandon"] > 0 and res["sent"]["malformed"] > 0
    counted = s["server_counted"]
    assert counted["vllm:request_success_total{length}"] >= s["valid_completed"]
    assert counted["vllm:request_success_total{abort}"] >= 1  # abandoned streams were cancelled
    assert counted["dspark:request_rejected_total{invalid}"] == sum(
        res["sent"][k] for k in ("malformed", "bad_knob", "too_long")
    )


def test_api_key_over_the_running_engine_and_bench_sends_it(live, tok, capsys):
    """A second app with an API key over the live engine: the openai client with the key gets
    its completion; `serve.py bench` refuses to run without the key and passes with it."""
    from dspark_jax.cli import bench

    url, eng, stop = live
    app = create_app(eng, tok, MODEL, stop_ids=stop, manage_engine=False, api_key="k-42")
    server, thread, port = serve_in_thread(app)
    keyed = f"http://127.0.0.1:{port}"
    try:
        c = openai.OpenAI(base_url=keyed + "/v1", api_key="k-42", max_retries=0)
        r = c.completions.create(model=MODEL, prompt="key", max_tokens=6, temperature=0,
                                 extra_body={"ignore_eos": True})  # fmt: skip
        assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=keyed + "/v1", api_key="no", max_retries=0).models.list()
        argv = ["--url", keyed, "--requests", "8", "--concurrency", "2"]
        assert bench.main(argv + ["--api-key", ""]) == 2
        assert "wants an API key" in capsys.readouterr().err
        assert bench.main(argv + ["--api-key", "k-42"]) == 0, capsys.readouterr()
        assert json.loads(capsys.readouterr().out)["summary"]["ok"]
    finally:
        server.should_exit = True
        thread.join(30)


def test_chaos_soak_keeps_the_server_whole(live, tok, capsys):
    """`serve.py bench --duration --chaos` for a few seconds over the live engine (keyed, a small
    body limit): every valid request completes or is refused with 429/503 in a burst above the
    queue, faults get their 4xx (no 5xx), no slot or queued request is left, /health answers."""
    from dspark_jax.cli import bench

    url, eng, stop = live
    app = create_app(eng, tok, MODEL, stop_ids=stop, manage_engine=False, api_key="k-soak",
                     max_body_bytes=1 << 16)  # fmt: skip
    server, thread, port = serve_in_thread(app)
    try:
        argv = ["--url", f"http://127.0.0.1:{port}", "--api-key", "k-soak", "--duration", "6",
                "--chaos", "0.4", "--concurrency", "4", "--burst", "24",
                "--max-body-bytes", str(1 << 16), "--seed", "3"]  # fmt: skip
        assert bench.main(argv + ["--chaos", "2"]) == 2
        assert "--chaos" in capsys.readouterr().err
        rc = bench.main(argv)
    finally:
        server.should_exit = True
        thread.join(30)
    res = json.loads(capsys.readouterr().out)
    s = res["summary"]
    assert rc == 0 and s["ok"], res
    assert s["valid_sent"] == s["valid_completed"] + s["valid_busy"] and s["valid_completed"] > 0
    assert s["server_5xx"] == 0 and s["leaked_slots"] == 0 and s["leaked_queue"] == 0
    assert s["injected_faults"] > 0 and s["health_after"] == 200
    assert res["sent"]["burst"] > 0 and res["sent"]["oversized"] > 0 and res["sent"]["no_key"] > 0
