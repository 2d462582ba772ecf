"""AsyncEngine: the Engine driven by a background thread, consumed from asyncio.

The engine loop runs beside the event loop (torch releases the GIL inside its kernels), so a
server stays responsive during heavy generation. Requests and aborts cross into the loop through
a queue; outputs come back through per-request asyncio queues.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.engine import Engine, PromptInput
from engine.errors import EngineDeadError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger("prefixserve")


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: PromptInput
    params: SamplingParams
    priority: int
    cache_salt: str | None
    sink: "_Sink"


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _Sink:
    """Delivers one request's outputs (or its error) to the coroutine awaiting them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._dead: BaseException | None = None
        self._ids = itertools.count()
        self._wakeup = threading.Event()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(Engine(config))

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="prefixserve-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        self._stopping.set()
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def num_in_flight(self) -> int:
        return len(self._sinks)

    # -- requests -------------------------------------------------------------------------
    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative RequestOutputs until the request finishes. Leaving the iteration early
        (or being cancelled) aborts the request and frees its blocks."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop stopped: {self._dead!r}")
        self.start()
        request_id = request_id or f"req-{next(self._ids)}"
        sink = _Sink(asyncio.get_running_loop())
        self._sinks[request_id] = sink
        self._send(_Add(request_id, prompt, params or SamplingParams(), priority, cache_salt, sink))
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item is None:  # aborted
                    finished = True
                    return
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._sinks.pop(request_id, None)
            if not finished:
                self._send(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    def _send(self, message) -> None:
        self._inbox.put(message)
        self._wakeup.set()

    # -- the loop (engine thread) ----------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wakeup.wait(timeout=0.1)
                    self._wakeup.clear()
                    continue
                self._step()
        except BaseException as exc:  # the engine itself broke: fail every request, refuse new ones
            logger.exception("engine loop died")
            self._dead = exc
            for sink in list(self._sinks.values()):
                sink.put(EngineDeadError(f"the engine loop stopped: {exc!r}"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, _Add):
                try:
                    self.engine.add_request(
                        message.request_id, message.prompt, message.params,
                        priority=message.priority, cache_salt=message.cache_salt,
                    )
                except Exception as exc:  # bad request: only this request fails
                    message.sink.put(exc)
            else:
                if self.engine.abort(message.request_id):
                    sink = self._sinks.get(message.request_id)
                    if sink is not None:
                        sink.put(None)

    def _step(self) -> None:
        for output in self.engine.step():
            sink = self._sinks.get(output.request_id)
            if sink is not None:
                sink.put(output)
