"""A soak (issue 39): agent-session traffic at saturation against one served process for a long run, with
retention, suffix speculation and a Redis tier, checking that it holds.

Traffic is benchmarks/agent_sessions.py's: SESSIONS agents at a time (a finished session is replaced by a
new one with its own prompt_cache_key), each turn 48-64 tokens, a 1-5 s tool pause and a 200-400-token
tool result, beside one-off 1-2k-token RAG requests at a steady rate; the KV pool holds about a third of
what the sessions alive at once need. Halfway through, Redis is shut down and, 15 s later, started again.

Checked at the end (the JSON says each, with the memory curve):
  * no 5xx and no broken stream, over the whole run (the Redis outage included);
  * no leaked block: POST /v1/cache/check (the engine's check_integrity, on the engine's thread) passes
    with no request in flight, and no block is in use once retention has expired;
  * retained blocks come back to what live sessions hold: 0 once every session has ended and its
    retention (--prompt-cache-ttl, 30 s here) has passed;
  * RSS flat after warm-up: max / min of the samples after the first sixth of the run within 5%.

    python benchmarks/soak.py [--minutes 30] [--sessions 24] [--rag-rate 0.5] [--dtype bfloat16]

An overload variant: four times the RAG rate and clients that give up after 60 s without a byte. A queue
whose wait reaches the clients' timeout serves mostly requests whose clients leave during their prefill;
--max-queued-requests sized to what the server finishes within that timeout sheds the rest at once instead:

    python benchmarks/soak.py --minutes 6 --rag-rate 2 --client-timeout 60 --name soak_overload
    python benchmarks/soak.py --minutes 6 --rag-rate 2 --client-timeout 60 --name soak_overload_shed \
        --server-args '--max-queued-requests 24'
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import save_figure, write_json  # noqa: E402
from benchmarks.agent_sessions import (NAME, OUT_TOKENS, PAUSE_S, RAG_OUT, RAG_TOKENS, TOOL_TOKENS,  # noqa: E402
                                       USER_TOKENS, _cut, _words, kv_bytes_per_token)
from benchmarks.serve_vs_vllm import free_port, serving  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RETENTION_TTL_S = 30
SPECULATIVE = {"method": "suffix", "num_speculative_tokens": 4}
SAMPLE_EVERY_S = 10.0


class Tally:
    """What the clients saw: requests by outcome."""

    def __init__(self) -> None:
        self.counts = {"ok": 0, "4xx": 0, "5xx": 0, "broken_stream": 0}
        self.agent_turns = 0
        self.sessions_done = 0
        self.failures: list[dict] = []  # what each non-ok outcome was (the first 20), for the JSON

    def add(self, outcome: str, detail: str = "") -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        if outcome != "ok" and len(self.failures) < 20:
            self.failures.append({"outcome": outcome, "detail": detail[:500], "t": time.monotonic()})


async def request(client, url: str, prompt: str, max_tokens: int, key: str | None, tally: Tally) -> str:
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    if key is not None:
        body["prompt_cache_key"] = key
    text = []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:  # the client's timeout
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                tally.add("5xx" if r.status_code >= 500 else "4xx", f"{r.status_code} {body}")
                return ""
            done = False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        tally.add("broken_stream", json.dumps(chunk["error"]))
                        return ""
                    text += [c.get("text", "") for c in chunk.get("choices") or ()]
            tally.add("ok" if done else "broken_stream", "" if done else "the stream ended without [DONE]")
    except Exception as exc:  # a dropped connection is a broken stream to a client
        tally.add("broken_stream", repr(exc))
    return "".join(text)


async def agent_slot(client, url: str, system: str, words: list[str], rng: random.Random, until: float,
                     tally: Tally) -> None:
    """One slot of live sessions: sessions run back to back until the clock ends, each with a new key."""

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    await asyncio.sleep(rng.uniform(0, 5))
    while time.monotonic() < until:
        key, context = f"soak-{uuid.uuid4().hex[:12]}", system
        for _ in range(rng.randint(3, 6)):
            if time.monotonic() >= until:
                break
            context += f"\nUser: {text(rng.randint(*USER_TOKENS))}\nAssistant:"
            context += await request(client, url, context, rng.randint(*OUT_TOKENS), key, tally)
            tally.agent_turns += 1
            await asyncio.sleep(rng.uniform(*PAUSE_S))
            context += f"\nTool result: {text(rng.randint(*TOOL_TOKENS))}"
        tally.sessions_done += 1


async def rag_stream(client, url: str, words: list[str], rng: random.Random, rate: float, until: float,
                     tally: Tally) -> None:
    pending = set()
    while time.monotonic() < until:
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(*RAG_TOKENS) * 3 // 4))
        task = asyncio.ensure_future(request(client, url, prompt, RAG_OUT, None, tally))
        pending.add(task)
        task.add_done_callback(pending.discard)
        await asyncio.sleep(1.0 / rate)
    if pending:
        await asyncio.gather(*pending)


async def sampler(client, url: str, pid: int, t0: float, until: float, samples: list) -> None:
    import psutil

    proc = psutil.Process(pid)
    while time.monotonic() < until + 60:
        metrics = await _metrics(client, url)
        samples.append({"t_s": round(time.monotonic() - t0, 1), "rss_mib": round(proc.memory_info().rss / 2**20, 1),
                        **metrics})
        await asyncio.sleep(SAMPLE_EVERY_S)


async def _metrics(client, url: str) -> dict:
    wanted = ("kv_retained_blocks", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    out = {}
    with contextlib.suppress(Exception):
        body = (await client.get(f"{url}/metrics", timeout=10)).text
        for line in body.splitlines():
            for name in wanted:
                if line.startswith(f"prefixserve:{name}{{"):
                    out[name] = float(line.rsplit(" ", 1)[1])
    return out


class OwnRedis:
    """A redis-server of the soak's own on a free port, stopped and started again for the outage. Bounded as a
    cache is run (2 GB, least recently used evicted): two soaks writing an hour-long TTL into the shared
    server at 6379 grew it to 16.7 GB until the kernel's OOM killer stopped it."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> "OwnRedis":
        self.proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                                      "--appendonly", "no", "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True,
                             text=True).stdout.strip() != "PONG":
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


