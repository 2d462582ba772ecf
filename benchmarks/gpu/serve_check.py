"""The serve step: `prefixserve serve` on the device (bfloat16, the SmolLM2-shaped random model with its
real tokenizer and chat template), then a few OpenAI requests over loopback with httpx: health, models,
a chat completion, a streamed chat completion, a completion with n=2. Each answer's status, shape and
time go into the result; the server is stopped at the end (or killed with the step at its limit)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16,
        "temperature": 0}


def serve_step(ctx, result: dict) -> dict:
    import httpx

    from benchmarks.gpu.parity import model_folder

    folder = model_folder(ctx, "llama" if ctx.dry_run else "smollm2-shape")
    port = _free_port()
    cmd = [sys.executable, "-m", "app.cli", "serve", "--model", str(folder), "--served-model-name", "check",
           "--host", "127.0.0.1", "--port", str(port), "--device", ctx.device, "--dtype", "bfloat16",
           "--num-kv-blocks", "1024", "--max-model-len", "1024"]
    print(" ".join(cmd), flush=True)
    t0 = time.perf_counter()
    server = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    checks = result["checks"] = {}
    try:
        with httpx.Client(base_url=base, timeout=60) as client:
            result["startup_s"] = round(_wait_healthy(client, server, limit_s=60), 1)
            checks["models"] = _call(client, "GET", "/v1/models", lambda r: r.json()["data"][0]["id"] == "check")
            checks["chat"] = _call(client, "POST", "/v1/chat/completions",
                                   lambda r: r.json()["choices"][0]["message"]["content"] is not None,
                                   json={"model": "check", **CHAT})
            checks["chat_stream"] = _stream(client, {"model": "check", **CHAT, "stream": True})
            checks["completion_n2"] = _call(client, "POST", "/v1/completions",
                                            lambda r: len(r.json()["choices"]) == 2,
                                            json={"model": "check", "prompt": "The capital of France is",
                                                  "max_tokens": 8, "n": 2, "temperature": 0.8, "seed": 1})
            checks["bad_request"] = _call(client, "POST", "/v1/chat/completions",
                                          lambda r: r.status_code == 400 and "error" in r.json(), expect=400,
                                          json={"model": "check", **CHAT, "top_p": 0})
            checks["metrics"] = _call(client, "GET", "/metrics", lambda r: "prefixserve:" in r.text)
    finally:
        _stop(server)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["ok"] = bool(checks) and all(c["ok"] for c in checks.values()) and len(checks) == 6
    return ctx.save(result)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(client, server, limit_s: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before it was healthy")
        try:
            if client.get("/health").status_code == 200:
                return time.perf_counter() - t0
        except Exception:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server was not healthy within {limit_s} s")


def _call(client, method: str, path: str, check, expect: int = 200, **kwargs) -> dict:
    t0 = time.perf_counter()
    r = client.request(method, path, **kwargs)
    entry = {"status": r.status_code, "seconds": round(time.perf_counter() - t0, 3), "body": r.text[:300]}
    try:
        entry["ok"] = r.status_code == expect and bool(check(r))
    except Exception as exc:
        entry.update(ok=False, error=repr(exc))
    print(f"{method} {path}: {entry}", flush=True)
    return entry


def _stream(client, body: dict) -> dict:
    t0 = time.perf_counter()
    chunks, first, done, text = 0, None, False, ""
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            first = first or time.perf_counter() - t0
            delta = json.loads(line[6:])["choices"][0]["delta"] if json.loads(line[6:])["choices"] else {}
            text += delta.get("content") or ""
            chunks += 1
        status = r.status_code
    entry = {"status": status, "chunks": chunks, "done": done, "first_chunk_s": first and round(first, 3),
             "seconds": round(time.perf_counter() - t0, 3), "text": text[:200],
             "ok": status == 200 and done and chunks > 1}
    print(f"POST /v1/chat/completions (stream): {entry}", flush=True)
    return entry


def _stop(server) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
