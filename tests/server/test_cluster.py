"""`prefixserve cluster`: real workers behind the real SGLang Model Gateway (smg), over HTTP on 127.0.0.1.

- cache_aware sends requests that share a prefix to the worker that already holds it (every request
  after a prefix's first reads it from cache), and SIGTERM stops the gateway and every worker;
- a load-aware policy (power_of_two) reads our /loads and routes away from a busy worker.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from server_testlib import wait_until

pytest.importorskip("smg")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port_run(n: int) -> int:
    """A base port P with P .. P+n all free (the gateway, n-1 workers and its metrics port)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n + 1):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no run of free ports")


@contextlib.contextmanager
def cluster(tiny_path, tmp_path, *flags: str, replicas: int = 2):
    port = _free_port_run(replicas + 2)
    log = open(tmp_path / "cluster.log", "w")
    cmd = [sys.executable, "-m", "app.cli", "cluster", "--replicas", str(replicas), "--port", str(port),
           "--threads-per-replica", "1", *flags, "--model", str(tiny_path), "--served-model-name", "tiny",
           "--max-model-len", "512", "--num-kv-blocks", "256", "--max-num-seqs", "16"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, stdout=log,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            """The gateway answers and counts every worker healthy: its readiness turns 200 with the
            first one, and a prefix routed before the second joins lands on the first."""
            assert proc.poll() is None, (tmp_path / "cluster.log").read_text()[-3000:]
            try:
                resp = httpx.get(f"{base}/readiness", timeout=2)
            except httpx.HTTPError:
                return False
            return resp.status_code == 200 and resp.json()["healthy_workers"] == replicas

        assert wait_until(ready, 180, 0.5), (tmp_path / "cluster.log").read_text()[-3000:]
        workers = [f"http://127.0.0.1:{port + 1 + i}" for i in range(replicas)]
        yield proc, base, workers
    finally:
        if proc.poll() is None:
            proc.kill()
            for child in psutil.Process(proc.pid).children(recursive=True) if psutil.pid_exists(proc.pid) else []:
                child.kill()
        log.close()


def _complete(base: str, prompt: str, **extra) -> dict:
    resp = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2,
                                                      "temperature": 0, **extra}, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _finished(worker: str) -> float:
    text = httpx.get(f"{worker}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("prefixserve:request_success_total{"))


def _gauge(worker: str, name: str) -> float:
    text = httpx.get(f"{worker}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"prefixserve:{name}{{"))


def test_cache_aware_keeps_each_prefix_on_one_worker_and_sigterm_stops_all(tiny_path, tmp_path):
    with cluster(tiny_path, tmp_path, "--policy", "cache_aware") as (proc, base, workers):
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) == 3  # two workers and the gateway
        assert all(httpx.get(f"{w}/health", timeout=5).status_code == 200 for w in workers)
        # With nothing cached for a prefix, the gateway picks between two idle workers by chance (smg's
        # expected-wait fallback): 4 prefixes all went to one worker in about 1 run of 6, and 8 did so
        # once in CI (1 in 128). The balance is checked below over 24 unseen prompts (1 in 8 million).
        prefixes = [f"System prompt {k}: " + " ".join(f"rule{k}x{i}" for i in range(60)) for k in range(8)]
        cached = {k: [] for k in range(len(prefixes))}
        for round_ in range(3):
            for k, prefix in enumerate(prefixes):
                usage = _complete(base, f"{prefix}\nQuestion {round_}?")["usage"]
                cached[k].append(usage["prompt_tokens_details"]["cached_tokens"])
        for k, hits in cached.items():
            # The first sees at most the shared "System prompt " words; later ones read the whole prefix.
            assert hits[0] < 16 and all(h >= 256 for h in hits[1:]), (k, hits)
        # Both workers got work (the gateway spreads prompts it has not seen).
        for k in range(16):
            _complete(base, f"Unseen {k}: " + " ".join(f"fact{k}x{i}" for i in range(20)))
        assert all(_finished(w) > 0 for w in workers), [_finished(w) for w in workers]

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert wait_until(lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children),
                          10)


def test_load_aware_policy_routes_away_from_a_busy_worker(tiny_path, tmp_path):
    # "requests": compare the engine-reported running + waiting requests (our /loads), not latencies.
    flags = ("--policy", "power_of_two", "--gateway-arg=--load-monitor-interval=1",
             "--gateway-arg=--power-of-two-load-metric=requests")
    with cluster(tiny_path, tmp_path, *flags) as (proc, base, workers):
        busy, idle = workers
        stop = threading.Event()

        def keep_busy() -> None:  # straight to one worker, not through the gateway; requests of a few
            # seconds, so the loop keeps it busy while the test runs yet the join at the end waits for little.
            # Shorter ones let the gateway send about 2 in 5 to the busy worker (measured 11-13 of 20 to the
            # idle one at ~1.9 s a request once the sampler's race moved to C; 16 or more at ~5 s, as before).
            while not stop.is_set():
                httpx.post(f"{busy}/v1/completions", json={"model": "tiny", "prompt": "busy " * 20, "n": 8,
                                                           "max_tokens": 400, "ignore_eos": True}, timeout=120)

        threads = [threading.Thread(target=keep_busy) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            # 90 s: under make test's second worker the first busy requests once took over 30 s to show
            # (a Zen 5, 2026-11-29; it passed alone in 17 s). On failure, say what the worker reported.
            def busy_load() -> float:
                return _gauge(busy, "num_requests_running") + _gauge(busy, "num_requests_waiting")

            assert wait_until(lambda: busy_load() >= 4, 90, 0.2), (
                busy_load(), [t.is_alive() for t in threads], (tmp_path / "cluster.log").read_text()[-3000:])
            time.sleep(3)  # the gateway polls /loads every second
            before = _finished(idle)
            for i in range(20):
                _complete(base, f"Routed request {i}")
            routed_to_idle = _finished(idle) - before
        finally:
            stop.set()
            for t in threads:
                t.join(120)
        # Blind (no /loads) it splits about evenly (measured 7 of 10); 16 of 20 happens by chance < 1%.
        assert routed_to_idle >= 16, routed_to_idle
