"""Helpers of the LangChain tests (imported as `langchain_testlib`; tests/integrations is on sys.path)."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

SERVED_NAMES = ("smollm2", "smollm2-alias")
LC_MAX_MODEL_LEN = 2048


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def run_uvicorn(app):
    """A real uvicorn on 127.0.0.1 (a free port) in a thread; yields the base URL."""
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn-langchain-test", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def wait_idle(async_engine, timeout: float = 10.0) -> None:
    """Aborts travel through the engine loop: give them a moment, then insist every block is free."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if async_engine.num_in_flight() == 0 and not async_engine.engine.has_unfinished() \
                and async_engine.engine.kv_cache_usage()["num_in_use"] == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: in flight {async_engine.num_in_flight()}, "
                         f"usage {async_engine.engine.kv_cache_usage()}")