async def redis_outage(redis: OwnRedis, at: float, down_s: float, events: list) -> None:
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    redis.stop()
    events.append({"redis": "down", "t": time.monotonic()})
    await asyncio.sleep(down_s)
    redis.start()
    events.append({"redis": "up", "t": time.monotonic()})


async def drive(url: str, pid: int, args, system: str, words: list[str], redis: OwnRedis) -> dict:
    import httpx

    tally, samples, events = Tally(), [], []
    t0 = time.monotonic()
    until = t0 + args.minutes * 60
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(limits=limits, timeout=args.client_timeout) as client:
        watch = asyncio.ensure_future(sampler(client, url, pid, t0, until, samples))
        outage = asyncio.ensure_future(redis_outage(redis, t0 + args.minutes * 30, 15.0, events))
        await asyncio.gather(*(agent_slot(client, url, system, words, random.Random(i), until, tally)
                               for i in range(args.sessions)),
                             rag_stream(client, url, words, random.Random(-1), args.rag_rate, until, tally))
        await outage
        drained = time.monotonic()
        await asyncio.sleep(RETENTION_TTL_S + 5)  # every retention has expired by now
        check = (await client.post(f"{url}/v1/cache/check", timeout=60)).json()
        final = await _metrics(client, url)
        watch.cancel()
    failures = [{**f, "t": round(f["t"] - t0, 1)} for f in tally.failures]
    return {"tally": tally.counts, "failures": failures, "agent_turns": tally.agent_turns, "sessions": tally.sessions_done,
            "drained_after_s": round(drained - t0, 1), "integrity": check, "final_metrics": final,
            "samples": samples, "redis_events": [{**e, "t": round(e["t"] - t0, 1)} for e in events]}


