"""A fixed-bucket histogram the engine thread fills once per step (tokens per iteration).

Per-step observations happen inside the engine loop, which /metrics cannot see; the loop keeps
the cumulative counts here and `Engine.stats()` hands out a snapshot, so the server renders the
histogram without reaching into the engine.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# vLLM's buckets for vllm:iteration_tokens_total (tokens scheduled in one engine step).
ITERATION_TOKEN_BUCKETS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class HistogramSnapshot:
    """Prometheus-shaped: `buckets` pairs each upper bound with the cumulative count of values <= it
    (the +Inf bucket is `count`)."""

    buckets: tuple[tuple[float, int], ...]
    count: int
    sum: float


@dataclass(eq=False)
class StepHistogram:
    bounds: tuple[int, ...] = ITERATION_TOKEN_BUCKETS
    _counts: list[int] = field(init=False)  # per bucket, not cumulative; the last one is +Inf
    _count: int = field(init=False, default=0)
    _sum: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(set(self.bounds)) or not self.bounds:
            raise ValueError(f"histogram bounds must be strictly increasing, got {self.bounds!r}")
        self._counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self._count += 1
        self._sum += value

    def snapshot(self) -> HistogramSnapshot:
        cumulative, total = [], 0
        for bound, n in zip(self.bounds, self._counts):
            total += n
            cumulative.append((float(bound), total))
        return HistogramSnapshot(tuple(cumulative), self._count, self._sum)
