"""Bounded load test of a running dspark-jax HTTP server on this machine (127.0.0.1 only).

    python serve.py bench --url http://127.0.0.1:8000 --requests 1000

(It runs `dspark_jax.cli.bench`; the test suite calls `run_load` with about 100 requests.)

Sends `--requests` requests split over phases of increasing concurrency (closed loop: each of
`c` workers sends its next request when the previous one ends), mixing

* valid requests (completions / chat, streaming / not, greedy / sampled, `ignore_eos` so the
  length is known): each must end with `finish_reason == "length"` and exactly `max_tokens`
  tokens (usage, and for streams the streamed token ids), streams must end with `[DONE]`;
  a 429 (queue full) is retried after a short wait, and counted;
* malformed JSON, wrong-typed or invalid knobs, and over-long prompts: each must get a 4xx;
* streams the client abandons after the first chunk (mid-stream cancellation).

At the end it waits (bounded) for the server to go idle and reads `/metrics`: running slots and
queued requests must be back to 0 (`leaked_slots`, `leaked_queue`), and `/health` must answer.
Prints one JSON object (latency percentiles, throughput per phase, and a `summary` with
`valid_sent`, `valid_completed`, `server_5xx`, `leaked_slots`, `ok`); exits 1 unless `ok`.
"""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlparse

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

KINDS = ("valid", "malformed", "bad_knob", "too_long", "abandon")
MIX = (0.6, 0.1, 0.1, 0.1, 0.1)
LOCAL_HOSTS = ("127.0.0.1", "localhost")


def check_local(url: str) -> str:
    host = urlparse(url).hostname
    if host not in LOCAL_HOSTS:
        raise ValueError(f"the load test only targets this machine: use http://127.0.0.1:PORT, "
                         f"not {url!r}")  # fmt: skip
    return url.rstrip("/")


def _pct(xs) -> dict[str, float] | None:
    if not xs:
        return None
    a = np.asarray(xs)
    return {f"p{q}": round(float(np.percentile(a, q)), 4) for q in (50, 90, 99)} | {
        "mean": round(float(a.mean()), 4)
    }


class _Tally:
    def __init__(self):
        self.counts = dict.fromkeys(KINDS, 0)
        self.valid_completed = 0
        self.wrong = []  # (kind, detail) of failed expectations
        self.server_5xx = 0
        self.retries_429 = 0
        self.latency, self.ttft, self.tokens = [], [], 0

    def fail(self, what: str):
        if len(self.wrong) < 20:
            self.wrong.append(what)


