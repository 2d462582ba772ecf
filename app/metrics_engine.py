"""The engine's gauges, counters and per-step token histogram, read from its stats snapshot at scrape
time (engine.stats(): a dict the engine loop refreshes every step)."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

# engine.stats() key -> (kind, help); the names are vLLM's where vLLM has the metric.
ENGINE_METRICS = {
    "num_requests_running": ("gauge", "Number of requests in model execution batches."),
    "num_requests_waiting": ("gauge", "Number of requests waiting to be processed."),
    "kv_cache_usage_perc": ("gauge", "KV-cache usage. 1 means 100 percent usage."),
    "prefix_cache_queries": ("counter", "Prefix cache queries, in terms of number of queried tokens."),
    "prefix_cache_hits": ("counter", "Prefix cache hits, in terms of number of cached tokens."),
    "num_preemptions": ("counter", "Cumulative number of preemption from the engine."),
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
    "kv_redis_retained_extended": ("counter", "Redis entries of long-retained KV blocks whose expiry was extended."),
    "kv_redis_retained_writes": ("counter", "Long-retained KV blocks written to Redis because it lacked them."),
    "kv_redis_retained_lost": ("counter", "Long-retained KV blocks not kept in Redis (Redis failing, queue full, "
                                          "or absent there and gone from the device)."),
    # Retention (engine/retention.py): contexts kept past their request (prompt_cache_key, cache_control).
    "kv_retained_blocks": ("gauge", "KV blocks retained (evicted only after every other evictable block)."),
    "kv_retention_expired": ("counter", "Block retentions that ran out (TTL) or lapsed (the retention cap)."),
    "kv_retained_evicted": ("counter", "Retained KV blocks evicted all the same (no other block was left)."),
    "grammar_fast_forward_tokens": ("counter", "Output tokens a structured output's grammar forced (not sampled)."),
    # Speculative decoding (engine/speculative/): zero while it is off.
    "spec_decode_num_drafts": ("counter", "Number of spec decoding drafts."),
    "spec_decode_num_draft_tokens": ("counter", "Number of draft tokens."),
    "spec_decode_num_accepted_tokens": ("counter", "Number of accepted tokens."),
}
# vLLM's finish reasons: always present, so rate() over them works from the first scrape.
FINISH_REASONS = ("stop", "length", "abort")


class EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict | None], model_name: str, prefix: str) -> None:
        self._stats = stats
        self._model_name = model_name
        self._prefix = prefix

    def collect(self):
        stats = self._stats() or {}
        labels = [self._model_name]
        for key, (kind, doc) in ENGINE_METRICS.items():
            family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = family_type(self._prefix + key, doc, labels=["model_name"])
            family.add_metric(labels, float(stats.get(key, 0) or 0))
            yield family
        success = CounterMetricFamily(self._prefix + "request_success", "Count of successfully processed requests.",
                                      labels=["model_name", "finished_reason"])
        finished = stats.get("request_success") or {}
        for reason in sorted(set(finished) | set(FINISH_REASONS)):
            success.add_metric([self._model_name, reason], float(finished.get(reason, 0)))
        yield success
        iteration = stats.get("iteration_tokens")
        if iteration is not None:  # absent until the engine is loaded
            family = HistogramMetricFamily(self._prefix + "iteration_tokens_total",
                                           "Histogram of number of tokens per engine_step.", labels=["model_name"])
            buckets = [(_bound(b), float(n)) for b, n in iteration.buckets] + [("+Inf", float(iteration.count))]
            family.add_metric(labels, buckets, float(iteration.sum))
            yield family
        per_pos = stats.get("spec_decode_num_accepted_tokens_per_pos")
        if per_pos is not None:  # present when speculative decoding is on
            family = CounterMetricFamily(self._prefix + "spec_decode_num_accepted_tokens_per_pos",
                                         "Accepted tokens per draft position.", labels=["model_name", "position"])
            for position, n in enumerate(per_pos):
                family.add_metric([self._model_name, str(position)], float(n))
            yield family

    def describe(self):
        return []


def _bound(value: float) -> str:
    return str(float(value))  # Prometheus' le label spelling: "8.0" as prometheus_client writes it
