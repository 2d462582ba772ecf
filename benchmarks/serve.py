"""HTTP serving benchmark: Poisson arrivals against `prefixserve serve` over loopback.

Starts its own server process on 127.0.0.1 (a free port), waits for /health, runs two workloads
at each request rate, stops the server (SIGTERM), and writes JSON + PNG under benchmarks/results/.

* shared-prefix: G groups x Q questions; every group has its own S-token system prompt, so all but
  the first question of a group should hit the prefix cache. Requests arrive as a Poisson process.
* multi-turn chat: C conversations of T turns; each turn re-sends the whole history (system prompt,
  earlier questions and the model's answers). Conversations start as a Poisson process; a
  conversation's next turn is sent as soon as its previous answer is complete.

Per workload and rate: request throughput, output tokens/s, TTFT / TPOT / ITL p50 and p99, and the
prefix-cache hit rate (usage.prompt_tokens_details.cached_tokens over prompt tokens; the server's
prefix_cache_hits/queries counters too). Every request streams (stream_options.include_usage) and
produces exactly --output-len tokens (ignore_eos). Bounded: a fixed number of requests per run and
a wall-clock limit per run.

    python benchmarks/serve.py [--rates 0.25 0.5 1] [--groups 2 --questions 3 --system-tokens 128]
                               [--conversations 2 --turns 3] [--output-len 12]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import save_figure, write_json  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WORDS = ("river mountain library engine garden signal window orbit harbor lantern meadow circuit canyon "
         "archive compass beacon glacier market thread puzzle").split()
TOPICS = ("tea", "volcanoes", "bridges", "jazz", "bees", "comets", "maps", "glass", "salt", "owls", "trains", "kites")


# -- the server ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args, port: int, log_path: Path, extra_args: list[str] = (), threads: int | None = None
                 ) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "app.cli", "--log-level", "WARNING", "serve", "--model", args.model,
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench",
           "--max-num-seqs", str(args.max_num_seqs), "--drain-timeout", "5", *extra_args]
    if args.num_kv_blocks:
        cmd += ["--num-kv-blocks", str(args.num_kv_blocks)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if threads is not None:  # several servers on one machine: split the cores between them
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise TimeoutError("the server did not become healthy")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


COUNTERS = ("prefix_cache_queries_total", "prefix_cache_hits_total", "generation_tokens_total")


def scrape_counters(base: str, names: tuple[str, ...] = COUNTERS) -> dict[str, float]:
    """The named counters of a server's /metrics, whatever their namespace (prefixserve:, vllm:), each summed
    over its label sets."""
    import httpx

    values: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0].split(":")[-1]
        if name in names and not line.startswith("#"):
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


# -- workloads -----------------------------------------------------------------------------
def filler(rng: random.Random, approx_tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(approx_tokens))  # ~1 token per common word


def shared_prefix_requests(args, rng: random.Random) -> list[list[dict]]:
    """G x Q single-turn conversations (each a list of one message list), shuffled."""
    convs = []
    for g in range(args.groups):
        system = f"You are assistant #{g} of the catalogue team. Reference notes: " + filler(rng, args.system_tokens)
        for q in range(args.questions):
            topic = TOPICS[(g * args.questions + q) % len(TOPICS)]
            convs.append([[{"role": "system", "content": system},
                           {"role": "user", "content": f"In two sentences, what should I know about {topic}?"}]])
    rng.shuffle(convs)
    return convs


def multi_turn_conversations(args, rng: random.Random) -> list[list[str]]:
    """C conversations, each a list of T user questions (the history is built while running)."""
    return [[f"Question {t + 1}: tell me something about {rng.choice(TOPICS)} and {rng.choice(TOPICS)}."
             for t in range(args.turns)] for _ in range(args.conversations)]


async def stream_chat(client, base: str, messages: list[dict], args) -> dict:
    body = {"model": "bench", "messages": messages, "max_tokens": args.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    token_times: list[float] = []
    text, usage, error = "", None, None
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return {"error": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
                continue
            if event.get("usage"):
                usage = event["usage"]
            for choice in event["choices"]:
                piece = choice["delta"].get("content")
                if piece:
                    token_times.append(time.perf_counter())
                    text += piece
    end = time.perf_counter()
    if error or usage is None or not token_times:
        return {"error": error or "no usage / no tokens"}
    ttft = token_times[0] - start
    n = usage["completion_tokens"]
    return {
        "ttft": ttft, "e2e": end - start, "tpot": (end - start - ttft) / max(n - 1, 1),
        "itl": [b - a for a, b in zip(token_times, token_times[1:])], "text": text,
        "prompt_tokens": usage["prompt_tokens"], "completion_tokens": n,
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
    }


async def run_workload(kind: str, base: str, rate: float, args, seed: int) -> dict:
    import httpx

    rng = random.Random(seed)
    results: list[dict] = []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:

        async def single(messages):
            results.append(await stream_chat(client, base, messages, args))

        async def conversation(questions):
            history = [{"role": "system", "content": "You are a friendly assistant. Keep answers short."}]
            for question in questions:
                history.append({"role": "user", "content": question})
                result = await stream_chat(client, base, list(history), args)
                results.append(result)
                if "error" in result:
                    return
                history.append({"role": "assistant", "content": result["text"]})

        if kind == "shared_prefix":
            jobs = [single(c[0]) for c in shared_prefix_requests(args, rng)]
        else:
            jobs = [conversation(qs) for qs in multi_turn_conversations(args, rng)]
        before = scrape_counters(base)
        start = time.perf_counter()
        tasks = []
        for job in jobs:  # Poisson arrivals
            tasks.append(asyncio.ensure_future(job))
            await asyncio.sleep(rng.expovariate(rate))
        done, pending = await asyncio.wait(tasks, timeout=args.run_timeout)
        for task in pending:
            task.cancel()
        elapsed = time.perf_counter() - start
        after = scrape_counters(base)
    return summarize(results, elapsed, len(pending), before, after)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarize(results: list[dict], elapsed: float, timed_out: int, before: dict, after: dict) -> dict:
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    e2e = [r["e2e"] for r in ok]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    queries = after.get("prefix_cache_queries_total", 0) - before.get("prefix_cache_queries_total", 0)
    hits = after.get("prefix_cache_hits_total", 0) - before.get("prefix_cache_hits_total", 0)
    output = sum(r["completion_tokens"] for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "timed_out": timed_out,
        "errors": sorted({r["error"] for r in results if "error" in r})[:5],
        "seconds": elapsed,
        "request_throughput": len(ok) / elapsed, "output_tokens_per_s": output / elapsed,
        "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
        "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
        "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
        "e2e_p50": pct(e2e, 50), "e2e_mean": statistics.fmean(e2e) if e2e else None,
        "prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": output,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "server_prefix_cache_hit_rate": hits / queries if queries else 0.0,
    }


# -- output --------------------------------------------------------------------------------
def line_plot(name: str, rates: list[float], results: dict[str, list[dict]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = (("TTFT (s)", "ttft"), ("TPOT (ms)", "tpot"), ("ITL (ms)", "itl"))
    for ax, (label, key) in zip(axes, panels):
        scale = 1000.0 if key != "ttft" else 1.0
        for workload, runs in results.items():
            for q, style in (("p50", "-o"), ("p99", "--x")):
                ys = [r[f"{key}_{q}"] * scale if r[f"{key}_{q}"] is not None else float("nan") for r in runs]
                ax.plot(rates, ys, style, label=f"{workload} {q}")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.set_title(f"{label} vs rate")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    return save_figure(fig, name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=128)
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=12)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--num-kv-blocks", type=int, default=1024)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--run-timeout", type=float, default=60.0, help="wall-clock cap per (workload, rate)")
    ap.add_argument("--name", default="serve")
    args = ap.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.gettempdir()) / f"prefixserve-bench-{port}.log"
    proc = start_server(args, port, log_path)
    results: dict[str, list[dict]] = {"shared_prefix": [], "multi_turn": []}
    try:
        wait_healthy(base, proc, 180.0)
        asyncio.run(_warm_up(base, args))
        for i, rate in enumerate(args.rates):
            for kind in results:
                # Distinct seeds per rate: each run brings new system prompts (no cross-run cache hits).
                run = asyncio.run(run_workload(kind, base, rate, args, seed=1000 * i + len(kind)))
                run["rate"] = rate
                results[kind].append(run)
                print(f"  {kind:13s} @ {rate:4.1f} req/s: {run['completed']:3d} ok {run['failed']} failed, "
                      f"{run['request_throughput']:.2f} req/s, {run['output_tokens_per_s']:6.1f} tok/s, "
                      f"TTFT p50/p99 {_ms(run['ttft_p50'])}/{_ms(run['ttft_p99'])}, "
                      f"TPOT p50 {_ms(run['tpot_p50'])}, ITL p50/p99 {_ms(run['itl_p50'])}/{_ms(run['itl_p99'])}, "
                      f"cache hit {run['cache_hit_rate']:.0%}", flush=True)
    finally:
        stop_server(proc)
    workload = {k: v for k, v in vars(args).items() if k not in ("name",)}
    write_json(args.name, {"workload": workload, "results": results})
    line_plot(args.name, args.rates, results)
    top = args.rates[-1]
    sp, mt = results["shared_prefix"][-1], results["multi_turn"][-1]
    print(f"serve @ {top:g} req/s: shared-prefix {sp['request_throughput']:.2f} req/s {sp['output_tokens_per_s']:.0f} "
          f"tok/s TTFT p50 {_ms(sp['ttft_p50'])} p99 {_ms(sp['ttft_p99'])} TPOT p50 {_ms(sp['tpot_p50'])} "
          f"cache hit {sp['cache_hit_rate']:.0%}; multi-turn {mt['request_throughput']:.2f} req/s "
          f"TTFT p50 {_ms(mt['ttft_p50'])} p99 {_ms(mt['ttft_p99'])} TPOT p50 {_ms(mt['tpot_p50'])} "
          f"cache hit {mt['cache_hit_rate']:.0%}")
    failed = sum(r["failed"] + r["timed_out"] for runs in results.values() for r in runs)
    return 1 if failed else 0


async def _warm_up(base: str, args) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=120) as client:
        await stream_chat(client, base, [{"role": "user", "content": "warm up"}], args)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f}ms"


if __name__ == "__main__":
    sys.exit(main())
