"""Prometheus metrics with vLLM's names, types, buckets and `model_name` label, under a namespace:
`prefixserve:` by default, `vllm:` with `--metrics-namespace vllm` (so dashboards and gateways built
for vLLM read them unchanged).

One CollectorRegistry per app (no global state). Gauges, counters and the per-step token histogram
are read from the engine's stats snapshot at scrape time (app/metrics_engine.py); the per-request
histograms are observed here from each request's RequestOutput.metrics timestamps
(time.monotonic(), the engine's clock):

    arrival -> first scheduled -> first token -> last token -> response done
      queue time  |   prefill time  |   decode time  |
                  |----------- inference time -------|
      |-------- TTFT -----------------|
      |--------------------------- e2e latency ---------------------------|
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from app.metrics_engine import EngineCollector
from engine.outputs import RequestOutput

DEFAULT_NAMESPACE = "prefixserve"
_NAMESPACE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)


def metric_prefix(namespace: str) -> str:
    """`namespace:`; a clear ValueError for a name Prometheus would reject."""
    if not _NAMESPACE.fullmatch(namespace or ""):
        raise ValueError(f"metrics namespace must match [a-zA-Z_][a-zA-Z0-9_]*, got {namespace!r}")
    return namespace + ":"


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets, sized by max_model_len)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict | None], model_name: str,
                 namespace: str = DEFAULT_NAMESPACE) -> None:
        self.model_name = model_name
        self.prefix = metric_prefix(namespace)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(stats, model_name, self.prefix))
        self.ttft = self._histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                    TTFT_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                   ITL_BUCKETS)
        # vLLM observes the same per-token gaps under both names; its dashboards read this one.
        self.tpot = self._histogram("time_per_output_token_seconds",
                                    "Histogram of time per output token in seconds.", ITL_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                                   REQUEST_BUCKETS)
        self.queue_time = self._histogram("request_queue_time_seconds",
                                          "Histogram of time spent in WAITING phase for request.", REQUEST_BUCKETS)
        self.inference_time = self._histogram("request_inference_time_seconds",
                                              "Histogram of time spent in RUNNING phase for request.",
                                              REQUEST_BUCKETS)
        self.prefill_time = self._histogram("request_prefill_time_seconds",
                                            "Histogram of time spent in PREFILL phase for request.", REQUEST_BUCKETS)
        self.decode_time = self._histogram("request_decode_time_seconds",
                                           "Histogram of time spent in DECODE phase for request.", REQUEST_BUCKETS)
        self.params_n = self._histogram("request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        # Requests refused before they were queued (--max-queued-requests): <prefix>num_requests_shed_total.
        self.shed = Counter(self.prefix + "num_requests_shed",
                            "Requests refused because --max-queued-requests requests were already waiting.",
                            ["model_name"], registry=self.registry).labels(self.model_name)
        self.prompt_tokens: Histogram | None = None  # token-count histograms: buckets need max_model_len
        self.generation_tokens: Histogram | None = None
        self.max_generation_tokens: Histogram | None = None
        self.params_max_tokens: Histogram | None = None

    def _histogram(self, name: str, doc: str, buckets) -> Histogram:
        return Histogram(self.prefix + name, doc, ["model_name"], registry=self.registry, buckets=buckets
                         ).labels(self.model_name)

    def bind_model(self, max_model_len: int) -> None:
        """The model is loaded: add the token-count histograms, bucketed up to its max_model_len as vLLM's
        are (before this no request can run, so none is missed). Idempotent."""
        if self.prompt_tokens is not None:
            return
        buckets = build_1_2_5_buckets(max_model_len)
        self.prompt_tokens = self._histogram("request_prompt_tokens", "Number of prefill tokens processed.",
                                             buckets)
        self.generation_tokens = self._histogram("request_generation_tokens",
                                                 "Number of generation tokens processed.", buckets)
        self.max_generation_tokens = self._histogram(
            "request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            buckets)
        self.params_max_tokens = self._histogram("request_params_max_tokens",
                                                 "Histogram of the max_tokens request parameter.", buckets)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def tracker(self, n: int = 1, max_tokens: int | None = None) -> "RequestTracker":
        return RequestTracker(self, n, max_tokens)


class RequestTracker:
    """Observes one engine request's latencies and sizes as its outputs arrive. A request that never
    finishes (aborted: client disconnect, shutdown) is observed by no histogram; the engine counts it
    under request_success{finished_reason="abort"}."""

    __slots__ = ("_metrics", "_n", "_max_tokens", "_last_token_time", "_done")

    def __init__(self, metrics: ServerMetrics, n: int, max_tokens: int | None) -> None:
        self._metrics = metrics
        self._n = n
        self._max_tokens = max_tokens
        self._last_token_time: float | None = None
        self._done = False

    def observe(self, output: RequestOutput) -> None:
        if self._done:
            return
        token_time = (output.metrics or {}).get("last_token_time")
        if token_time is not None:
            if self._last_token_time is not None and token_time > self._last_token_time:
                self._metrics.itl.observe(token_time - self._last_token_time)
                self._metrics.tpot.observe(token_time - self._last_token_time)
            self._last_token_time = token_time
        if output.finished:
            self._done = True
            self._observe_finished(output)

    def _observe_finished(self, output: RequestOutput) -> None:
        m, metrics = output.metrics or {}, self._metrics
        metrics.params_n.observe(self._n)
        if metrics.prompt_tokens is not None:
            lengths = [len(c.token_ids) for c in output.outputs] or [0]
            metrics.prompt_tokens.observe(len(output.prompt_token_ids))
            metrics.generation_tokens.observe(sum(lengths))
            metrics.max_generation_tokens.observe(max(lengths))
            if self._max_tokens is not None:
                metrics.params_max_tokens.observe(self._max_tokens)
        arrival = m.get("arrival_time")
        if arrival is None:
            return
        metrics.e2e.observe(max(time.monotonic() - arrival, 0.0))
        for histogram, start, end in (
            (metrics.ttft, "arrival_time", "first_token_time"),
            (metrics.queue_time, "arrival_time", "first_scheduled_time"),
            (metrics.prefill_time, "first_scheduled_time", "first_token_time"),
            (metrics.decode_time, "first_token_time", "last_token_time"),
            (metrics.inference_time, "first_scheduled_time", "last_token_time"),
        ):
            if m.get(start) is not None and m.get(end) is not None:
                histogram.observe(max(m[end] - m[start], 0.0))
