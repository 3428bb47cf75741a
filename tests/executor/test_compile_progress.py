"""compile_progress: progress lines while a warm-up compiles, and the summary with cache hits and misses."""

from __future__ import annotations

import logging

import jax
import pytest

from jaxserve.executor import compile_progress

pytestmark = pytest.mark.quick


def test_progress_lines_and_cache_summary(caplog, monkeypatch):
    monkeypatch.setattr(compile_progress, "LOG_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="jaxserve.compile"):
        progress = compile_progress.start(3, "/tmp/some-cache")
        for hit in (True, False, True):  # what jax reports when a program is looked up in the persistent cache
            jax.monitoring.record_event("/jax/compilation_cache/compile_requests_use_cache")
            if hit:
                jax.monitoring.record_event("/jax/compilation_cache/cache_hits")
            progress.tick()
        summary = progress.finish()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("compiling 3 step shapes (with the compilation cache in /tmp/some-cache)")
    assert any(line.startswith("compiled 1/3 step shapes, about") for line in lines)
    assert "2 hits, 1 misses" in lines[-1] and lines[-1].startswith("warm-up done: 3 step shapes ready in")
    assert (summary["cache_hits"], summary["cache_misses"], summary["shapes"]) == (2, 1, 3)
    assert progress.summary == summary  # kept by the warm-up's own reporter, no module state

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jaxserve.compile"):
        compile_progress.start(1, None).finish()
    assert "compilation cache off" in caplog.records[-1].getMessage()
