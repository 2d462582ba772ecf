"""KV tiers: where a long prefix's KV comes from, and what sharing it through Redis buys replicas.

Part 1 -- time to first token of a request with a P-token prefix (default 2,048) plus a short
question, on SmolLM2, when the prefix is
  * cold: computed (an engine without tiers; and the same with host + Redis tiers on, which adds
    the write-through of every new block);
  * in the host tier: computed earlier, then evicted from the device pool into host memory;
  * only in Redis: computed earlier (written through to Redis), then evicted from the device pool,
    no host tier.
Each is the median of --trials requests with fresh prefixes; the first generated token must agree.

Part 2 -- two replicas (`prefixserve serve` processes) behind round-robin on the shared-prefix
workload (G groups x Q questions, each group with its own system prompt of S tokens; Poisson
arrivals), once sharing one Redis and once without: prefix-cache hit rate
(usage.prompt_tokens_details.cached_tokens / prompt tokens), request throughput and TTFT.

The benchmark starts its own redis-server on a free port (or uses --redis-url) and its own
servers; prints one summary line; JSON + PNG under benchmarks/results/.

    python benchmarks/tiers.py [--prefix-len 2048 --trials 3] [--groups 4 --questions 4 --system-tokens 512
                                --rate 1.0 --output-len 16]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import save_figure, write_json  # noqa: E402
from benchmarks.serve import (  # noqa: E402
    free_port, pct, scrape_counters, shared_prefix_requests, start_server, stop_server, stream_chat, wait_healthy,
)

REPO = Path(__file__).resolve().parent.parent


# -- Redis -----------------------------------------------------------------------------------
class OwnRedis:
    """A private redis-server for the run (no persistence), or an existing URL."""

    def __init__(self, url: str | None) -> None:
        self.proc = None
        if url is None:
            port = free_port()
            self.proc = subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            url = f"redis://127.0.0.1:{port}/0"
        self.url = url
        import redis

        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(url, socket_timeout=1).ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def delete_prefix(self, prefix: str) -> None:
        import redis

        client = redis.Redis.from_url(self.url)
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


# -- part 1: TTFT by tier ----------------------------------------------------------------------
def first_token(engine, prompt: list[int]) -> tuple[float, int, int]:
    """(seconds from submission until the step that produced the first token returned, cached
    prompt tokens, the token)."""
    from engine import SamplingParams

    request_id = f"ttft-{uuid.uuid4().hex[:8]}"
    start = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1))
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.outputs[0].token_ids:
                elapsed = time.perf_counter() - start
                while engine.has_unfinished():
                    engine.step()
                return elapsed, out.num_cached_tokens, out.outputs[0].token_ids[0]


def evict_device(engine) -> None:
    """Empty the device prefix cache (demoting to the host tier when there is one): evict every
    evictable block, then one step with no requests runs the demotion copies."""
    engine.blocks.evict(engine.blocks.num_blocks)
    engine.step()


def ttft_by_tier(args, redis_url: str, key_prefix: str) -> dict:
    from engine import LLM

    rng = random.Random(0)
    vocab = 49152
    block_tokens = 16
    blocks = (args.prefix_len + args.question_len) // block_tokens + 8
    host_memory = 2 * blocks * block_bytes(args.model)

    def prompt_pair() -> tuple[list[int], list[int]]:
        prefix = [rng.randrange(100, vocab) for _ in range(args.prefix_len)]
        return ([*prefix, *(rng.randrange(100, vocab) for _ in range(args.question_len))],
                [*prefix, *(rng.randrange(100, vocab) for _ in range(args.question_len))])

    pairs = [prompt_pair() for _ in range(args.trials)]
    warm_up = [rng.randrange(100, vocab) for _ in range(64)]  # shares no block with the prompts
    common = dict(model=args.model, num_kv_blocks=blocks, max_num_batched_tokens=args.max_num_batched_tokens)
    results: dict[str, list] = {"cold": [], "cold_tiers_on": [], "host": [], "redis": []}
    tokens: dict[str, list] = {k: [] for k in results}

    def record(name, measured):
        seconds, cached, token = measured
        results[name].append({"seconds": seconds, "cached_tokens": cached})
        tokens[name].append(token)

    llm = LLM(**common)
    first_token(llm.engine, warm_up)
    for first, _ in pairs:
        record("cold", first_token(llm.engine, first))
    del llm

    llm = LLM(**common, host_kv_cache_memory=host_memory)
    first_token(llm.engine, warm_up)
    for first, second in pairs:
        first_token(llm.engine, first)
        evict_device(llm.engine)
        record("host", first_token(llm.engine, second))
        evict_device(llm.engine)
    host_stats = llm.engine.stats()
    del llm

    llm = LLM(**common, kv_redis_url=redis_url, kv_redis_key_prefix=key_prefix)
    first_token(llm.engine, warm_up)
    for first, second in pairs:
        record("cold_tiers_on", first_token(llm.engine, first))
        llm.engine.flush_kv_writes(30)
        evict_device(llm.engine)
        record("redis", first_token(llm.engine, second))
        evict_device(llm.engine)
    redis_stats = llm.engine.stats()
    llm.engine.close()
    del llm

    # the same prompts must give the same first token whichever tier the prefix came from
    agree = tokens["host"] == tokens["redis"] and tokens["cold"] == tokens["cold_tiers_on"]
    summary = {name: statistics.median(r["seconds"] for r in runs) for name, runs in results.items()}
    return {
        "runs": results, "median_s": summary, "first_tokens_agree": agree,
        "speedup_host_vs_cold": summary["cold"] / summary["host"],
        "speedup_redis_vs_cold": summary["cold"] / summary["redis"],
        "write_through_overhead": summary["cold_tiers_on"] / summary["cold"],
        "host_hits": host_stats["kv_host_hits"], "redis_hits": redis_stats["kv_redis_hits"],
        "load_policy": {"host": "auto", "redis": "auto"},
    }


def block_bytes(model: str) -> int:
    from engine.models.config import load_model_config
    from engine.models.resolve import resolve_model

    cfg = load_model_config(resolve_model(model))
    return 16 * cfg.kv_bytes_per_token * 4  # fp32


# -- part 2: two replicas behind round-robin ---------------------------------------------------------
def start_replica(args, port: int, log_path: Path, redis_url: str | None, key_prefix: str) -> subprocess.Popen:
    extra = [] if redis_url is None else ["--kv-redis-url", redis_url, "--kv-redis-key-prefix", key_prefix]
    return start_server(args, port, log_path, extra, threads=args.threads_per_replica)


TIER_COUNTERS = ("kv_redis_hits_total", "kv_redis_writes_total", "kv_redis_failures_total",
                 "prefix_cache_hits_total", "prefix_cache_queries_total")


def scrape(base: str) -> dict[str, float]:
    return scrape_counters(base, TIER_COUNTERS)


async def round_robin(bases: list[str], args, seed: int) -> dict:
    import httpx

    rng = random.Random(seed)
    convs = shared_prefix_requests(args, rng)
    results: list[dict] = []
    async with httpx.AsyncClient(timeout=args.request_timeout,
                                 limits=httpx.Limits(max_connections=256, max_keepalive_connections=256)) as client:

        async def single(base, messages):
            results.append(await stream_chat(client, base, messages, args))

        start = time.perf_counter()
        tasks = []
        for i, conv in enumerate(convs):  # Poisson arrivals, request i goes to replica i mod N
            tasks.append(asyncio.ensure_future(single(bases[i % len(bases)], conv[0])))
            await asyncio.sleep(rng.expovariate(args.rate))
        done, pending = await asyncio.wait(tasks, timeout=args.run_timeout)
        for task in pending:
            task.cancel()
        elapsed = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok]
    return {
        "completed": len(ok), "failed": len(results) - len(ok) + len(pending), "seconds": elapsed,
        "request_throughput": len(ok) / elapsed,
        "output_tokens_per_s": sum(r["completion_tokens"] for r in ok) / elapsed,
        "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
        "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0,
    }


def replicas(args, redis: OwnRedis, with_redis: bool) -> dict:
    key_prefix = f"bench{uuid.uuid4().hex[:8]}"
    ports = [free_port() for _ in range(args.replicas)]
    bases = [f"http://127.0.0.1:{p}" for p in ports]
    logs = [Path(tempfile.gettempdir()) / f"prefixserve-tiers-{p}.log" for p in ports]
    procs = [start_replica(args, p, log, redis.url if with_redis else None, key_prefix)
             for p, log in zip(ports, logs)]
    try:
        for base, proc in zip(bases, procs):
            wait_healthy(base, proc, 300.0)

        async def warm_up():
            import httpx

            async with httpx.AsyncClient(timeout=120) as client:
                for base in bases:
                    await stream_chat(client, base, [{"role": "user", "content": "warm up"}], args)

        asyncio.run(warm_up())
        before = [scrape(b) for b in bases]
        run = asyncio.run(round_robin(bases, args, seed=7))
        after = [scrape(b) for b in bases]
    finally:
        for proc in procs:
            stop_server(proc)
        redis.delete_prefix(key_prefix)
    for key in ("kv_redis_hits_total", "kv_redis_writes_total", "kv_redis_failures_total"):
        run[key.removesuffix("_total")] = sum(a.get(key, 0) - b.get(key, 0) for a, b in zip(after, before))
    return run


# -- output --------------------------------------------------------------------------------------
def plot(name: str, ttft: dict, multi: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    labels = ["cold", "cold (tiers on)", "host tier", "Redis only"]
    values = [ttft["median_s"][k] * 1000 for k in ("cold", "cold_tiers_on", "host", "redis")]
    bars = ax1.bar(labels, values, color=["#888", "#aaa", "#4c72b0", "#dd8452"])
    ax1.bar_label(bars, fmt="%.0f", fontsize=8)
    ax1.set_ylabel("time to first token (ms)")
    ax1.set_title(f"TTFT, {ttft['prefix_len']}-token prefix (median of {ttft['trials']})")
    groups = ["hit rate (%)", "requests/s x100", "TTFT p50 (s) x10"]
    width = 0.38
    for i, (label, run) in enumerate((("2 replicas, no Redis", multi["no_redis"]),
                                      ("2 replicas + Redis", multi["redis"]))):
        vals = [run["hit_rate"] * 100, run["request_throughput"] * 100, (run["ttft_p50"] or 0) * 10]
        bars = ax2.bar([g + i * width for g in range(len(groups))], vals, width, label=label)
        ax2.bar_label(bars, fmt="%.1f", fontsize=8)
    ax2.set_xticks([g + width / 2 for g in range(len(groups))], groups)
    ax2.set_title("Round-robin over 2 replicas, shared-prefix workload")
    ax2.legend(fontsize=8)
    return save_figure(fig, name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--redis-url", default=None, help="use this Redis instead of starting a private redis-server")
    # part 1
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=16)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    # part 2
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--rate", type=float, default=1.0, help="request arrivals per second (Poisson)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=1024)
    ap.add_argument("--threads-per-replica", type=int, default=1)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--run-timeout", type=float, default=600.0)
    ap.add_argument("--skip-replicas", action="store_true")
    ap.add_argument("--name", default="tiers")
    args = ap.parse_args()

    redis = OwnRedis(args.redis_url)
    try:
        key_prefix = f"bench{uuid.uuid4().hex[:8]}"
        try:
            ttft = ttft_by_tier(args, redis.url, key_prefix)
        finally:
            redis.delete_prefix(key_prefix)
        ttft.update(prefix_len=args.prefix_len, trials=args.trials)
        m = ttft["median_s"]
        print(f"  TTFT ({args.prefix_len}-token prefix): cold {m['cold'] * 1000:.0f} ms, cold with tiers on "
              f"{m['cold_tiers_on'] * 1000:.0f} ms, host tier {m['host'] * 1000:.0f} ms, Redis only "
              f"{m['redis'] * 1000:.0f} ms; first tokens agree: {ttft['first_tokens_agree']}", flush=True)
        multi = {}
        if not args.skip_replicas:
            for label, with_redis in (("no_redis", False), ("redis", True)):
                multi[label] = replicas(args, redis, with_redis)
                r = multi[label]
                print(f"  {args.replicas} replicas {label:8s}: {r['completed']} ok {r['failed']} failed, hit rate "
                      f"{r['hit_rate']:.1%}, {r['request_throughput']:.2f} req/s, {r['output_tokens_per_s']:.1f} tok/s, "
                      f"TTFT p50 {r['ttft_p50'] or 0:.2f} s, Redis hits {r.get('kv_redis_hits', 0):.0f} blocks",
                      flush=True)
    finally:
        redis.stop()

    g, q, s = args.groups, args.questions, args.system_tokens
    ratios = {"ttft_cold_vs_host": ttft["speedup_host_vs_cold"], "ttft_cold_vs_redis": ttft["speedup_redis_vs_cold"]}
    if multi:
        ratios["replica_hit_rate_redis_vs_none"] = multi["redis"]["hit_rate"] / max(multi["no_redis"]["hit_rate"], 1e-9)
        ratios["replica_throughput_redis_vs_none"] = (multi["redis"]["request_throughput"]
                                                      / multi["no_redis"]["request_throughput"])
    workload = {k: v for k, v in vars(args).items() if k != "name"}
    write_json(args.name, {"workload": workload, "ttft_by_tier": ttft, "replicas": multi, "ratios": ratios})
    if multi:
        plot(args.name, ttft, multi)
    line = (f"tiers: TTFT of a {args.prefix_len}-token prefix cold {m['cold'] * 1000:.0f} ms -> host tier "
            f"{m['host'] * 1000:.0f} ms ({ratios['ttft_cold_vs_host']:.1f}x), Redis only {m['redis'] * 1000:.0f} ms "
            f"({ratios['ttft_cold_vs_redis']:.1f}x)")
    if multi:
        line += (f"; {args.replicas} replicas round-robin (G={g} Q={q} S={s}): hit rate "
                 f"{multi['redis']['hit_rate']:.1%} with Redis vs {multi['no_redis']['hit_rate']:.1%} without, "
                 f"throughput {ratios['replica_throughput_redis_vs_none']:.2f}x")
    print(line)
    failed = sum(r["failed"] for r in multi.values()) if multi else 0
    return 1 if failed or not ttft["first_tokens_agree"] else 0


if __name__ == "__main__":
    sys.exit(main())
