"""Counts XLA backend compilations in this process, so tests and metrics can show serving never compiles."""

from __future__ import annotations

import threading

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0
_installed = False


def _listener(event: str, duration: float, **_) -> None:
    global _count
    if event == _EVENT:
        with _lock:
            _count += 1


def install() -> None:
    """Start counting (idempotent)."""
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            _installed = True


def count() -> int:
    """Backend compilations since ``install()``."""
    return _count