def _valid_body(rng, model: str, i: int):
    chat = bool(rng.integers(2))
    stream = bool(rng.integers(2))
    max_tokens = int(rng.integers(1, 17))
    body = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
            "temperature": float(rng.choice([0.0, 0.8])), "seed": i}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
        body["return_token_ids"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": f"Request {i}: add {i % 97} and 5."}]
    else:
        body["prompt"] = [int(t) for t in rng.integers(4, 200, size=int(rng.integers(1, 24)))]
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def _invalid(kind: str, rng, model: str, max_len: int):
    if kind == "malformed":
        return "/v1/completions", b'{"prompt": "x", "max_tokens": 4'  # truncated JSON
    if kind == "bad_knob":
        bad = [{"temperature": "hot"}, {"top_p": 0.0}, {"max_tokens": 0}, {"n": 3},
               {"top_k": -5}, {"stream": "yes"}, {"seed": -1}, {"min_p": 2.0}]  # fmt: skip
        body = {"model": model, "prompt": "hello"} | bad[int(rng.integers(len(bad)))]
        return "/v1/completions", json.dumps(body).encode()
    body = {"model": model, "prompt": [5] * (max_len + int(rng.integers(0, 8))), "max_tokens": 4}
    return "/v1/completions", json.dumps(body).encode()


async def _post_valid(client, path, body, t: _Tally):
    t0 = time.perf_counter()
    for attempt in range(200):  # bounded retry on a full queue
        if body["stream"]:
            ok = await _stream_valid(client, path, body, t, t0)
        else:
            r = await client.post(path, json=body)
            ok = _check_unary(r, body, t)
        if ok != "retry":
            break
        t.retries_429 += 1
        await asyncio.sleep(min(0.05 * (attempt + 1), 1.0))
    else:
        t.fail(f"{path}: still 429 after 200 retries")
        return
    if ok:
        t.valid_completed += 1
        t.latency.append(time.perf_counter() - t0)
        t.tokens += body["max_tokens"]


def _check_unary(r, body, t: _Tally):
    if r.status_code == 429:
        return "retry"
    if r.status_code >= 500:
        t.server_5xx += 1
    if r.status_code != 200:
        t.fail(f"valid request got {r.status_code}: {r.text[:200]}")
        return False
    d = r.json()
    n, reason = d["usage"]["completion_tokens"], d["choices"][0]["finish_reason"]
    if n != body["max_tokens"] or reason != "length" or "spec_stats" not in d:
        t.fail(f"valid request: {n} tokens / {reason}, wanted {body['max_tokens']} / length")
        return False
    return True


async def _stream_valid(client, path, body, t: _Tally, t0: float):
    n_ids, usage, done, reason, first = 0, None, False, None, None
    async with client.stream("POST", path, json=body) as r:
        if r.status_code == 429:
            await r.aread()
            return "retry"
        if r.status_code != 200:
            t.server_5xx += r.status_code >= 500
            t.fail(f"valid stream got {r.status_code}: {(await r.aread())[:200]!r}")
            return False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            d = json.loads(line[6:])
            if "error" in d:
                t.server_5xx += 1
                t.fail(f"stream error event: {d['error']}")
                return False
            for c in d["choices"]:
                n_ids += len(c.get("token_ids") or ())
                reason = c.get("finish_reason") or reason
                if first is None and c.get("token_ids"):
                    first = time.perf_counter() - t0
            usage = d.get("usage") or usage
    want = body["max_tokens"]
    if (
        not done
        or reason != "length"
        or n_ids != want
        or (usage or {}).get("completion_tokens") != want
    ):
        t.fail(f"valid stream: done={done} reason={reason} ids={n_ids} usage={usage}, want {want}")
        return False
    if first is not None:
        t.ttft.append(first)
    return True


async def _abandon(client, path, body, t: _Tally):
    async with client.stream("POST", path, json=body) as r:
        if r.status_code >= 500:
            t.server_5xx += 1
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break  # leave mid-stream: the connection closes with the context manager


async def _one(client, kind, rng, model, max_len, i, t: _Tally):
    t.counts[kind] += 1
    try:
        if kind == "valid":
            path, body = _valid_body(rng, model, i)
            await _post_valid(client, path, body, t)
        elif kind == "abandon":
            body = {"model": model, "prompt": [7, 8, 9], "max_tokens": 64, "ignore_eos": True,
                    "stream": True}  # fmt: skip
            await _abandon(client, "/v1/completions", body, t)
        else:
            path, raw = _invalid(kind, rng, model, max_len)
            r = await client.post(path, content=raw, headers={"content-type": "application/json"})
            if r.status_code >= 500:
                t.server_5xx += 1
            if not 400 <= r.status_code < 500 or "error" not in r.json():
                t.fail(f"{kind} request got {r.status_code}: {r.text[:200]}")
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        t.fail(f"{kind}: {type(e).__name__}: {e}")


async def _phase(url, c, n, rng, model, max_len, t: _Tally, timeout_s, headers):
    kinds = rng.choice(len(KINDS), size=n, p=MIX)
    queue = list(enumerate(kinds))
    lat0, tok0 = len(t.latency), t.tokens
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits,
                                 headers=headers) as client:  # fmt: skip

        async def worker(w):
            wrng = np.random.default_rng([int(rng.integers(1 << 30)), w])
            while queue:
                i, k = queue.pop()
                await _one(client, KINDS[k], wrng, model, max_len, i, t)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(c)))
        dt = time.perf_counter() - t0
    return {"concurrency": c, "requests": n, "wall_s": round(dt, 3),
            "valid_latency_s": _pct(t.latency[lat0:]),
            "output_tokens_per_s": round((t.tokens - tok0) / dt, 2),
            "requests_per_s": round(n / dt, 2)}  # fmt: skip


