"""Counts XLA backend compilations in this process, so tests and metrics can show serving never compiles, and
the persistent compilation cache's lookups and hits, so start-up can say whether the cache was used."""

from __future__ import annotations

import threading

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "lookups",
                 "/jax/compilation_cache/cache_hits": "hits"}
_lock = threading.Lock()
_count = 0
_cache = {"lookups": 0, "hits": 0}
_installed = False
_thread = threading.local()  # this thread's persistent-cache hits (a compile's events fire on its own thread)


def _listener(event: str, duration: float, **_) -> None:
    global _count
    if event == _EVENT:
        with _lock:
            _count += 1


def _cache_listener(event: str, **_) -> None:
    name = _CACHE_EVENTS.get(event)
    if name is not None:
        with _lock:
            _cache[name] += 1
        if name == "hits":
            _thread.hits = getattr(_thread, "hits", 0) + 1


def install() -> None:
    """Start counting (idempotent)."""
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            jax.monitoring.register_event_listener(_cache_listener)
            _installed = True


def count() -> int:
    """Backend compilations since ``install()``."""
    return _count


def cache_counts() -> dict[str, int]:
    """Persistent-cache lookups and hits since ``install()``."""
    with _lock:
        return dict(_cache)


def thread_cache_hits() -> int:
    """Persistent-cache hits of compilations run on the calling thread since ``install()``."""
    return getattr(_thread, "hits", 0)
