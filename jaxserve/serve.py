"""Serve a model over gRPC and an OpenAI-compatible HTTP API: ``python -m jaxserve.serve [--model PATH]``.

With no ``--model`` it serves the built-in demo model (random weights: the output is meaningless), so it runs on
a fresh machine. ``--help`` lists every option; docs/serving.md describes the endpoints, metrics and errors.
"""

from __future__ import annotations

import asyncio
import os
import sys

from jaxserve import logs
from jaxserve.server.args import parse_args


def main(argv: list[str] | None = None, prog: str = "python -m jaxserve.serve") -> int:
    args = parse_args(argv, prog=prog)
    logs.setup(args.log_level)
    from jaxserve.server.app import serve  # after logging is set up: importing it loads jax and grpc

    code = asyncio.run(serve(args))
    if code < 0:  # stopped during warm-up: the engine thread cannot be interrupted mid-compile
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return code


if __name__ == "__main__":
    sys.exit(main())