def _samples(text: str) -> dict[str, float]:
    """Metric samples summed over labels, except reasons, which stay apart (`name{reason}`)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "le" in s.labels or "position" in s.labels:
                continue
            reason = s.labels.get("finished_reason") or s.labels.get("reason")
            key = f"{s.name}{{{reason}}}" if reason else s.name
            out[key] = out.get(key, 0.0) + s.value
    return out


async def _idle_metrics(url, wait_s: float, headers) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=headers) as client:
        deadline = time.monotonic() + wait_s
        while True:
            m = _samples((await client.get("/metrics")).text)
            idle = not m.get("vllm:num_requests_running") and not m.get("vllm:num_requests_waiting")
            if idle or time.monotonic() > deadline:
                m["health"] = float((await client.get("/health")).status_code)
                return m
            await asyncio.sleep(0.2)


async def run_load(url: str, requests: int = 1000, concurrencies=(1, 4, 16, 32), *,
                   seed: int = 0, timeout_s: float = 120.0, idle_wait_s: float = 30.0,
                   api_key: str = "") -> dict:  # fmt: skip
    """Run the load test against `url` (127.0.0.1 only), sending `api_key` as a bearer token
    when given; returns the result dict."""
    url = check_local(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=headers) as client:
        r = await client.get("/v1/models")
        if r.status_code == 401:
            raise ValueError(f"{url} wants an API key: pass --api-key (or set DSPARK_API_KEY)"
                             if not api_key else f"{url} refused the API key given")  # fmt: skip
        card = r.json()["data"][0]
        before = _samples((await client.get("/metrics")).text)
    model, max_len = card["id"], int(card["max_model_len"])
    rng = np.random.default_rng(seed)
    t = _Tally()
    sizes = np.diff(np.linspace(0, requests, len(concurrencies) + 1).round().astype(int))
    t0 = time.perf_counter()
    phases = [await _phase(url, c, int(n), rng, model, max_len, t, timeout_s, headers)
              for c, n in zip(concurrencies, sizes)]  # fmt: skip
    wall = time.perf_counter() - t0
    m = await _idle_metrics(url, idle_wait_s, headers)
    leaked_slots = int(m.get("vllm:num_requests_running", -1))
    leaked_queue = int(m.get("vllm:num_requests_waiting", -1))
    summary = {
        "valid_sent": t.counts["valid"], "valid_completed": t.valid_completed,
        "server_5xx": t.server_5xx, "leaked_slots": leaked_slots, "leaked_queue": leaked_queue,
        "failures": len(t.wrong), "retries_429": t.retries_429,
        "health_after": int(m["health"]),
        # what the server counted during the run (abandoned streams show up as aborts)
        "server_counted": {k: m.get(k, 0.0) - before.get(k, 0.0) for k in sorted(m)
                           if "{" in k and m.get(k, 0.0) != before.get(k, 0.0)},
    }  # fmt: skip
    summary["ok"] = (summary["valid_sent"] == summary["valid_completed"] and not t.wrong
                     and t.server_5xx == 0 and leaked_slots == 0 and leaked_queue == 0
                     and summary["health_after"] == 200)  # fmt: skip
    return {
        "benchmark": "serving_load", "url": url, "model": model, "requests": int(requests),
        "mix": dict(zip(KINDS, MIX)), "sent": t.counts, "wall_s": round(wall, 3),
        "valid_latency_s": _pct(t.latency), "stream_ttft_s": _pct(t.ttft),
        "output_tokens_per_s": round(t.tokens / wall, 2), "phases": phases,
        "engine": {k: m.get(k, 0.0) - before.get(k, 0.0) for k in ("vllm:spec_decode_num_drafts_total",
                                         "vllm:spec_decode_num_draft_tokens_total",
                                         "dspark:spec_decode_num_verified_tokens_total",
                                         "vllm:spec_decode_num_accepted_tokens_total")},
        "failures": t.wrong, "summary": summary,
    }  # fmt: skip
