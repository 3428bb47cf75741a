"""Counts XLA backend compilations, so tests and metrics can show serving never compiles, and the persistent
compilation cache's lookups and hits, so start-up can say whether the cache was used.

JAX reports compilations as process-wide monitoring events, and a listener cannot be taken back: one listener
per process (installed by the first ``CompileCounter``) hands each event to every live counter. The counts
belong to the counters: each counts from its creation, so whoever holds one reads what happened since it
started, whatever other engines or warm-ups in the process counted meanwhile.
"""

from __future__ import annotations

import threading
import weakref

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "lookups",
                 "/jax/compilation_cache/cache_hits": "hits"}
_lock = threading.Lock()
# The listener's subscribers (no counts here): counters that are gone stop receiving events.
_counters: weakref.WeakSet[CompileCounter] = weakref.WeakSet()
_listening = False


def _subscribers() -> list[CompileCounter]:
    with _lock:
        return list(_counters)


def _listener(event: str, duration: float, **_) -> None:
    if event == _EVENT:
        for counter in _subscribers():
            counter._compiled()


def _cache_listener(event: str, **_) -> None:
    name = _CACHE_EVENTS.get(event)
    if name is not None:
        for counter in _subscribers():
            counter._cache_event(name)


def _subscribe(counter: CompileCounter) -> None:
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            jax.monitoring.register_event_listener(_cache_listener)
            _listening = True
        _counters.add(counter)


class CompileCounter:
    """Compilations and persistent-cache lookups and hits in this process since the counter was created."""

    def __init__(self):
        self._lock = threading.Lock()
        self._count = 0
        self._cache = {"lookups": 0, "hits": 0}
        self._thread = threading.local()  # each thread's compilations and cache hits (a compile's events fire on its own thread)
        _subscribe(self)

    def _compiled(self) -> None:
        with self._lock:
            self._count += 1
        self._thread.compiles = getattr(self._thread, "compiles", 0) + 1

    def _cache_event(self, name: str) -> None:
        with self._lock:
            self._cache[name] += 1
        if name == "hits":
            self._thread.hits = getattr(self._thread, "hits", 0) + 1

    def count(self) -> int:
        """Backend compilations since this counter started."""
        return self._count

    def cache_counts(self) -> dict[str, int]:
        """Persistent-cache lookups and hits since this counter started."""
        with self._lock:
            return dict(self._cache)

    def thread_count(self) -> int:
        """Backend compilations on the calling thread since this counter started (a step's own, not those of a
        compile running beside it on another thread)."""
        return getattr(self._thread, "compiles", 0)

    def thread_cache_hits(self) -> int:
        """Persistent-cache hits of compilations run on the calling thread since this counter started."""
        return getattr(self._thread, "hits", 0)
