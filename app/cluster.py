"""`prefixserve cluster`: N `prefixserve serve` replicas behind the SGLang Model Gateway (PyPI `smg`),
one command for a local fleet. We write no router of our own: the gateway does cache-aware routing
(a radix tree of what it sent where), retries, health checks and load balancing; it reads our load
from /loads and /server_info (app/routes_loads.py).

    prefixserve cluster --replicas 2 --port 8000 [--policy cache_aware] [serve flags ...]
        workers:  prefixserve serve --port 8001 ... --port 8002 (threads split between them)
        gateway:  python -m smg.launch_router --worker-urls http://host:8001 http://host:8002 --port 8000
    prefixserve cluster --worker-urls http://a:8000 http://b:8000 --port 8000
        the gateway only, in front of workers started elsewhere (several machines)

Every flag the cluster does not know is passed to each worker's `prefixserve serve` unchanged (the
model, dtype, --kv-redis-url for a shared Redis tier, ...). SIGTERM / SIGINT stop the gateway first
(no new requests), then the workers (each drains its in-flight requests), then whatever is left.
A worker that dies is logged and left to the gateway, which routes around it; if the gateway dies
the cluster stops.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

logger = logging.getLogger("prefixserve.cluster")

POLICIES = ("cache_aware", "round_robin", "power_of_two", "least_load", "random", "consistent_hashing",
            "prefix_hash")
DEFAULT_STARTUP_TIMEOUT_S = 600.0  # the first start converts the default GGUF (~30 s) and compiles kernels
STOP_TIMEOUT_S = 40.0  # a worker's default --drain-timeout (30 s) plus its shutdown


@dataclass(frozen=True)
class ClusterSpec:
    """What to start. `worker_urls` set: start no workers, only the gateway in front of them."""

    replicas: int = 2
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "cache_aware"
    threads_per_replica: int | None = None  # None: the machine's cores split evenly
    worker_urls: tuple[str, ...] = ()
    serve_args: tuple[str, ...] = ()  # passed to every worker's `prefixserve serve`
    gateway_args: tuple[str, ...] = ()  # passed to the gateway
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.worker_urls and self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.threads_per_replica is not None and self.threads_per_replica < 1:
            raise ValueError(f"--threads-per-replica must be >= 1, got {self.threads_per_replica}")
        if self.worker_urls and self.serve_args:
            raise ValueError(f"with --worker-urls no workers are started here; unexpected flags: "
                             f"{' '.join(self.serve_args)}")
        for flag in ("--host", "--port"):
            if flag in self.serve_args:
                raise ValueError(f"{flag} is the cluster's own (workers listen on --port + 1 .. --port + N)")

    @property
    def local_worker_ports(self) -> tuple[int, ...]:
        return () if self.worker_urls else tuple(self.port + 1 + i for i in range(self.replicas))

    @property
    def urls(self) -> tuple[str, ...]:
        if self.worker_urls:
            return self.worker_urls
        return tuple(f"http://{self.host}:{p}" for p in self.local_worker_ports)

    @property
    def threads(self) -> int:
        if self.threads_per_replica is not None:
            return self.threads_per_replica
        return max(1, len(os.sched_getaffinity(0)) // max(1, self.replicas))

    def worker_command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "app.cli", "serve", "--host", self.host, "--port", str(port), *self.serve_args]

    def gateway_command(self) -> list[str]:
        cmd = [sys.executable, "-m", "smg.launch_router", "--worker-urls", *self.urls, "--policy", self.policy,
               "--host", self.host, "--port", str(self.port)]
        if not any(a.startswith("--prometheus-port") for a in self.gateway_args):
            # The gateway's own metrics port (default 29000) would collide between two clusters on one host.
            cmd += ["--prometheus-port", str(self.port + len(self.urls) + 1)]
        if not any(a.startswith("--log-level") for a in self.gateway_args):
            cmd += ["--log-level", "warn"]  # its info level logs every request twice
        return cmd + list(self.gateway_args)


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _gateway_ready(url: str, timeout: float = 2.0) -> bool:
    """The gateway's readiness is 200 as soon as one worker is healthy; a prefix routed before the
    others join lands on that one, so ready here means every worker it knows is healthy."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = json.loads(resp.read() or b"{}") if resp.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return False
    return body is not None and body.get("healthy_workers") == body.get("total_workers")


def _require_gateway() -> None:
    if importlib.util.find_spec("smg") is None:
        raise ValueError("the cluster needs the SGLang Model Gateway: pip install 'prefixserve[cluster]'")


