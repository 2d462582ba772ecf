"""Prometheus metrics with vLLM's names under our prefix (`prefixserve:` instead of `vllm:`).

One CollectorRegistry per app (no global state). Gauges and counters are read from the engine's
stats snapshot at scrape time; the latency histograms are observed by the routes from each
request's RequestOutput.metrics timestamps (time.monotonic(), the engine's clock).
"""
from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.outputs import RequestOutput

PREFIX = "prefixserve:"

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)

# engine.stats() key -> (kind, help)
_ENGINE_METRICS = {
    "num_requests_running": ("gauge", "Number of requests running on the engine (scheduled this step)."),
    "num_requests_waiting": ("gauge", "Number of requests waiting to be scheduled."),
    "kv_cache_usage_perc": ("gauge", "KV-cache usage: fraction of blocks in use (1 = full)."),
    "prefix_cache_queries": ("counter", "Prefix cache queries, in tokens."),
    "prefix_cache_hits": ("counter", "Prefix cache hits, in tokens."),
    "num_preemptions": ("counter", "Cumulative number of preemptions."),
    "prompt_tokens": ("counter", "Number of prefill tokens processed."),
    "generation_tokens": ("counter", "Number of generation tokens processed."),
    # Host-memory and Redis KV tiers (engine/kv_tiers.py); counts are in blocks unless stated.
    "kv_host_hits": ("counter", "KV blocks loaded from the host-memory tier instead of recomputed."),
    "kv_host_stores": ("counter", "KV blocks demoted from the device pool to the host-memory tier."),
    "kv_host_usage_perc": ("gauge", "Host-memory KV tier usage: fraction of its slots holding blocks."),
    "kv_swapped_out_blocks": ("counter", "KV blocks of preempted sequences swapped out to host memory."),
    "kv_swapped_in_blocks": ("counter", "KV blocks of resumed sequences swapped back in."),
    "kv_redis_hits": ("counter", "KV blocks loaded from Redis instead of recomputed."),
    "kv_redis_writes": ("counter", "KV blocks written to Redis."),
    "kv_redis_dropped_writes": ("counter", "KV block writes to Redis dropped (queue full or Redis failing)."),
    "kv_redis_failures": ("counter", "Failed Redis calls (each degraded to recomputation)."),
    "kv_redis_corrupt_values": ("counter", "Redis values ignored as corrupt, truncated or foreign."),
}


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict | None], model_name: str) -> None:
        self._stats = stats
        self._model_name = model_name

    def collect(self):
        stats = self._stats() or {}
        labels = [self._model_name]
        for key, (kind, doc) in _ENGINE_METRICS.items():
            family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = family_type(PREFIX + key, doc, labels=["model_name"])
            family.add_metric(labels, float(stats.get(key, 0) or 0))
            yield family
        success = CounterMetricFamily(PREFIX + "request_success", "Count of successfully processed requests.",
                                      labels=["model_name", "finished_reason"])
        finished = stats.get("request_success") or {}
        for reason in sorted(set(finished) | {"stop", "length", "abort"}):
            success.add_metric([self._model_name, reason], float(finished.get(reason, 0)))
        yield success

    def describe(self):
        return []


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict | None], model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(stats, model_name))

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], registry=self.registry, buckets=buckets
                             ).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of end-to-end request latency in seconds.",
                             REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Histogram of time spent waiting in the queue in seconds.", REQUEST_BUCKETS)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def tracker(self) -> "RequestTracker":
        return RequestTracker(self)


class RequestTracker:
    """Observes one engine request's latencies as its outputs arrive."""

    __slots__ = ("_metrics", "_last_token_time", "_done")

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._last_token_time: float | None = None
        self._done = False

    def observe(self, output: RequestOutput) -> None:
        if self._done:
            return
        m = output.metrics or {}
        token_time = m.get("last_token_time")
        if token_time is not None:
            if self._last_token_time is not None and token_time > self._last_token_time:
                self._metrics.itl.observe(token_time - self._last_token_time)
            self._last_token_time = token_time
        if not output.finished:
            return
        self._done = True
        arrival = m.get("arrival_time")
        if arrival is None:
            return
        if m.get("first_token_time") is not None:
            self._metrics.ttft.observe(max(m["first_token_time"] - arrival, 0.0))
        if m.get("first_scheduled_time") is not None:
            self._metrics.queue_time.observe(max(m["first_scheduled_time"] - arrival, 0.0))
        self._metrics.e2e.observe(max(time.monotonic() - arrival, 0.0))
