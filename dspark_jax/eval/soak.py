"""Soak and chaos test of a running dspark-jax HTTP server (127.0.0.1 only).

    python serve.py bench --url http://127.0.0.1:8000 --duration 600 --chaos 0.3

For `duration_s` seconds `concurrency` workers send requests in a closed loop. Each request is
valid (completions / chat, streaming or not; it must end with exactly `max_tokens` tokens, as in
`load_test`) or, with probability `chaos`, an injected fault drawn from `FAULTS`:

* `disconnect`: a stream the client drops after its first chunk;
* `cancel`: a non-streaming request the client gives up on (a 50 ms read timeout);
* `malformed`, `bad_knob`, `too_long`: an invalid body (must get a 4xx);
* `oversized`: a body one byte over `max_body_bytes` (must get a 413);
* `wrong_key`, `no_key`: a bad or missing bearer token (401; only when an API key is given);
* `burst`: `burst` valid requests at once, above the queue: each completes or gets a 429/503
  with `Retry-After` (counted in `valid_busy`, never as completed).

At the end it waits for the server to go idle and reads `/metrics`: `leaked_slots` (requests
still holding a slot), `leaked_queue` and the server's RSS growth
(`process_resident_memory_bytes`, so it works for a server on another port or process alike);
`/health` must answer 200. The `summary` holds `valid_sent`, `valid_completed`, `valid_busy`,
`injected_faults`, `server_5xx`, `leaked_slots`, `rss_growth_mb` and `ok`.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np

from dspark_jax.eval.load_test import (
    _abandon,
    _idle_metrics,
    _invalid,
    _pct,
    _post_valid,
    _samples,
    _Tally,
    _valid_body,
    check_local,
)

FAULTS = ("disconnect", "cancel", "malformed", "bad_knob", "too_long", "oversized",
          "wrong_key", "no_key", "burst")  # fmt: skip
RSS = "process_resident_memory_bytes"


class _Soak(_Tally):
    def __init__(self):
        super().__init__()
        self.counts = dict.fromkeys(("valid",) + FAULTS, 0)
        self.valid_busy = 0  # burst requests refused with 429/503 + Retry-After


async def _expect_4xx(client, path, raw, want, t: _Soak, kind, headers=None):
    hdrs = {"content-type": "application/json"} | (headers or {})
    r = await client.post(path, content=raw, headers=hdrs)
    t.server_5xx += r.status_code >= 500
    if not (r.status_code == want if want else 400 <= r.status_code < 500):
        t.fail(f"{kind} got {r.status_code}: {r.text[:200]}")


async def _burst(client, rng, model, n, t: _Soak):
    async def one(i):
        path, body = _valid_body(rng, model, i)
        body["stream"] = False
        body.pop("stream_options", None)
        t.counts["valid"] += 1
        r = await client.post(path, json=body)
        if r.status_code in (429, 503):
            t.valid_busy += 1
            if "retry-after" not in r.headers:
                t.fail(f"burst {r.status_code} without Retry-After")
            return
        t.server_5xx += r.status_code >= 500
        if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != body["max_tokens"]:
            t.fail(f"burst request got {r.status_code}: {r.text[:200]}")
            return
        t.valid_completed += 1

    await asyncio.gather(*(one(int(rng.integers(1 << 20))) for _ in range(n)))


async def _fault(client, kind, rng, model, ctx, t: _Soak):
    body = {"model": model, "prompt": [7, 8, 9], "max_tokens": 64, "ignore_eos": True}
    if kind == "disconnect":
        await _abandon(client, "/v1/completions", body | {"stream": True}, t)
    elif kind == "cancel":
        try:
            await client.post("/v1/completions", json=body, timeout=0.05)
        except httpx.TimeoutException:
            pass
    elif kind in ("malformed", "bad_knob", "too_long"):
        path, raw = _invalid(kind, rng, model, ctx["max_len"])
        await _expect_4xx(client, path, raw, None, t, kind)
    elif kind == "oversized":
        raw = b'{"prompt": "' + b"x" * ctx["max_body_bytes"] + b'"}'
        try:
            await _expect_4xx(client, "/v1/completions", raw, 413, t, kind)
        except (httpx.WriteError, httpx.RemoteProtocolError):
            pass  # the server closed the connection after its 413, before the body was sent
    elif kind in ("wrong_key", "no_key"):
        auth = {"Authorization": "Bearer wrong"} if kind == "wrong_key" else {}
        r = await client.get("/v1/models", headers=auth or {"Authorization": ""})
        t.server_5xx += r.status_code >= 500
        if r.status_code != 401:
            t.fail(f"{kind} got {r.status_code}")
    else:
        await _burst(client, rng, model, ctx["burst"], t)


async def _worker(client, w, seed, deadline, chaos, faults, model, ctx, t: _Soak):
    rng = np.random.default_rng([seed, w])
    i = 0
    while time.monotonic() < deadline:
        i += 1
        try:
            if rng.random() < chaos:
                kind = faults[int(rng.integers(len(faults)))]
                t.counts[kind] += 1
                await _fault(client, kind, rng, model, ctx, t)
            else:
                t.counts["valid"] += 1
                path, body = _valid_body(rng, model, w * 1_000_000 + i)
                await _post_valid(client, path, body, t)
        except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
            t.fail(f"{type(e).__name__}: {e}")


async def run_soak(url: str, duration_s: float, concurrency: int = 8, chaos: float = 0.3, *,
                   seed: int = 0, timeout_s: float = 120.0, api_key: str = "",
                   max_body_bytes: int = 4 << 20, burst: int = 64,
                   max_rss_growth_mb: float = 256.0) -> dict:  # fmt: skip
    """Soak `url` for `duration_s` seconds (chaos = share of requests that are faults)."""
    url = check_local(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    faults = tuple(f for f in FAULTS if api_key or f not in ("wrong_key", "no_key"))
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=headers) as client:
        r = await client.get("/v1/models")
        if r.status_code == 401:
            raise ValueError(f"{url} wants an API key: pass --api-key (or set DSPARK_API_KEY)"
                             if not api_key else f"{url} refused the API key given")  # fmt: skip
        card = r.json()["data"][0]
        before = _samples((await client.get("/metrics")).text)
    model = card["id"]
    ctx = {"max_len": int(card["max_model_len"]), "max_body_bytes": max_body_bytes,
           "burst": burst}  # fmt: skip
    t = _Soak()
    limits = httpx.Limits(max_connections=concurrency + burst + 4, max_keepalive_connections=16)
    t0 = time.perf_counter()
    deadline = time.monotonic() + duration_s
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits,
                                 headers=headers) as client:  # fmt: skip
        await asyncio.gather(*(_worker(client, w, seed, deadline, chaos, faults, model, ctx, t)
                               for w in range(concurrency)))  # fmt: skip
    wall = time.perf_counter() - t0
    m = await _idle_metrics(url, 60.0, headers)
    s = {
        "valid_sent": t.counts["valid"], "valid_completed": t.valid_completed,
        "valid_busy": t.valid_busy, "retries_429": t.retries_429,
        "injected_faults": sum(t.counts[f] for f in FAULTS),
        "server_5xx": t.server_5xx, "failures": len(t.wrong),
        "leaked_slots": int(m.get("vllm:num_requests_running", -1)),
        "leaked_queue": int(m.get("vllm:num_requests_waiting", -1)),
        "rss_growth_mb": round((m.get(RSS, 0.0) - before.get(RSS, 0.0)) / 2**20, 1),
        "rss_mb_end": round(m.get(RSS, 0.0) / 2**20, 1),
        "health_after": int(m["health"]),
    }  # fmt: skip
    s["ok"] = (s["valid_completed"] + s["valid_busy"] == s["valid_sent"] and not t.wrong
               and s["server_5xx"] <= s["injected_faults"] and s["leaked_slots"] == 0
               and s["leaked_queue"] == 0 and RSS in m
               and s["rss_growth_mb"] <= max_rss_growth_mb and s["health_after"] == 200)  # fmt: skip
    return {
        "benchmark": "serving_soak", "url": url, "model": model, "duration_s": duration_s,
        "concurrency": concurrency, "chaos": chaos, "seed": seed, "wall_s": round(wall, 1),
        "sent": t.counts, "requests_per_s": round(sum(t.counts.values()) / wall, 2),
        "valid_latency_s": _pct(t.latency), "stream_ttft_s": _pct(t.ttft),
        "output_tokens_per_s": round(t.tokens / wall, 2), "failures": t.wrong, "summary": s,
    }  # fmt: skip