@dataclass(eq=False)
class Fleet:
    """The child processes of one cluster: workers first, then the gateway; stopped in reverse."""

    spec: ClusterSpec
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)  # url -> process
    gateway: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(self.spec.threads)}
        for url, port in zip(self.spec.urls, self.spec.local_worker_ports):
            logger.info("starting worker %s (%d threads)", url, self.spec.threads)
            self.workers[url] = subprocess.Popen(self.spec.worker_command(port), env=env)
        self._wait_for_workers()
        logger.info("starting the gateway (policy %s) on http://%s:%d", self.spec.policy, self.spec.host,
                    self.spec.port)
        self.gateway = subprocess.Popen(self.spec.gateway_command())
        self._wait_for(lambda: _gateway_ready(f"http://{self.spec.host}:{self.spec.port}/readiness"), "the gateway")

    def _wait_for_workers(self) -> None:
        pending = set(self.spec.urls)

        def all_healthy() -> bool:
            for url in list(pending):
                if _http_ok(f"{url}/health"):
                    pending.discard(url)
                    logger.info("worker %s is ready", url)
            return not pending

        self._wait_for(all_healthy, "the workers")

    def _wait_for(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout
        while not ready():
            dead = self.dead()
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not become ready within {self.spec.startup_timeout:.0f} s")
            time.sleep(0.5)

    def dead(self) -> list[str]:
        """Children that have exited, by name."""
        gone = [f"worker {url} (exit {p.returncode})" for url, p in self.workers.items() if p.poll() is not None]
        if self.gateway is not None and self.gateway.poll() is not None:
            gone.append(f"the gateway (exit {self.gateway.returncode})")
        return gone

    def stop(self) -> None:
        """Gateway first (no new requests reach the workers), then the workers (they drain)."""
        for group in ([self.gateway] if self.gateway else [], list(self.workers.values())):
            for proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for proc in group:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def spec_from_args(args: argparse.Namespace, extra: Sequence[str]) -> ClusterSpec:
    return ClusterSpec(
        replicas=args.replicas, host=args.host, port=args.port, policy=args.policy,
        threads_per_replica=args.threads_per_replica, worker_urls=tuple(args.worker_urls or ()),
        serve_args=tuple(extra), gateway_args=tuple(args.gateway_arg or ()), startup_timeout=args.startup_timeout,
    )


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=2, help="workers to start on this machine (default: 2)")
    parser.add_argument("--host", default="127.0.0.1", help="the gateway's and the workers' address")
    parser.add_argument("--port", type=int, default=8000,
                        help="the gateway's port; workers listen on PORT+1 .. PORT+N (default: 8000)")
    parser.add_argument("--policy", default="cache_aware", choices=POLICIES,
                        help="the gateway's routing policy (default: cache_aware)")
    parser.add_argument("--threads-per-replica", type=int, default=None,
                        help="CPU threads per worker (default: this machine's cores / replicas)")
    parser.add_argument("--worker-urls", nargs="+", default=None,
                        help="start no workers: route to these (workers started on other machines)")
    parser.add_argument("--gateway-arg", action="append", default=None, metavar="ARG",
                        help="one more argument for the gateway (repeatable), e.g. --gateway-arg=--cache-threshold=0.5")
    parser.add_argument("--startup-timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT_S,
                        help="seconds to wait for the workers and the gateway to become ready")


def run_cluster(args: argparse.Namespace, extra: Sequence[str]) -> int:
    spec = spec_from_args(args, extra)
    _require_gateway()
    fleet = Fleet(spec)
    stopping = {"signal": None}

    def on_signal(sig: int, _frame) -> None:
        stopping["signal"] = sig
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        fleet.start()
        logger.info("cluster ready: %d workers behind the gateway at http://%s:%d/v1", len(spec.urls), spec.host,
                    spec.port)
        reported: set[str] = set()
        while True:
            for name in fleet.dead():
                if name.startswith("the gateway"):
                    logger.error("%s: stopping the cluster", name)
                    return 1
                if name not in reported:
                    reported.add(name)
                    logger.warning("%s; the gateway routes to the others", name)
            time.sleep(0.5)
    except KeyboardInterrupt:
        name = signal.Signals(stopping["signal"]).name if stopping["signal"] else "SIGINT"
        logger.info("received %s: stopping the gateway, then draining the workers", name)
        return 0
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_IGN)  # a second signal must not interrupt the stop itself
        fleet.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        logger.info("cluster stopped")
