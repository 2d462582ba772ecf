"""KV events from a real `prefixserve serve --kv-events-config ...` process, read by a ZMQ subscriber
with vLLM 0.32's schema; POST /reset_prefix_cache (vLLM's endpoint) publishes AllBlocksCleared, and
is refused with 409 while requests hold blocks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import httpx
import pytest
from server_testlib import free_port, wait_until

from fixtures.kv_events_subscriber import AllBlocksCleared, BlockStored, Subscriber

pytest.importorskip("zmq")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_served_engine_publishes_kv_events_and_resets(tiny_path, tmp_path):
    port, pub = free_port(), free_port()
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}"})
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--model", str(tiny_path), "--port", str(port),
         "--served-model-name", "tiny", "--num-kv-blocks", "128", "--max-model-len", "512",
         "--kv-events-config", config],
        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    sub = Subscriber(f"tcp://127.0.0.1:{pub}")
    try:
        def healthy() -> bool:
            try:
                return httpx.get(f"{base}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        assert wait_until(healthy, 90, 0.2), (tmp_path / "serve.log").read_text()[-3000:]
        # The SUB socket joins asynchronously: resets (each publishes a batch) until one arrives.
        assert wait_until(lambda: httpx.post(f"{base}/reset_prefix_cache", timeout=5).status_code == 200
                          and sub.receive(200) is not None, 20, 0.1)
        sub.drain(200)

        prompt = "A system prompt long enough for a few blocks. " * 8
        resp = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
                          timeout=60)
        assert resp.status_code == 200
        prompt_tokens = resp.json()["usage"]["prompt_tokens"]
        events = [e for _, b in sub.drain() for e in b.events]
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert stored and stored[0].parent_block_hash is None and stored[0].medium == "GPU"
        assert sum(len(e.block_hashes) for e in stored) == prompt_tokens // 16

        # Busy: refused with the OpenAI error shape; idle again: cleared.
        done = threading.Event()

        def long_request() -> None:
            httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "busy", "max_tokens": 480,
                                                       "ignore_eos": True}, timeout=120)
            done.set()

        thread = threading.Thread(target=long_request)
        thread.start()
        statuses = []
        wait_until(lambda: statuses.append(httpx.post(f"{base}/reset_prefix_cache", timeout=5)) or
                   statuses[-1].status_code == 409 or done.is_set(), 20, 0.01)
        thread.join(120)
        conflict = [r for r in statuses if r.status_code == 409]
        assert conflict and conflict[0].json()["error"]["code"] == "requests_running"
        sub.drain(200)
        assert httpx.post(f"{base}/reset_prefix_cache", timeout=5).status_code == 200
        assert [type(e) for _, b in sub.drain() for e in b.events] == [AllBlocksCleared]
    finally:
        sub.close()
        proc.terminate()
        proc.wait(60)
        log.close()
