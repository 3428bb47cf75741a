"""Which of the project's files one steady-state decode step runs code in: the path a reader follows.

    python scripts/step_files.py [--model DIR] [--temperature 0.0] [--json]

Builds an engine (the built-in demo model unless ``--model``), adds two requests, steps until both decode, then
runs one more ``Engine.step()`` under a profiler of this thread and lists every file of ``jaxserve/``,
``pallas_kernels/`` and ``sharding/`` a function of which ran in it, with those functions. ``--temperature 0`` is the greedy path (the
step's own argmax, no sampler call); above 0 the sampler runs too. ``docs/architecture.md`` ("One streamed
completion, file by file") quotes the counts; ``tests/engine/test_engine.py`` holds the bound.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxserve", "pallas_kernels", "sharding")


def _calls_in_this_thread(fn) -> set[tuple[str, str]]:
    """(file, function) of every Python function ``fn()`` runs in the calling thread. ``sys.setprofile`` is per
    thread; cProfile is not from Python 3.12 (it rides ``sys.monitoring``, which sees every thread), and a
    daemon thread left by another part of the process (a prefill prober, a stats logger) must not count."""
    ran: set[tuple[str, str]] = set()

    def record(frame, event, _arg):
        if event == "call":
            ran.add((frame.f_code.co_filename, frame.f_code.co_name))

    previous = sys.getprofile()
    sys.setprofile(record)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return ran


def step_files(engine, temperature: float = 0.0, warm_steps: int = 8) -> dict[str, list[str]]:
    """The project files one decode ``engine.step()`` runs code in (paths from the repository root), each with
    the names of its functions that ran. ``engine`` is idle; two requests are added and left unfinished."""
    from jaxserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=warm_steps + 16, temperature=temperature, seed=1)
    engine.add_request("step-files-a", "hello there, general", params)
    engine.add_request("step-files-b", "the quick brown fox", params)
    try:
        for _ in range(warm_steps):
            engine.step()
        ran = _calls_in_this_thread(engine.step)
    finally:
        for rid in ("step-files-a", "step-files-b"):
            engine.abort_request(rid)
        while engine.has_unfinished():
            engine.step()
    files: dict[str, set[str]] = collections.defaultdict(set)
    for filename, function in ran:
        path = Path(filename).resolve()
        if path.is_relative_to(ROOT) and path.relative_to(ROOT).parts[0] in PACKAGES:
            files[str(path.relative_to(ROOT))].add(function)
    return {f: sorted(names) for f, names in sorted(files.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: the built-in demo model)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: the greedy path; above 0: sampled")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a list")
    args = parser.parse_args()

    from jaxserve.config.engine import EngineConfig
    from jaxserve.disagg.factory import make_engine

    files = step_files(make_engine(EngineConfig(model=args.model)), args.temperature)
    if args.json:
        print(json.dumps({"files": len(files), "functions": files}))
        return
    for path, names in files.items():
        print(f"{path}: {', '.join(names)}")
    folders = {str(Path(p).parent) for p in files}
    print(f"{len(files)} files in {len(folders)} folders")


if __name__ == "__main__":
    main()
