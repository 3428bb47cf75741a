"""A real server process (``jaxserve.server.app.serve``: its signals, drain, health and both front ends) over the
stand-in ``FakeEngine``, for tests of a cluster's life (restarts under load) that need processes, not a model:
``python tests/fake_decode_server.py STEP_DELAY_S [--after-stdin-line] [serve flags...]``; with
``--after-stdin-line`` it imports everything, then waits for a line on stdin before it starts serving (a test
pre-starts the process that replaces another, and lets it take the ports once they are free)."""

from __future__ import annotations

import asyncio
import sys

from jaxserve.server import logs
from jaxserve.server.app import serve
from jaxserve.server.args import parse_args

from fake_engine import FakeEngine


def main(argv: list[str]) -> int:
    delay, rest = float(argv[0]), argv[1:]
    if rest[:1] == ["--after-stdin-line"]:
        rest = rest[1:]
        sys.stdin.readline()
    args = parse_args(["--compilation-cache-dir", "", *rest])

    def factory(config):
        engine = FakeEngine(config)
        engine.step_delay = delay
        return engine

    args.engine_factory = factory
    logs.setup(args.log_level)
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