def verdict(result: dict, minutes: float) -> dict:
    tally, check = result["tally"], result["integrity"]
    warm = [s["rss_mib"] for s in result["samples"] if s["t_s"] >= minutes * 60 / 6 and s["t_s"] <= minutes * 60]
    drift = (max(warm) / min(warm) - 1) if warm else None
    return {
        "no_5xx": tally.get("5xx", 0) == 0 and tally.get("broken_stream", 0) == 0,
        "integrity_ok": bool(check.get("ok")),
        "no_block_in_use": check.get("blocks_in_use") == 0,
        "retained_back_to_zero": check.get("retained_blocks") == 0,
        "rss_drift_after_warmup": None if drift is None else round(drift, 4),
        "rss_flat_within_5pct": drift is not None and drift <= 0.05,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--rag-rate", type=float, default=0.5)
    ap.add_argument("--client-timeout", type=float, default=900.0,
                    help="seconds a client waits for the next bytes before it gives up (an overload run: short)")
    ap.add_argument("--server-args", default="", help="more flags for prefixserve serve, e.g. "
                    "'--max-queued-requests 40' (shed what would wait past the clients' timeout)")
    ap.add_argument("--name", default="soak")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from engine.models.resolve import resolve_model

    folder = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    words = _words(tokenizer)
    rng = random.Random(0)
    system = _cut(tokenizer, "You are an agent. Tools: " + " ".join(rng.choice(words) for _ in range(1600)), 1500)
    # a third of what the live sessions hold at their longest (~1,500 shared + 5 turns of ~400 each)
    kv_bytes = int((1500 + args.sessions * 2000) / 3) * kv_bytes_per_token(folder, args.dtype)
    redis = OwnRedis().start()
    port = free_port()
    cmd = [sys.executable, "-m", "app.cli", "serve", "--model", folder, "--served-model-name", NAME,
           "--dtype", args.dtype, "--port", str(port), "--host", "127.0.0.1", "--max-model-len", "4096",
           "--kv-cache-memory", str(kv_bytes), "--prompt-cache-ttl", str(RETENTION_TTL_S),
           "--kv-redis-url", f"redis://127.0.0.1:{redis.port}/0", "--kv-redis-key-prefix", f"soak-{uuid.uuid4().hex[:8]}",
           "--kv-redis-ttl", "3600", "--speculative-config", json.dumps(SPECULATIVE), *shlex.split(args.server_args)]
    log = Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
    try:
        with serving(cmd, dict(os.environ), port, log, "prefixserve") as (url, _, proc):
            result = asyncio.run(drive(url, proc.pid, args, system, words, redis))
    finally:
        redis.stop()
    result["verdict"] = v = verdict(result, args.minutes)
    server_errors = sum(1 for line in log.read_text().splitlines() if " ERROR " in line or "Traceback" in line)
    result["server_log_errors"] = server_errors
    write_json(args.name, {"minutes": args.minutes, "sessions": args.sessions, "rag_rate": args.rag_rate,
                           "client_timeout_s": args.client_timeout, "server_args": args.server_args, "dtype": args.dtype, "kv_bytes": kv_bytes, "speculative_config": SPECULATIVE,
                           "prompt_cache_ttl": RETENTION_TTL_S, **result})
    _plot(args.name, result)
    print(f"soak {args.minutes:.0f} min: {result['tally']}, {result['agent_turns']} agent turns in "
          f"{result['sessions']} sessions; verdict {v}; server log errors {server_errors}")


def _plot(name: str, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    t = [s["t_s"] / 60 for s in result["samples"]]
    ax.plot(t, [s["rss_mib"] for s in result["samples"]], label="server RSS (MiB)")
    ax2 = ax.twinx()
    ax2.plot(t, [s.get("kv_retained_blocks", 0) for s in result["samples"]], color="tab:orange", label="retained blocks")
    for e in result["redis_events"]:
        ax.axvline(e["t"] / 60, color="grey", linestyle=":")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS MiB")
    ax2.set_ylabel("retained blocks")
    ax.set_title("soak: memory and retention (dotted: Redis down / up)")
    save_figure(fig, name)


if __name__ == "__main__":
    main()
