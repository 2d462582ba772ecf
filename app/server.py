"""The OpenAI-compatible HTTP server: `create_app(engine) -> Litestar` and `serve(args)` (the CLI's
`prefixserve serve`).

    create_app(engine)   routes, OpenAI-shaped errors, auth, body limit, metrics, API docs served offline
                         (/docs, /redoc, /openapi.json and /schema: app/docs.py)
    serve(args)          binds the port, loads the model beside the event loop (/health is 503 until
                         it is ready), runs uvicorn; SIGTERM/SIGINT: stop accepting, drain in-flight
                         requests for --drain-timeout seconds, abort the rest, exit
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import threading
from collections.abc import Sequence
from types import FrameType

from litestar import Litestar
from litestar.datastructures import State

from app.args import engine_config_from_args
from app.docs import DOCS_ROUTES, render_plugins
from app.errors import handle_exception
from app.metrics import DEFAULT_NAMESPACE, ServerMetrics
from app.openapi import openapi_config
from app.routes_loads import LOADS_ROUTES
from app.routes_misc import MISC_ROUTES, package_version
from app.routes_openai import OPENAI_ROUTES
from app.routes_anthropic import ANTHROPIC_ROUTES
from app.routes_cache import CACHE_ROUTES
from app.routes_responses import RESPONSES_ROUTES
from app.responses_store import DEFAULT_MAX_STORED_RESPONSES, ResponseStore
from app.state import ServerState
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig

logger = logging.getLogger("prefixserve.server")

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_DRAIN_TIMEOUT_S = 30.0
# Seconds an idle keep-alive connection stays open. Longer than the clients' own idle expiry (httpx, so the
# openai and anthropic SDKs: 5 s), so the client always drops an idle connection first: at uvicorn's
# default of 5 s both sides let go at the same moment, and a request sent on a connection the server was
# closing failed with ReadError (1 of 2,643 requests in a 30-minute soak on a 2-core Zen 4, agent turns
# resuming after 1-5 s tool pauses).
DEFAULT_KEEP_ALIVE_S = 75.0


def create_app(
    engine: AsyncEngine | None,
    *,
    served_model_names: Sequence[str] | None = None,
    api_key: str | None = None,
    max_waiting_requests: int = 256,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    metrics_namespace: str = DEFAULT_NAMESPACE,
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
    max_queued_requests: int | None = None,
) -> Litestar:
    """The Litestar app serving `engine`. `engine=None` starts it in the loading state (/health 503,
    API 503 + Retry-After) until `app.state.server.attach(engine)`; then served_model_names is required.
    The app starts the engine's loop on startup; it never shuts the engine down (its owner does).
    metrics_namespace prefixes every /metrics name (`vllm` publishes vLLM's own names).
    `max_stored_responses` bounds the in-memory store of /v1/responses results (0: store none).
    `max_queued_requests` (SGLang's --max-queued-requests): a generation request that arrives while that many
    requests wait in the engine is refused before it is queued (503 + Retry-After; 529 overloaded_error on
    the Anthropic routes); None: no limit."""
    if served_model_names:
        names = tuple(served_model_names)
    elif engine is not None:
        names = (engine.model_info.model,)
    else:
        raise ValueError("served_model_names is required when the engine is not given")
    if max_waiting_requests < 0:
        raise ValueError("max_waiting_requests must be >= 0")
    if max_queued_requests is not None and max_queued_requests < 1:
        raise ValueError(f"--max-queued-requests must be >= 1, got {max_queued_requests}")

    holder: dict[str, ServerState] = {}

    def stats() -> dict | None:
        current = holder["state"].engine
        return current.stats() if current is not None else None

    state = ServerState(engine, names, api_key or None, max_waiting_requests,
                        ServerMetrics(stats, names[0], metrics_namespace), max_queued_requests=max_queued_requests,
                        responses=ResponseStore(max_stored_responses))
    holder["state"] = state

    def start_engine(app: Litestar) -> None:
        if app.state.server.engine is not None:
            app.state.server.engine.start()

    return Litestar(
        route_handlers=[*OPENAI_ROUTES, *RESPONSES_ROUTES, *ANTHROPIC_ROUTES, *CACHE_ROUTES, *MISC_ROUTES, *LOADS_ROUTES,
                        *DOCS_ROUTES],
        exception_handlers={Exception: handle_exception},
        request_max_body_size=max_body_bytes,
        openapi_config=openapi_config(package_version(), render_plugins()),
        state=State({"server": state}),
        on_startup=[start_engine],
    )


# -- serve ---------------------------------------------------------------------------------
def _uvicorn_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's graceful shutdown (stop accepting, wait for connections up to
        timeout_graceful_shutdown, cancel the rest: their streams abort their engine requests), plus:
        /health and new requests answer 503 while draining, and the process exits normally."""

        def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
            super().__init__(config)
            self.state = state

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if not self.state.draining:
                logger.info("received %s: draining in-flight requests (up to %ss), then exiting",
                            signal.Signals(sig).name, self.config.timeout_graceful_shutdown)
            self.state.draining = True
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # we exit by returning, after the engine shut down

    return DrainingServer


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _load_in_background(config: EngineConfig, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
    """Build the engine in a daemon thread (so a signal during loading never waits for it)."""
    future: asyncio.Future = loop.create_future()

    def deliver(result, error) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def build() -> None:
        try:
            engine = AsyncEngine.from_config(config)
        except BaseException as exc:  # noqa: BLE001 - reported to the serving coroutine
            loop.call_soon_threadsafe(deliver, None, exc)
            return
        loop.call_soon_threadsafe(deliver, engine, None)

    threading.Thread(target=build, name="prefixserve-load", daemon=True).start()
    return future


def uvicorn_config(app, args: argparse.Namespace):
    """uvicorn's settings from the serve flags: address, log level, the drain after SIGTERM, keep-alive."""
    import uvicorn

    drain_timeout = getattr(args, "drain_timeout", None)
    return uvicorn.Config(
        app, host=args.host, port=args.port, log_level=str(getattr(args, "log_level", "info")).lower(),
        timeout_graceful_shutdown=DEFAULT_DRAIN_TIMEOUT_S if drain_timeout is None else drain_timeout,
        timeout_keep_alive=getattr(args, "timeout_keep_alive", None) or DEFAULT_KEEP_ALIVE_S, lifespan="on",
    )


async def _serve_async(args: argparse.Namespace, config: EngineConfig) -> int:
    names = tuple(args.served_model_name or [config.model])
    app = create_app(None, served_model_names=names, api_key=args.api_key,
                     max_waiting_requests=args.max_waiting_requests,
                     metrics_namespace=getattr(args, "metrics_namespace", None) or DEFAULT_NAMESPACE,
                     max_stored_responses=getattr(args, "max_stored_responses", DEFAULT_MAX_STORED_RESPONSES),
                     max_queued_requests=getattr(args, "max_queued_requests", None))
    state: ServerState = app.state.server
    server = _uvicorn_server_class()(uvicorn_config(app, args), state)
    sock = _bind(args.host, args.port)
    url = f"http://{args.host}:{sock.getsockname()[1]}"
    logger.info("loading %s; listening on %s (/health is 503 until the model is ready)", config.model, url)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    loading = _load_in_background(config, asyncio.get_running_loop())
    await asyncio.wait({serving, loading}, return_when=asyncio.FIRST_COMPLETED)
    if not loading.done():  # the server stopped (a signal) before the model was ready
        loading.cancel()
        await serving
        return 0
    try:
        engine: AsyncEngine = loading.result()
    except Exception as exc:
        state.load_error = str(exc)
        logger.error("the model failed to load: %s", exc)
        server.should_exit = True
        await serving
        return 1
    engine.start()
    state.attach(engine)
    info = engine.model_info
    logger.info(
        "ready: model %s (served as %s), dtype %s, device %s, KV cache %d blocks x %d tokens = %d tokens, "
        "max_model_len %d; OpenAI API at %s/v1",
        config.model, ", ".join(names), info.dtype, info.device, info.num_kv_blocks,
        info.block_size, info.kv_cache_tokens, info.max_model_len, url,
    )
    try:
        await serving
    finally:
        await engine.shutdown()
    logger.info("stopped")
    return 0


def serve(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)  # invalid flags fail here, before binding the port
    return asyncio.run(_serve_async(args, config))
