"""One engine per (model, engine settings) in this process, shared by every in-process chat model.

`ChatPrefixServe(model=...)` instances that differ only in per-call settings (temperature, max_tokens,
tools, ...) share one `AsyncEngine`, so they share its KV pool and its prefix cache: the second
instance reads the first one's system prompt from cache, and four instances take the memory of one.
Each user holds a `Lease`; the engine is shut down when the last lease is released.

Invariants:
* one live entry per `EngineConfig` (configs are frozen dataclasses, so equal settings hash equally);
* an entry's `users` is the number of unreleased leases on it, and the entry exists while it is > 0;
* `Lease.release()` is idempotent.

This registry is the one piece of process-wide state in the integration, on purpose: sharing across
instances is the feature. It lives behind `shared_engines()` (built on first use), not at import time.
"""
from __future__ import annotations

import asyncio
import functools
import threading
from dataclasses import dataclass

from engine import AsyncEngine, EngineConfig


@dataclass
class _Entry:
    engine: AsyncEngine
    users: int


class Lease:
    """One user's hold on a shared engine."""

    def __init__(self, registry: SharedEngines, config: EngineConfig, engine: AsyncEngine) -> None:
        self.engine = engine
        self._registry = registry
        self._config = config
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._registry._release(self._config)


class SharedEngines:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[EngineConfig, _Entry] = {}

    def acquire(self, config: EngineConfig) -> Lease:
        """A lease on the engine for `config`, built and started on first use (load errors propagate;
        nothing is registered then). Building happens under the lock: two first users of one config
        must not build two engines."""
        with self._lock:
            entry = self._entries.get(config)
            if entry is None:
                engine = AsyncEngine.from_config(config)
                engine.start()
                entry = self._entries[config] = _Entry(engine, 0)
            entry.users += 1
            return Lease(self, config, entry.engine)

    def num_users(self, config: EngineConfig) -> int:
        with self._lock:
            entry = self._entries.get(config)
            return entry.users if entry else 0

    def _release(self, config: EngineConfig) -> None:
        with self._lock:
            entry = self._entries[config]
            entry.users -= 1
            if entry.users:
                return
            del self._entries[config]
        shutdown_engine(entry.engine)


def shutdown_engine(engine: AsyncEngine) -> None:
    """Stop an engine's loop from any thread (its own loop runs elsewhere; this may run inside another)."""
    if engine.is_running:
        done = threading.Thread(target=lambda: asyncio.run(engine.shutdown()), daemon=True)
        done.start()
        done.join()


@functools.cache
def shared_engines() -> SharedEngines:
    """The process's registry."""
    return SharedEngines()
