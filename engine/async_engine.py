"""AsyncEngine: the Engine driven by a background thread, consumed from asyncio.

The engine loop runs beside the event loop (torch releases the GIL inside its kernels), so a
server stays responsive during heavy generation. Requests and aborts cross into the loop through
a queue; outputs come back through per-request asyncio queues.

Robustness: a request the engine refuses fails alone (its generate() raises the engine's error);
if `Engine.step()` raises, the requests that were running in that step are aborted (their blocks
freed) and fail with EngineStepError, and the loop keeps serving everyone else.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.engine import Engine, PromptInput
from engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError, PrefixServeError
from engine.frontend import FrontendSurface
from engine.outputs import RequestOutput
from engine.process_setup import prepare_process
from engine.sampling_params import SamplingParams

logger = logging.getLogger("prefixserve")

# Put in a request's sink once the engine accepted it (add_request did not raise).
_ACCEPTED = object()


class EngineStepError(PrefixServeError, RuntimeError):
    """Engine.step() failed while this request was running; the request was aborted."""


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: PromptInput
    params: SamplingParams
    priority: int
    cache_salt: str | None
    sink: "_Sink"
    # Stamped when the caller submits, so queue time and e2e latency include the wait in the inbox.
    arrival_time: float
    max_queued: int | None = None  # refuse (EngineOverloadedError) when this many requests already wait


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _ResetPrefixCache:
    done: concurrent.futures.Future  # the engine's answer (bool), set on the engine thread


@dataclass
class _Call:
    fn: Callable[[Engine], Any]  # run on the engine thread between steps
    done: concurrent.futures.Future


class _Sink:
    """Delivers one request's outputs (or its error) to the coroutine awaiting them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException | object | None) -> bool:
        """False when the consumer's event loop is gone (its request should then be aborted)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop was closed
            return False
        return True


class AsyncEngine(FrontendSurface):
    def __init__(self, engine: Engine) -> None:
        self.engine = self._core = engine
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._dead: BaseException | None = None
        self._ids = itertools.count()
        self._wakeup = threading.Event()
        self._stats: dict | None = None
        self.num_step_failures = 0

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        prepare_process(config.device)  # process-wide set-up, once (gc freeze, malloc tuning)
        return cls(Engine(config))

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._loop, name="prefixserve-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        self._stopping.set()
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self.engine.stop_workers()  # tensor-parallel ranks (none with one rank)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def num_in_flight(self) -> int:
        return len(self._sinks)

    def stats(self) -> dict:
        """Engine.stats() as of the end of the latest step (a snapshot the loop refreshes; safe to read
        from any thread)."""
        snapshot = self._stats
        if snapshot is None:
            snapshot = self._stats = self.engine.stats()
        return snapshot

    # -- requests -------------------------------------------------------------------------
    def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        max_queued: int | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield cumulative RequestOutputs until the request finishes. Leaving the iteration early
        (closing the iterator, or being cancelled) aborts the request and frees its blocks. Errors of
        admission (InvalidRequestError, ContextLengthExceededError) are raised by the first step of
        the iteration. `max_queued`: refuse the request (EngineOverloadedError, nothing queued) when that
        many requests are already waiting in the engine (arrived, not yet running; SGLang's
        --max-queued-requests); None: no limit."""
        return self._outputs(prompt, params, request_id, priority, cache_salt, max_queued, announce=False)

    async def submit(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        max_queued: int | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Add a request and wait until the engine accepted it: raises its admission error here, before
        any output (EngineOverloadedError when `max_queued` requests already wait), then returns the
        iterator of its outputs (same contract as generate())."""
        outputs = self._outputs(prompt, params, request_id, priority, cache_salt, max_queued, announce=True)
        try:
            await outputs.__anext__()  # the acceptance marker
        except BaseException:
            await outputs.aclose()
            raise
        return outputs

    async def _outputs(
        self, prompt: PromptInput, params: SamplingParams | None, request_id: str | None, priority: int,
        cache_salt: str | None, max_queued: int | None, *, announce: bool,
    ) -> AsyncGenerator:
        if max_queued is not None and max_queued < 1:
            raise InvalidRequestError(f"max_queued must be >= 1 or None, got {max_queued}.", param="max_queued")
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop stopped: {self._dead!r}")
        self.start()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._sinks:
            raise InvalidRequestError(f"request id {request_id!r} is already in use.", param="request_id")
        sink = _Sink(asyncio.get_running_loop())
        self._sinks[request_id] = sink
        self._send(_Add(request_id, prompt, params or SamplingParams(), priority, cache_salt, sink, time.monotonic(),
                        max_queued))
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if item is _ACCEPTED:
                    if announce:
                        yield None
                    continue
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
            if self._sinks.get(request_id) is sink:
                del self._sinks[request_id]
            if not finished:
                self._send(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    async def reset_prefix_cache(self) -> bool:
        """Engine.reset_prefix_cache, run on the engine thread between steps (False while any request
        holds blocks)."""
        if not self.is_running:
            return self.engine.reset_prefix_cache()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_ResetPrefixCache(done))
        return await asyncio.wrap_future(done)

    async def cache_lookup(self, token_ids: list[int], *, cache_salt: str | None = None, remote: bool = True
                           ) -> dict[str, int | None]:
        """Engine.cache_lookup: tokens of the prefix cached on the device, retained, continuing in the host
        tier (looked up on the engine thread) and continuing those in Redis (``remote_tokens``, probed off the
        engine thread so a slow Redis never holds up a step; None without a Redis tier or when it does not
        answer, or with ``remote=False``)."""
        found, keys = await self._call(lambda core: core.cache_lookup_local(token_ids, cache_salt=cache_salt))
        if remote and self.engine.tiers.remote is not None:
            found["remote_tokens"] = await asyncio.to_thread(self.engine.remote_cached_tokens, keys)
        return found

    async def integrity_report(self) -> dict:
        """Engine.integrity_report on the engine thread (between steps): the invariants and block counts."""
        return await self._call(lambda core: core.integrity_report())

    async def cache_release(self, token_ids: list[int], *, cache_salt: str | None = None) -> int:
        """Engine.cache_release on the engine thread: end the prefix's retention; the tokens released."""
        return await self._call(lambda core: core.cache_release(token_ids, cache_salt=cache_salt))

    async def _call(self, fn: Callable[[Engine], Any]) -> Any:
        """``fn(engine)`` on the engine thread between steps (the block manager is the engine thread's alone)."""
        if not self.is_running:
            return fn(self.engine)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Call(fn, done))
        return await asyncio.wrap_future(done)

    def _send(self, message) -> None:
        self._inbox.put(message)
        self._wakeup.set()

    # -- the loop (engine thread) ----------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                if self._drain_inbox():
                    self._refresh_stats()
                if not self.engine.has_unfinished():
                    self._write_retained_blocks()
                    self._wakeup.wait(timeout=0.1)
                    self._wakeup.clear()
                    continue
                self._step()
                self._refresh_stats()
        except BaseException as exc:  # the loop's own machinery broke: fail every request, refuse new ones
            logger.exception("engine loop died")
            self._dead = exc
            for sink in list(self._sinks.values()):
                sink.put(EngineDeadError(f"the engine loop stopped: {exc!r}"))

    def _write_retained_blocks(self) -> None:
        """Idle: write the blocks Redis lacked for a long retention (if any); a failure never stops the loop."""
        try:
            self.engine.write_retained_blocks()
        except Exception:  # noqa: BLE001 - the retention holds on the device all the same
            logger.exception("writing retained KV blocks to Redis failed")

    def _drain_inbox(self) -> bool:
        """Apply queued adds and aborts; True when there were any."""
        any_message = False
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return any_message
            any_message = True
            if isinstance(message, _Add):
                if self._sinks.get(message.request_id) is not message.sink:
                    continue  # the caller already left (its abort follows in the inbox)
                if message.max_queued is not None:  # load shedding: refused before it is queued
                    waiting = self._num_waiting(message.max_queued)
                    if waiting >= message.max_queued:
                        message.sink.put(EngineOverloadedError(
                            f"the engine's queue is full: {waiting} requests waiting (max_queued "
                            f"{message.max_queued}).",
                            num_waiting=waiting, limit=message.max_queued))
                        continue
                try:
                    self.engine.add_request(
                        message.request_id, message.prompt, message.params,
                        priority=message.priority, cache_salt=message.cache_salt, arrival_time=message.arrival_time,
                    )
                except Exception as exc:  # bad request: only this request fails
                    message.sink.put(exc)
                    continue
                if not message.sink.put(_ACCEPTED):
                    self.engine.abort(message.request_id)
            elif isinstance(message, _Call):
                try:
                    message.done.set_result(message.fn(self.engine))
                except Exception as exc:  # noqa: BLE001 - reported to the caller
                    message.done.set_exception(exc)
            elif isinstance(message, _ResetPrefixCache):
                try:
                    message.done.set_result(self.engine.reset_prefix_cache())
                except Exception as exc:  # noqa: BLE001 - reported to the caller
                    message.done.set_exception(exc)
            else:
                if self.engine.abort(message.request_id):
                    sink = self._sinks.get(message.request_id)
                    if sink is not None:
                        sink.put(None)

    def _num_waiting(self, limit: int) -> int:
        """Requests in the scheduler's waiting queue (arrived or preempted, not running; what the
        num_requests_waiting gauge counts), counted up to `limit`."""
        ids: set[str] = set()
        for seq in self.engine.scheduler.waiting:
            ids.add(seq.request_id)
            if len(ids) >= limit:
                break
        return len(ids)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._fail_running(exc)
            return
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is not None and not sink.put(output) and not output.finished:
                self.engine.abort(output.request_id)  # nobody can receive it any more

    def _fail_running(self, exc: Exception) -> None:
        """step() raised: abort the requests it was running (freeing their blocks) and fail them with
        the error; waiting requests are untouched and the loop goes on."""
        self.num_step_failures += 1
        try:
            victims = self.engine.abort_running()
        except Exception:  # keep the loop alive; fail every in-flight request instead
            logger.exception("aborting the running requests after a failed step also failed")
            victims = list(self._sinks)
        logger.error("engine step failed (%r); aborted %d request(s) it was running", exc, len(victims),
                     exc_info=exc)
        for request_id in victims:  # notify last: by then every block of theirs is free
            sink = self._sinks.get(request_id)
            if sink is not None:
                error = EngineStepError(f"the engine failed while running this request: {exc!r}")
                error.__cause__ = exc
                sink.put(error)

    def _refresh_stats(self) -> None:
        try:
            self._stats = self.engine.stats()
        except Exception:  # metrics must never take the loop down
            logger.debug("engine.stats() failed", exc_info=True)
