"""The periodic stats line a vLLM server logs while it has work (its ``LoggingStatLogger``), from the engine's
``stats()`` snapshot that ``/metrics`` reads too: throughput over the last interval, the running and waiting
requests, KV cache usage and the prefix cache hit rate. Off with ``--disable-log-stats``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from jaxserve.server.metrics import kv_cache_usage

logger = logging.getLogger("jaxserve.stats")
STATS_INTERVAL_S = 10.0  # vLLM's default (VLLM_LOG_STATS_INTERVAL)


class StatsLogger:
    """One line per ``tick`` while there is work, or was in the interval before (vLLM's rule: an idle server
    logs nothing); ``run`` ticks every ``interval_s`` seconds."""

    def __init__(self, snapshot: Callable[[], dict | None], interval_s: float = STATS_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self._snapshot = snapshot
        self.interval_s = interval_s
        self._clock = clock
        self._last: dict | None = None  # the counters at the previous tick
        self._last_time = clock()
        self._was_busy = False
        self._hit_rate = 0.0  # the last interval's that looked the prefix cache up

    def tick(self) -> str | None:
        """Reads the engine's counters; returns the line it logged, or None (idle, or not started yet)."""
        stats, now = self._snapshot(), self._clock()
        if not stats:
            return None
        last = self._last or {}
        elapsed = max(now - self._last_time, 1e-9)
        delta = {k: float(stats.get(k, 0)) - float(last.get(k, 0)) for k in (
            "prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions")}
        first = self._last is None
        self._last, self._last_time = dict(stats), now
        if first:  # the counters so far include start-up's; throughput counts from here
            return None
        prompt, generation = delta["prompt_tokens"] / elapsed, delta["generation_tokens"] / elapsed
        running, waiting = int(stats.get("num_running", 0)), int(stats.get("num_waiting", 0))
        busy = bool(prompt or generation or running or waiting)
        if not (busy or self._was_busy):
            return None
        self._was_busy = busy
        if delta["prefix_cache_queries"] > 0:
            self._hit_rate = delta["prefix_cache_hits"] / delta["prefix_cache_queries"]
        usage = kv_cache_usage(stats)
        preempted = f"Preemptions: {int(delta['num_preemptions'])}, " if delta["num_preemptions"] > 0 else ""
        line = (f"Engine 000: Avg prompt throughput: {prompt:.1f} tokens/s, Avg generation throughput: "
                f"{generation:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, {preempted}"
                f"GPU KV cache usage: {usage * 100:.1f}%, Prefix cache hit rate: {self._hit_rate * 100:.1f}%")
        logger.info("%s", line)
        return line

    async def run(self) -> None:
        self.tick()  # the starting counters
        while True:
            await asyncio.sleep(self.interval_s)
            self.tick()
