"""Replicas behind the SGLang Model Gateway on shared-prefix traffic (issue 20).

Setups, each started fresh (cold caches), SmolLM2-135M fp32:
    cache_aware   `prefixserve cluster --replicas 2 --threads-per-replica 1 --policy cache_aware`
    round_robin   the same with --policy round_robin
    single        one `prefixserve serve` with both threads (no gateway)
Phases per setup, each on system prompts new to the servers:
    steady   Poisson arrivals at --rate req/s
    burst    every request at once
Per phase: request throughput, TTFT p50/p99 (streamed), the prefix-cache hit rate (cached prompt
tokens over prompt tokens, from each response's usage) against the ideal (each system prompt
computed once), and duplicate prefix computations (requests that computed a system prompt some
earlier request had already computed, on another replica).
Then, on a fresh cache_aware cluster: one replica SIGKILLed mid-run; failed non-streaming requests,
and how streams in flight ended (completed, an error event, or a hang: no end within 60 s).

    PYTHONPATH=. .venv/bin/python benchmarks/replicas.py [--groups 4 --per-group 8 --rate 1.0]

Run it on a quiet machine (it starts several servers on 2 cores). Writes results/<machine>/replicas.json + .png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks._common import bar_plot, results_dir, write_json

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16
MODEL = "smollm2-135m-instruct"


# -- workload -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    group: int
    prompt: str
    prefix_tokens: int  # the system prompt's tokens, whole blocks only (what a cache can hold)


def workload(tokenizer, tag: str, groups: int, per_group: int, prefix_words: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for g in range(groups):
        words = [f"{tag}{g}w{rng.randrange(10_000)}" for _ in range(prefix_words)]
        prefix = f"System prompt {tag}-{g}. Rules: " + " ".join(words) + "\n"
        aligned = len(tokenizer(prefix).input_ids) // BLOCK * BLOCK
        for q in range(per_group):
            requests.append(Request(g, prefix + f"Question {q}: what does rule {q} say?", aligned))
    rng.shuffle(requests)
    return requests


# -- one request ----------------------------------------------------------------------------
@dataclass
class Result:
    group: int
    ok: bool
    ttft: float | None = None
    latency: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefix_tokens: int = 0
    ending: str = ""  # streams: "done", "error_event", "broken", "hang"; non-streaming: the status code


async def stream_one(client: httpx.AsyncClient, base: str, req: Request, max_tokens: int,
                     hang_after: float = 60.0) -> Result:
    body = {"model": MODEL, "prompt": req.prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    res = Result(req.group, False, prefix_tokens=req.prefix_tokens)
    start = time.perf_counter()
    try:
        async with asyncio.timeout(hang_after):
            async with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    res.ending = str(resp.status_code)
                    return res
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        res.ending = res.ending or "done"
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        res.ending = "error_event"
                        continue
                    if chunk.get("choices") and res.ttft is None:
                        res.ttft = time.perf_counter() - start
                    usage = chunk.get("usage")
                    if usage:
                        res.prompt_tokens = usage["prompt_tokens"]
                        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except TimeoutError:
        res.ending = "hang"
        return res
    except httpx.HTTPError:
        res.ending = res.ending or "broken"
        return res
    res.latency = time.perf_counter() - start
    res.ending = res.ending or "broken"  # the stream closed without [DONE]
    res.ok = res.ending == "done" and res.prompt_tokens > 0
    return res


async def complete_one(client: httpx.AsyncClient, base: str, req: Request, max_tokens: int) -> Result:
    res = Result(req.group, False, prefix_tokens=req.prefix_tokens)
    try:
        resp = await client.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": req.prompt,
                                                                 "max_tokens": max_tokens, "temperature": 0},
                                 timeout=120)
        res.ending = str(resp.status_code)
        res.ok = resp.status_code == 200
    except httpx.HTTPError as exc:
        res.ending = type(exc).__name__
    return res


# -- phases ---------------------------------------------------------------------------------
def summarize(results: list[Result], wall: float, groups: int) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = sorted(r.ttft for r in ok if r.ttft is not None)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    prefix_sum = {}
    for r in ok:
        prefix_sum.setdefault(r.group, []).append(r.prefix_tokens)
    ideal = sum(sum(v) - v[0] for v in prefix_sum.values())  # every request but a group's first reads its prefix
    computed = sum(1 for r in ok if r.cached_tokens < r.prefix_tokens)  # computed (part of) its system prompt

    def pct(q):
        return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else None

    return {
        "requests": len(results), "failed": len(results) - len(ok), "wall_s": wall,
        "req_per_s": len(ok) / wall if wall else 0.0, "ttft_p50_s": pct(0.5), "ttft_p99_s": pct(0.99),
        "hit_rate": cached / prompt if prompt else 0.0, "ideal_hit_rate": ideal / prompt if prompt else 0.0,
        "prefix_computations": computed, "duplicate_prefix_computations": max(0, computed - groups),
    }


async def run_phase(base: str, requests: list[Request], rate: float | None, max_tokens: int, groups: int) -> dict:
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=256)) as client:
        rng = random.Random(1)
        tasks = []
        start = time.perf_counter()
        for req in requests:
            tasks.append(asyncio.create_task(stream_one(client, base, req, max_tokens)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return summarize(results, time.perf_counter() - start, groups)


# -- processes ------------------------------------------------------------------------------
def free_base_port(n: int) -> int:
    for base in range(18000, 60000, 50):
        try:
            for p in range(base, base + n + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


def start(setup: str, log: Path) -> tuple[subprocess.Popen, str, list[str]]:
    port = free_base_port(4)
    common = ["--model", MODEL, "--max-num-seqs", "64"]
    if setup == "single":
        cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(port), *common]
        workers = [f"http://127.0.0.1:{port}"]
    else:
        cmd = [sys.executable, "-m", "app.cli", "cluster", "--replicas", "2", "--threads-per-replica", "1",
               "--policy", setup, "--port", str(port), *common]
        workers = [f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    probe = "/health" if setup == "single" else "/readiness"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{setup} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(base + probe, timeout=2).status_code == 200:
                return proc, base, workers
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{setup} did not start")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def worker_pid(url: str) -> int:
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(["ss", "-tlnpH", f"sport = :{port}"], capture_output=True, text=True).stdout
    return int(out.split("pid=")[1].split(",")[0])


async def kill_phase(base: str, victim: str, requests: list[Request], max_tokens: int) -> dict:
    """Streams and plain requests in flight; the victim replica is SIGKILLed two seconds in."""
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=256)) as client:
        streams = [asyncio.create_task(stream_one(client, base, r, max_tokens * 4)) for r in requests[::2]]
        plain = [asyncio.create_task(complete_one(client, base, r, max_tokens)) for r in requests[1::2]]
        await asyncio.sleep(2.0)
        os.kill(worker_pid(victim), signal.SIGKILL)
        stream_results = await asyncio.gather(*streams)
        plain_results = await asyncio.gather(*plain)
    endings: dict[str, int] = {}
    for r in stream_results:
        endings[r.ending] = endings.get(r.ending, 0) + 1
    return {"non_streaming": len(plain_results), "non_streaming_failed": sum(not r.ok for r in plain_results),
            "non_streaming_statuses": sorted({r.ending for r in plain_results}),
            "streams": len(stream_results), "stream_endings": endings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--prefix-words", type=int, default=160, help="~4 tokens each")
    parser.add_argument("--rate", type=float, default=1.0, help="steady phase: Poisson arrivals per second")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--setups", nargs="+", default=["cache_aware", "round_robin", "single"])
    parser.add_argument("--no-kill", action="store_true")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from engine.models.resolve import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(MODEL)))
    logs = results_dir() / "replicas_logs"
    logs.mkdir(parents=True, exist_ok=True)
    out: dict = {"config": vars(args), "setups": {}}
    for setup in args.setups:
        proc, base, _ = start(setup, logs / f"{setup}.log")
        try:
            out["setups"][setup] = {}
            for phase, rate in (("steady", args.rate), ("burst", None)):
                reqs = workload(tokenizer, f"{setup[:2]}{phase[:1]}", args.groups, args.per_group, args.prefix_words,
                                seed=zlib.crc32(f"{setup}/{phase}".encode()))
                out["setups"][setup][phase] = res = asyncio.run(run_phase(base, reqs, rate, args.max_tokens,
                                                                          args.groups))
                print(f"{setup:12s} {phase:6s} {json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()})}",
                      flush=True)
        finally:
            stop(proc)
    if not args.no_kill:
        proc, base, workers = start("cache_aware", logs / "kill.log")
        try:
            reqs = workload(tokenizer, "kill", args.groups, args.per_group, args.prefix_words, seed=7)
            out["kill"] = asyncio.run(kill_phase(base, workers[0], reqs, args.max_tokens))
            print("kill", json.dumps(out["kill"]), flush=True)
        finally:
            stop(proc)

    write_json("replicas", out)
    setups = list(out["setups"])
    bar_plot("replicas", "Shared-prefix traffic through the gateway (burst)", setups, {
        "hit rate x100": [100 * out["setups"][s]["burst"]["hit_rate"] for s in setups],
        "ideal x100": [100 * out["setups"][s]["burst"]["ideal_hit_rate"] for s in setups],
        "req/s x10": [10 * out["setups"][s]["burst"]["req_per_s"] for s in setups],
        "dup prefixes": [out["setups"][s]["burst"]["duplicate_prefix_computations"] for s in setups],
    }, "value")
    line = " | ".join(
        f"{s}: burst {out['setups'][s]['burst']['req_per_s']:.2f} req/s, hit {out['setups'][s]['burst']['hit_rate']:.2f}"
        f"/{out['setups'][s]['burst']['ideal_hit_rate']:.2f}, dup {out['setups'][s]['burst']['duplicate_prefix_computations']}"
        for s in setups)
    if "kill" in out:
        k = out["kill"]
        line += f" | kill: {k['non_streaming_failed']}/{k['non_streaming']} plain failed, streams {k['stream_endings']}"
    print("replicas:", line)


if __name__ == "__main__":
    main()
