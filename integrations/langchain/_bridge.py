"""Crossing between sync and async iteration without blocking an event loop.

`iterate_in_thread` consumes an async iterator from sync code (an AsyncEngine from `invoke`),
`aiterate_in_thread` a blocking iterator from async code (an offline LLM from `ainvoke`). Each runs
the other side in a short-lived thread of its own (no pool, nothing outlives the call), and
leaving the iteration early closes the source iterator: an engine request is aborted and its KV
blocks are freed.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

T = TypeVar("T")

_ITEM, _DONE, _ERROR = range(3)


def iterate_in_thread(factory: Callable[[], AsyncIterator[T]]) -> Iterator[T]:
    """Iterate `factory()` (an async iterator) on an event loop in a helper thread."""
    items: queue.SimpleQueue = queue.SimpleQueue()
    started = threading.Event()
    handle: dict = {}

    async def pump() -> None:
        handle["loop"], handle["task"] = asyncio.get_running_loop(), asyncio.current_task()
        started.set()
        source = factory()
        try:
            async for item in source:
                items.put((_ITEM, item))
            items.put((_DONE, None))
        except asyncio.CancelledError:  # the consumer left: nobody reads any more
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            items.put((_ERROR, exc))
        finally:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()

    def run() -> None:
        try:
            asyncio.run(pump())
        except BaseException:  # noqa: BLE001 - cancelled by the consumer (or failed before pump)
            pass
        finally:
            started.set()  # a failure before pump() began must not leave the consumer waiting

    thread = threading.Thread(target=run, name="prefixserve-langchain-sync", daemon=True)
    thread.start()
    finished = False
    try:
        while True:
            kind, value = items.get()
            if kind == _ITEM:
                yield value
            elif kind == _DONE:
                finished = True
                return
            else:
                finished = True
                raise value
    finally:
        if not finished:
            started.wait()
            loop, task = handle.get("loop"), handle.get("task")
            if loop is not None and task is not None:
                try:
                    loop.call_soon_threadsafe(task.cancel)
                except RuntimeError:  # the loop already ended
                    pass
        thread.join()


async def aiterate_in_thread(factory: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Iterate `factory()` (a blocking iterator) in a helper thread, from a coroutine."""
    loop = asyncio.get_running_loop()
    items: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()

    def deliver(kind: int, value) -> bool:
        try:
            loop.call_soon_threadsafe(items.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone
            return False
        return True

    def run() -> None:
        source = factory()
        try:
            for item in source:
                if stop.is_set() or not deliver(_ITEM, item):
                    return
            deliver(_DONE, None)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            deliver(_ERROR, exc)
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=run, name="prefixserve-langchain-async", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = await items.get()
            if kind == _ITEM:
                yield value
            elif kind == _DONE:
                return
            else:
                raise value
    finally:
        stop.set()  # the worker stops (and closes its source) at its next item
