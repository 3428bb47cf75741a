"""Time from ``python -m jaxserve.serve`` to its ready line, with a cold and then a warm compilation cache.

    python scripts/bench_startup.py [--results-json AREA.json] [-- serve flags...]     e.g.  -- --model PATH

Each run starts the server on free ports with a fresh compilation-cache directory for the cold run (the same
one again for the warm run), waits for the "jaxserve ready" line, then stops it with SIGTERM. With no serve
flags it serves the demo model; ``--model /tmp/m100`` etc. go after ``--``. Besides the time to ready it reports
the warm-up's own summary line: how many shapes, and how many programs the persistent cache held (hits) or had
to compile (misses), so the warm run shows the cache in use.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import bench_results  # noqa: E402


def time_to_ready(serve_args: list[str], cache_dir: str, timeout: float = 1200) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "jaxserve.serve", "--http-port", "0", "--grpc-port", "0",
           "--compilation-cache-dir", cache_dir, *serve_args]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    warmup = "(no warm-up summary seen)"
    try:
        for line in proc.stdout:
            if "warm-up done" in line:
                warmup = line.strip().split("warm-up done: ", 1)[-1]
            if "jaxserve ready" in line:
                return time.perf_counter() - start, warmup
            if time.perf_counter() - start > timeout:
                break
        raise RuntimeError(f"server exited or timed out before it was ready (exit code {proc.poll()})")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    serve_args = sys.argv[split + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_results.add_arguments(p)
    figures = bench_results.Results(p.parse_args(sys.argv[1:split]))
    with tempfile.TemporaryDirectory(prefix="jaxserve-xla-") as cache:
        cold, cold_warmup = time_to_ready(serve_args, cache)
        warm, warm_warmup = time_to_ready(serve_args, cache)
    print(f"serve {' '.join(serve_args) or '(demo model)'}: ready after {cold:.1f}s cold, {warm:.1f}s with a warm "
          f"compilation cache")
    print(f"  cold warm-up: {cold_warmup}")
    print(f"  warm warm-up: {warm_warmup}")
    figures.add("cold start to ready", cold, "s")
    figures.add("warm start to ready", warm, "s")
    figures.save()


if __name__ == "__main__":
    main()
