"""Prometheus metrics of the HTTP server (prometheus-client, one registry per app).

Names follow vLLM's where vLLM has the metric (`vllm:` prefix, so existing vLLM dashboards work);
the ones vLLM lacks use a `dspark:` prefix. Two sources:

* observed by the server per request: TTFT, inter-token latency, end-to-end latency, prompt and
  generation tokens, finished requests by reason, rejected requests by reason;
* read from `engine.metrics()` at scrape time (a custom collector, so the exported counters are
  exactly the engine's, never a second bookkeeping): queue length, running slots, drafted /
  verified / accepted tokens, accepted tokens per draft position, verified tokens per round,
  requests ended with an error by cause;
* the server process (prometheus-client's `ProcessCollector`: `process_resident_memory_bytes`,
  CPU seconds, open files), which the soak test reads for RSS growth.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                30.0, 40.0, 50.0, 60.0, 120.0)  # fmt: skip


class ServerMetrics:
    """The server's metrics; `render()` is the /metrics body."""

    def __init__(self, engine_snapshot: Callable[[], Mapping[str, Any]], model_name: str):
        self.registry = CollectorRegistry()
        r, lbl = self.registry, {"model_name": model_name}
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time from request arrival to the first token.",
            ["model_name"], buckets=_LATENCY_BUCKETS, registry=r,
        ).labels(**lbl)  # fmt: skip
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between output tokens (a round that emits k tokens counts k gaps of dt/k).",
            ["model_name"], buckets=_LATENCY_BUCKETS, registry=r,
        ).labels(**lbl)  # fmt: skip
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Request latency from arrival to the last token.",
            ["model_name"], buckets=_E2E_BUCKETS, registry=r,
        ).labels(**lbl)  # fmt: skip
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of admitted requests.", ["model_name"], registry=r
        ).labels(**lbl)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated for requests.", ["model_name"], registry=r
        ).labels(**lbl)
        self._success = Counter(
            "vllm:request_success",
            "Requests that finished, by reason: stop (stop token or string), length, "
            "abort (client disconnected), error.",
            ["model_name", "finished_reason"], registry=r,
        )  # fmt: skip
        self._rejected = Counter(
            "dspark:request_rejected",
            "Requests refused before any work, by reason: invalid (4xx body/knob/length), "
            "queue_full (429), unavailable (503, shutting down).",
            ["model_name", "reason"], registry=r,
        )  # fmt: skip
        self._model = model_name
        for reason in ("stop", "length", "abort", "error"):
            self._success.labels(model_name, reason)
        for reason in ("invalid", "queue_full", "unavailable"):
            self._rejected.labels(model_name, reason)
        r.register(_EngineCollector(engine_snapshot, model_name))
        # process_resident_memory_bytes & co. (Linux /proc): the soak test's RSS growth
        ProcessCollector(registry=r)

    def finished(self, reason: str) -> None:
        self._success.labels(self._model, reason).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self._model, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Exports `engine.metrics()` at scrape time (see `ServingEngine.metrics`)."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Any]], model_name: str):
        self._snapshot = snapshot
        self._model = model_name

    def describe(self):
        return []  # collected lazily; no names reserved at registration

    def collect(self):
        m = self._snapshot()
        lbl = [self._model]

        def gauge(name, doc, key):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(lbl, float(m.get(key, 0)))
            return g

        def counter(name, doc, key):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(lbl, float(m.get(key, 0)))
            return c

        yield gauge("vllm:num_requests_running", "Requests holding a slot.", "running")
        yield gauge("vllm:num_requests_waiting", "Requests queued for a slot.", "queue_len")
        yield gauge("dspark:num_slots", "Slots of the engine (static).", "num_slots")
        gamma = max(len(m.get("accepted_per_position") or ()), 1)
        drafts = CounterMetricFamily(
            "vllm:spec_decode_num_drafts", "Draft blocks proposed (one per request per round).",
            labels=["model_name"],
        )  # fmt: skip
        drafts.add_metric(lbl, float(m.get("draft_tokens", 0)) / gamma)
        yield drafts
        yield counter("dspark:engine_rounds", "Engine rounds (one packed verify each).", "rounds")
        yield counter(
            "vllm:spec_decode_num_draft_tokens", "Tokens proposed by the drafter.", "draft_tokens"
        )
        yield counter(
            "dspark:spec_decode_num_verified_tokens",
            "Draft tokens the scheduler sent to the target for verification.", "verified_tokens",
        )  # fmt: skip
        yield counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", "accepted_tokens"
        )
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by draft position (0 = first draft).",
            labels=["model_name", "position"],
        )
        for i, n in enumerate(m.get("accepted_per_position", ()) or ()):
            per_pos.add_metric([self._model, str(i)], float(n))
        yield per_pos
        errors = CounterMetricFamily(
            "dspark:request_errors",
            "Requests that ended with finish_reason error, by cause (engine.faults): nonfinite "
            "(NaN/Inf logits), oom, device (a failed device call), detokenize, internal.",
            labels=["model_name", "cause"],
        )  # fmt: skip
        for cause, n in sorted((m.get("requests_errored_by_cause") or {}).items()):
            errors.add_metric([self._model, cause], float(n))
        yield errors
        yield from _per_round_histogram(m.get("verified_per_round"), self._model)


def _per_round_histogram(vpr, model: str):
    """`verified_per_round[k]` = engine rounds that verified k draft tokens over all slots,
    exported as a cumulative histogram with one bucket per k."""
    if vpr is None:
        return
    counts = list(vpr.values()) if isinstance(vpr, Mapping) else list(vpr)
    keys = list(vpr.keys()) if isinstance(vpr, Mapping) else list(range(len(counts)))
    order = sorted(range(len(keys)), key=lambda i: int(keys[i]))
    buckets, acc, total = [], 0.0, 0.0
    for i in order:
        acc += float(counts[i])
        total += float(counts[i]) * int(keys[i])
        buckets.append((str(float(int(keys[i]))), acc))
    buckets.append(("+Inf", acc))
    h = HistogramMetricFamily(
        "dspark:spec_decode_verified_tokens_per_round",
        "Draft tokens verified per engine step, all slots together (the scheduler's choice).",
        labels=["model_name"],
    )
    h.add_metric([model], buckets, sum_value=total)
    yield h
