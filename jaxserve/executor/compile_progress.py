"""What the warm-up compile is doing, while it does it: progress over the shapes to compile (a tqdm bar on a
terminal, else a log line every few seconds with an estimate of the time left), then one summary line with the
time taken, how many programs XLA compiled (none on a warm start), whether the persistent compilation cache was
used (hits and misses) and, when the executor sets ``stored``, how many executables (the steps', the sampler's)
the executable store loaded or had to compile.

The warm-up loop calls ``start(total)`` once, ``tick()`` on what it returns after each compiled shape and
``finish()`` at the end, which returns the summary: whoever ran the warm-up keeps it (``Warmup.summary``).
"""

from __future__ import annotations

import logging
import sys
import time

from jaxserve.executor.runner import CompileCounter

logger = logging.getLogger("jaxserve.compile")

LOG_EVERY_S = 5.0  # without a terminal: at most one progress line this often


class Progress:
    """One warm-up's progress over ``total`` shapes; see the module docstring."""

    def __init__(self, total: int, cache_dir: str | None, what: str, counter: CompileCounter | None = None,
                 stored: bool = False, later: int = 0):
        self.total = max(total, 1)
        self.later = later  # shapes left to compile in the background once serving starts
        self.cache_dir = cache_dir
        self.what = what
        self.done = 0
        self.start = time.monotonic()
        self._last_log = self.start
        # compilations and the cache's lookups and hits: from now on, or from when the caller started ``counter``
        # (the executor's, at its own start: the programs of loading the model count too)
        self._counter = counter if counter is not None else CompileCounter()
        self.stored: tuple[int, int] | None = None  # (loaded, compiled) executables of the executable store
        self.summary: dict | None = None  # set by ``finish``
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=f"compiling {what}", unit="shape", leave=False,
                             file=sys.stderr, dynamic_ncols=True)
        where = f"the compilation cache in {cache_dir}" if cache_dir else "no compilation cache"
        then = f"; {later} more compile in the background once serving starts" if later else ""
        if stored:  # the executable store holds every step: a warm start
            logger.info("loading %d %s stored by an earlier start (with %s)%s", self.total, what, where, then)
        else:
            logger.info("compiling %d %s (with %s); the first start takes longest%s", self.total, what, where, then)

    def tick(self) -> None:
        self.done = min(self.done + 1, self.total)
        if self._bar is not None:
            self._bar.update(1)
            return
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S and self.done < self.total:
            self._last_log = now
            elapsed = now - self.start
            left = elapsed / self.done * (self.total - self.done)
            logger.info("compiled %d/%d %s, about %.0fs left", self.done, self.total, self.what, left)

    def finish(self) -> dict:
        """Close the bar, log the summary line and return its figures (seconds, shapes, compilations, hits,
        misses)."""
        if self._bar is not None:
            self._bar.close()
        seconds = time.monotonic() - self.start
        counts = self._counter.cache_counts()
        lookups, hits = counts["lookups"], counts["hits"]
        # XLA's compilations: the cache's misses, or (a program the cache does not take, or no cache) jax's compile
        # events, which count a program read from the cache too
        compiled = max(lookups - hits, self._counter.count() - hits, 0)
        summary = {"seconds": seconds, "shapes": self.total, "compilations": compiled, "cache_hits": hits,
                   "cache_misses": lookups - hits, "cache_dir": self.cache_dir, "shapes_later": self.later}
        if not self.cache_dir:
            cache = "compilation cache off"
        elif lookups == 0:
            cache = f"compilation cache {self.cache_dir}: not consulted"
        elif hits == lookups:
            cache = f"compilation cache {self.cache_dir}: all {hits} programs loaded from it"
        else:
            cache = (f"compilation cache {self.cache_dir}: {hits} hits, {lookups - hits} misses (compiled now, "
                     "saved for the next start)")
        if self.stored is not None:
            loaded, compiled = self.stored
            summary.update(executables_loaded=loaded, executables_compiled=compiled)
            cache += f"; executable store: {loaded} loaded, {compiled} compiled and saved"
        compiled_text = "compiled nothing" if compiled == 0 else f"compiled {compiled} programs"
        later = f" ({self.later} more compiling in the background)" if self.later else ""
        logger.info("warm-up done: %d %s ready in %.1fs%s, %s; %s", self.total, self.what, seconds, later,
                    compiled_text, cache)
        self.summary = summary
        return summary


def start(total: int, cache_dir: str | None = None, what: str = "step shapes", *,
          counter: CompileCounter | None = None, stored: bool = False, later: int = 0) -> Progress:
    """Begin reporting a warm-up of ``total`` shapes; the returned ``Progress``'s ``tick()`` advances it.
    ``counter``: count compilations from its start instead of from now; ``stored``: every shape is in the
    executable store (the first line says it loads them); ``later``: shapes that compile in the background after
    the warm-up (said in both lines)."""
    return Progress(total, cache_dir, what, counter, stored, later)
