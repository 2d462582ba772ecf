"""Against a real uvicorn on 127.0.0.1: the openai client, disconnects, /health under load, SIGTERM draining."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from server_testlib import blocks_in_use, free_port, run_uvicorn, wait_for_idle, wait_until

from app.server import create_app

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def base_url(tiny_engine):
    app = create_app(tiny_engine, served_model_names=["tiny"])
    with run_uvicorn(app) as url:
        yield url


def test_openai_client_over_http(base_url, idle_engine):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens <= 4
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens <= 5
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hello " * 600, max_tokens=4)
    assert info.value.code == "context_length_exceeded"
    assert client.models.list().data[0].id == "tiny"


def test_dropped_stream_frees_blocks(base_url, slow_engine):
    body = {"model": "tiny", "prompt": "tell me everything " * 20, "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    break
            assert blocks_in_use(slow_engine) > 0, slow_engine.engine.stats()  # still generating
    # The client is gone: the request is aborted long before its 400 tokens (>= 4 s) could finish.
    started = time.monotonic()
    wait_for_idle(slow_engine, timeout=3.0)
    assert time.monotonic() - started < 3.0


def test_dropped_non_stream_request_is_aborted(base_url, slow_engine):
    body = {"model": "tiny", "prompt": "go on " * 20, "max_tokens": 400, "ignore_eos": True}
    with httpx.Client(timeout=0.5) as http, pytest.raises(httpx.ReadTimeout):
        http.post(f"{base_url}/v1/completions", json=body)
    wait_for_idle(slow_engine, timeout=3.0)


def test_waiting_request_whose_client_left_is_never_computed(base_url, slow_engine, monkeypatch):
    """A request still queued when its client gives up leaves the queue at once, streamed or not: under
    overload the engine must not spend a prefill on an answer nobody will read."""
    import dataclasses

    scheduler, runner = slow_engine.engine.scheduler, slow_engine.engine.runner
    monkeypatch.setattr(scheduler, "limits", dataclasses.replace(scheduler.limits, max_num_seqs=1))
    computed: set[str] = set()  # every sequence a forward computed
    execute = runner.execute

    def recording_execute(batch):
        computed.update(row.seq_id for row in batch.rows)
        return execute(batch)

    monkeypatch.setattr(runner, "execute", recording_execute)
    long = {"model": "tiny", "prompt": "keep going " * 10, "max_tokens": 300, "ignore_eos": True}
    busy = threading.Thread(target=lambda: httpx.post(f"{base_url}/v1/completions", json=long, timeout=60))
    busy.start()
    try:
        assert wait_until(lambda: len(scheduler.running) == 1)
        for stream in (True, False):
            body = {"model": "tiny", "prompt": "never computed " * 10, "max_tokens": 5, "stream": stream}
            with pytest.raises(httpx.ReadTimeout):  # headers may come (a stream), tokens cannot: it waits
                httpx.post(f"{base_url}/v1/completions", json=body, timeout=0.5)
            assert wait_until(lambda: not scheduler.waiting, 2.0), f"still queued (stream={stream})"
            assert len(scheduler.running) == 1  # the long request alone ran meanwhile
        assert len(computed) == 1, computed  # the long request's sequence alone was ever computed
    finally:
        busy.join(60)


def test_idle_keep_alive_outlives_the_clients_own_expiry(tiny_app):
    """The openai and anthropic SDKs (httpx) drop an idle connection after 5 s; the server keeps it longer, so
    a request sent on a connection 5.5 s idle is answered (at uvicorn's default of 5 s both sides let go
    at once and a request in that moment failed with ReadError, as one did in the 30-minute soak)."""
    import http.client

    import anthropic._constants
    import openai._constants

    from app.cli import build_parser
    from app.server import uvicorn_config

    config = uvicorn_config(tiny_app, build_parser().parse_args(["serve"]))
    expiries = {httpx.Limits().keepalive_expiry, openai._constants.DEFAULT_CONNECTION_LIMITS.keepalive_expiry,
                anthropic._constants.DEFAULT_CONNECTION_LIMITS.keepalive_expiry}
    assert config.timeout_keep_alive > max(expiries) + 10, (config.timeout_keep_alive, expiries)
    with run_uvicorn(tiny_app, timeout_keep_alive=config.timeout_keep_alive) as url:
        conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=10)
        try:
            for pause in (0.0, max(expiries) + 0.5):
                time.sleep(pause)
                conn.request("GET", "/v1/models")  # the same socket both times (keep-alive)
                response = conn.getresponse()
                assert response.status == 200 and json.loads(response.read())["data"]
        finally:
            conn.close()


def test_health_is_fast_during_heavy_generation(base_url, idle_engine):
    results: list[int] = []

    def stream_one(i: int) -> None:
        with httpx.Client(timeout=60) as http:
            response = http.post(f"{base_url}/v1/completions", json={
                "model": "tiny", "prompt": f"story {i} " * 10, "max_tokens": 120, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}})
            events = [e for e in response.text.split("\n\n") if e.startswith("data: {")]
            results.append(json.loads(events[-1][6:])["usage"]["completion_tokens"])

    threads = [threading.Thread(target=stream_one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    assert wait_until(lambda: idle_engine.engine.has_unfinished(), 10.0)
    latencies = []
    with httpx.Client(timeout=5) as http:
        while idle_engine.engine.has_unfinished() and len(latencies) < 40:
            start = time.perf_counter()
            assert http.get(f"{base_url}/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)
    for t in threads:
        t.join(60)
    assert results == [120] * 8
    assert len(latencies) >= 5
    assert statistics.median(latencies) < 0.1, latencies
    wait_for_idle(idle_engine)


def test_cli_serve_logs_drains_on_sigterm_and_exits(tiny_path, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--model", str(tiny_path), "--port", str(port),
             "--served-model-name", "tiny", "--num-kv-blocks", "128", "--max-model-len", "512",
             "--drain-timeout", "30"],
            cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        statuses = []

        def healthy() -> bool:
            try:
                statuses.append(httpx.get(f"{base}/health", timeout=2).status_code)
            except httpx.TransportError:
                return False
            return statuses[-1] == 200

        assert wait_until(healthy, 90.0, 0.1), log.read_text()[-3000:]
        assert set(statuses) <= {503, 200}
        text = log.read_text()
        assert "ready: model" in text and "dtype float32" in text and "KV cache 128 blocks" in text
        assert f"http://127.0.0.1:{port}/v1" in text

        received: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {"model": "tiny", "prompt": "drain me", "max_tokens": 480, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        received.append(line)
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(30)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:  # no new work is accepted while draining
            late = httpx.post(f"{base}/v1/completions", json={"prompt": "late", "max_tokens": 1}, timeout=5)
            assert late.status_code == 503
        except httpx.TransportError:
            pass
        reader.join(60)
        assert proc.wait(60) == 0
        assert received[-1] == "data: [DONE]"  # the in-flight request finished
        usage = json.loads(received[-2][6:])["usage"]
        assert usage["completion_tokens"] == 480
        assert "draining" in log.read_text()
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{base}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
