"""Step shapes compiled after the engine is ready, on threads beside the host loop.

A cold start spends nearly all its time compiling one program per bucket shape. With ``compile_in_background``
the warm-up compiles only the largest prefill and the largest decode shape (every step fits one of them) and the
shapes the executable store already holds; the engine reports ready, and the other shapes compile here. Until a
shape is ready its steps run padded to the next larger compiled one (``StepShapes.compiled``): the same tokens,
more padding. Each compiled shape is saved to the executable store, so the next start loads them all before it
is ready.

XLA's compiler releases the GIL, so the host loop keeps running while a shape compiles; on a machine with few
cores the two share them. ``stop`` (the executor's ``close``, or the interpreter's exit) drops the shapes not
started and waits for those being compiled: as long as they take at the interpreter's exit, a few seconds at most
when the server stops (which then ends its process without waiting further: ``jaxserve.serve``).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable

logger = logging.getLogger("jaxserve.compile")

_live: weakref.WeakSet[BackgroundCompile] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """At exit, before daemon threads are frozen mid-compile: stop every background compile and wait for it."""
    for compile_ in list(_live):
        compile_.stop()


class BackgroundCompile:
    """Prepares ``shapes``, in order, on ``workers`` daemon threads.

    ``prepare(shape)`` compiles (or loads) one shape; ``ready(shape)`` is then called under this object's lock,
    so the callers' bookkeeping sees one shape at a time. A shape whose ``prepare`` raises is logged and left out
    (its steps stay on the larger shape). ``pending`` counts the shapes not done yet.
    """

    def __init__(self, shapes: list, prepare: Callable[[object], object], ready: Callable[[object], None],
                 workers: int = 1):
        self._queue = list(shapes)
        self._prepare = prepare
        self._ready = ready
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.pending = len(self._queue)
        self.failed: list = []
        self._start = time.monotonic()
        self._threads = [threading.Thread(target=self._work, name=f"jaxserve-compile-later-{i}", daemon=True)
                         for i in range(max(1, min(workers, len(self._queue))))]
        _live.add(self)
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while not self._stopped.is_set():
            with self._lock:
                if not self._queue:
                    return
                shape = self._queue.pop(0)
            started = time.monotonic()
            try:
                self._prepare(shape)
            except Exception:  # noqa: BLE001 - a shape left out costs padding, never a request
                logger.exception("compiling step shape %s in the background failed; its steps keep running in the "
                                 "next larger compiled shape", shape)
                ok = False
            else:
                ok = True
            logger.debug("background compile: step shape %s %s in %.1fs", shape, "ready" if ok else "failed",
                         time.monotonic() - started)
            with self._lock:
                if ok:
                    self._ready(shape)
                else:
                    self.failed.append(shape)
                self.pending -= 1
                if self.pending == 0 and not self._stopped.is_set():
                    logger.info("background compile done: every step shape ready %.1fs after the engine%s",
                                time.monotonic() - self._start,
                                f" ({len(self.failed)} failed)" if self.failed else "")

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no thread is working (every shape done, or stopped); returns whether none is."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(deadline - time.monotonic(), 0))
        return not any(thread.is_alive() for thread in self._threads)

    def stop(self, timeout: float | None = None) -> bool:
        """Drop the shapes not started and wait up to ``timeout`` seconds (None: as long as it takes) for those
        being compiled; returns whether none is still compiling."""
        self._stopped.set()
        with self._lock:
            self.pending -= len(self._queue)
            self._queue.clear()
        deadline = None if timeout is None else time.monotonic() + timeout
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join(None if deadline is None else max(deadline - time.monotonic(), 0))
        return not self.compiling()

    def compiling(self) -> int:
        """How many of its threads are still working (stopped or not)."""
        current = threading.current_thread()
        return sum(thread.is_alive() and thread is not current for thread in self._threads)


def still_compiling() -> int:
    """How many background-compile threads (of any engine in this process) are still working."""
    return sum(compile_.compiling() for compile_ in list(_live))
