"""Worker load in the shape the SGLang Model Gateway polls (`GET /v1/loads`, SGLang's own endpoint):
the gateway's load-aware policies (power_of_two, least_load, cache_aware's balancing, overload
protection) read these numbers. Without them it falls back to vLLM's gauges in /metrics, which
carry no capacity (max_total_num_tokens 0), so /v1/loads is the richer source.

Observed with smg 1.13.0 against a worker: it asks `/loads?model=...`, then
`/v1/loads?include=core,disagg,queues,memory`, then `/metrics`, and shows what it parsed under
`engine_load` in its `GET /workers`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import msgspec

from engine.frontend import ModelInfo


class Load(msgspec.Struct):
    """One data-parallel rank's load (we have one rank), with SGLang's field names."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_total_reqs: int
    num_used_tokens: int  # KV tokens held by running requests
    max_total_num_tokens: int  # the KV pool's capacity in tokens
    token_usage: float  # num_used_tokens / max_total_num_tokens
    gen_throughput: float  # generated tokens/s since the previous report
    cache_hit_rate: float  # prefix-cache hits / queried prompt tokens, since start
    utilization: float  # running requests / max_running_requests
    max_running_requests: int  # --max-num-seqs
    dp_rank: int = 0


class LoadsResponse(msgspec.Struct):
    timestamp: str
    version: str
    dp_rank_count: int
    loads: list[Load]


class ServerInfo(msgspec.Struct):
    """GET /server_info: SGLang's names for the serving facts a gateway reads at registration."""

    model_path: str
    served_model_name: str
    served_model_names: list[str]
    architecture: str
    dtype: str
    device: str
    context_length: int
    max_model_len: int
    page_size: int  # KV block size in tokens
    max_total_num_tokens: int
    max_running_requests: int
    version: str
    tp_size: int = 1
    dp_size: int = 1


@dataclass(eq=False)
class LoadReporter:
    """Builds one load report from the engine's stats snapshot. Generation throughput is the rate of
    generated tokens since the previous report (the gateway polls every --load-monitor-interval s)."""

    _last: tuple[float, float] | None = field(default=None, init=False)  # (monotonic time, generation tokens)

    def report(self, stats: dict, info: ModelInfo, in_flight: int, version: str) -> LoadsResponse:
        running = int(stats.get("num_requests_running", 0))
        waiting = max(int(stats.get("num_requests_waiting", 0)), in_flight - running)
        usage = float(stats.get("kv_cache_usage_perc", 0.0))
        capacity = info.kv_cache_tokens
        queries = float(stats.get("prefix_cache_queries", 0))
        load = Load(
            num_running_reqs=running, num_waiting_reqs=waiting, num_total_reqs=running + waiting,
            num_used_tokens=round(usage * capacity), max_total_num_tokens=capacity, token_usage=usage,
            gen_throughput=self._throughput(float(stats.get("generation_tokens", 0))),
            cache_hit_rate=float(stats.get("prefix_cache_hits", 0)) / queries if queries else 0.0,
            utilization=running / info.max_num_seqs if info.max_num_seqs else 0.0,
            max_running_requests=info.max_num_seqs,
        )
        return LoadsResponse(datetime.now(timezone.utc).isoformat(), version, 1, [load])

    def _throughput(self, generated: float) -> float:
        now = time.monotonic()
        last, self._last = self._last, (now, generated)
        if last is None or now <= last[0]:
            return 0.0
        return max(generated - last[1], 0.0) / (now - last[0])
