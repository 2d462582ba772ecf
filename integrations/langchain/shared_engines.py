"""One engine per (model, engine settings) in this process, shared by every in-process chat model.

`ChatPrefixServe(model=...)` instances that differ only in per-call settings (temperature, max_tokens,
tools, ...) share one `AsyncEngine`, so they share its KV pool and its prefix cache: the second
instance reads the first one's system prompt from cache, and four instances take the memory of one.
Each user holds a `Lease`. An engine lives as long as the process needs it, not as long as one chat
model: when its last lease is released it stays up, idle, for ``idle_timeout_s`` (a chat model built
inside a function or per request finds it again, with its prefix cache), then shuts down; `close_idle()`
shuts idle engines down now, and at interpreter exit every engine is stopped quietly.

Invariants:
* one live entry per `EngineConfig` (configs are frozen dataclasses, so equal settings hash equally);
* an entry's `users` is the number of unreleased leases on it; an entry with no users holds an idle
  timer and is gone when it fires (or at `close_idle()` / exit);
* `Lease.release()` is idempotent.

This registry is the one piece of process-wide state in the integration, on purpose: sharing across
instances is the feature. It lives behind `shared_engines()` (built on first use), not at import time.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
from dataclasses import dataclass

from engine import AsyncEngine, EngineConfig

IDLE_TIMEOUT_ENV = "PREFIXSERVE_ENGINE_IDLE_TIMEOUT"
DEFAULT_IDLE_TIMEOUT_S = 600.0


@dataclass
class _Entry:
    engine: AsyncEngine
    users: int
    idle_timer: threading.Timer | None = None


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
    def __init__(self, idle_timeout_s: float | None = None) -> None:
        if idle_timeout_s is None:
            idle_timeout_s = float(os.environ.get(IDLE_TIMEOUT_ENV, DEFAULT_IDLE_TIMEOUT_S))
        self.idle_timeout_s = idle_timeout_s  # 0: shut down at the last release
        self._lock = threading.Lock()
        self._entries: dict[EngineConfig, _Entry] = {}

    def acquire(self, config: EngineConfig) -> Lease:
        """A lease on the engine for `config`, built and started on first use (load errors propagate;
        nothing is registered then), or found again while idle. Building happens under the lock: two
        first users of one config must not build two engines."""
        with self._lock:
            entry = self._entries.get(config)
            if entry is None:
                engine = AsyncEngine.from_config(config)
                engine.start()
                entry = self._entries[config] = _Entry(engine, 0)
            if entry.idle_timer is not None:
                entry.idle_timer.cancel()
                entry.idle_timer = None
            entry.users += 1
            return Lease(self, config, entry.engine)

    def num_users(self, config: EngineConfig) -> int:
        with self._lock:
            entry = self._entries.get(config)
            return entry.users if entry else 0

    def is_held(self, config: EngineConfig) -> bool:
        """Whether an engine for `config` is up (in use or idle)."""
        with self._lock:
            return config in self._entries

    def close_idle(self) -> int:
        """Shut down every engine no lease holds, now. Returns how many."""
        with self._lock:
            idle = [(c, e) for c, e in self._entries.items() if e.users == 0]
            for config, entry in idle:
                del self._entries[config]
                if entry.idle_timer is not None:
                    entry.idle_timer.cancel()
        for _, entry in idle:
            shutdown_engine(entry.engine)
        return len(idle)

    def close_all(self) -> None:
        """Stop every engine, held or not (interpreter exit), quietly."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            if entry.idle_timer is not None:
                entry.idle_timer.cancel()
            with contextlib.suppress(Exception):
                shutdown_engine(entry.engine)

    def _release(self, config: EngineConfig) -> None:
        with self._lock:
            entry = self._entries.get(config)
            if entry is None:  # closed already (exit)
                return
            entry.users -= 1
            if entry.users:
                return
            if self.idle_timeout_s > 0:
                entry.idle_timer = threading.Timer(self.idle_timeout_s, self._expire, (config, entry))
                entry.idle_timer.daemon = True
                entry.idle_timer.start()
                return
            del self._entries[config]
        shutdown_engine(entry.engine)

    def _expire(self, config: EngineConfig, entry: _Entry) -> None:
        with self._lock:
            if self._entries.get(config) is not entry or entry.users:
                return  # acquired again (its timer was cancelled) or closed meanwhile
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
    """The process's registry. Its engines stop at interpreter exit, before the thread pools they use do
    (threading's exit hooks run newest first; concurrent.futures registered its own when imported)."""
    registry = SharedEngines()
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(registry.close_all)
    else:  # pragma: no cover - CPython has had it since 3.9
        import atexit

        atexit.register(registry.close_all)
    return registry
