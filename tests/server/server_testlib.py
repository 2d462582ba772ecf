"""Helpers shared by the server tests (imported as `server_testlib`; tests/server is on sys.path)."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

TINY_MAX_MODEL_LEN = 512


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def blocks_in_use(async_engine) -> int:
    return async_engine.engine.kv_cache_usage()["num_in_use"]


def wait_for_idle(async_engine, timeout: float = 10.0) -> None:
    """Aborts travel through the engine loop: give them a moment, then insist every block is free."""
    ok = wait_until(lambda: async_engine.num_in_flight() == 0 and not async_engine.engine.has_unfinished()
                    and blocks_in_use(async_engine) == 0, timeout)
    assert ok, (f"engine not idle: in flight {async_engine.num_in_flight()}, "
                f"usage {async_engine.engine.kv_cache_usage()}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def run_uvicorn(app, **config):
    """A real uvicorn on 127.0.0.1 (a free port) in a thread; yields the base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                                          **config))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started, 20.0), "uvicorn did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def shutdown_engine(async_engine) -> None:
    asyncio.run(async_engine.shutdown())
