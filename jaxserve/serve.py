"""Serve a model over gRPC and an OpenAI-compatible HTTP API: ``python -m jaxserve.serve [MODEL | --model MODEL]``.

With no model it serves the built-in demo model (random weights: the output is meaningless), so it runs on
a fresh machine. ``--help`` lists every option; docs/serving.md describes the endpoints, metrics and errors.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from jaxserve.config.args import user_error
from jaxserve.config.engine import claim_gpu_memory
from jaxserve.server import logs
from jaxserve.server.args import parse_args


def main(argv: list[str] | None = None, prog: str = "python -m jaxserve.serve") -> int:
    args = parse_args(argv, prog=prog)
    if args.role != "router":  # the model, read before anything is loaded, compiled or served
        from jaxserve.models.checkpoint import check_model

        try:
            check_model(args.engine_config)
        except ValueError as e:
            return user_error(prog, e)
    logs.setup(args.log_level)
    for note in args.inert_flags:  # vLLM's flags given that change nothing here, one line each
        logging.getLogger("jaxserve.serve").info("%s", note)
    claim_gpu_memory()  # before anything starts jax's GPU backend
    if args.role == "router":  # no engine, no jax
        from jaxserve.server.router import run_router

        return asyncio.run(run_router(args))
    from jaxserve.executor import platforms

    platforms.restrict_to_present()  # no probes for accelerators that are not here (before jax's backends start)
    from sharding import multihost  # after logging is set up: importing it loads jax

    if multihost.initialize(args.coordinator_address, args.num_processes, args.process_id) \
            and not multihost.is_leader():
        return follow(args)
    if args.role == "prefill":
        from jaxserve.disagg.prefill import serve_prefill
        from jaxserve.server.probes import ProbeServer

        def probes(server):
            return ProbeServer(args.host, args.http_port, stats=lambda: server.stats,
                               intake_length=lambda: server.intake_length, healthy=lambda: server.healthy,
                               model_name=args.served_model_name[0])

        return _exit(serve_prefill(args, probes))
    if args.role == "decode":
        import functools

        from jaxserve.disagg.remote import RemotePrefillEngine

        args.engine_factory = functools.partial(RemotePrefillEngine, prefill_urls=args.prefill_url.split(","),
                                                kv_transfer=args.kv_transfer, transfer_host=args.kv_host,
                                                security=args.cluster)
    from jaxserve.server.app import serve  # importing it loads grpc

    try:
        return _exit(asyncio.run(serve(args)))
    except ValueError as e:  # the engine refused to start (a mesh or a model the devices cannot hold, ...)
        return _exit(user_error(prog, e))


def _exit(code: int) -> int:
    """``code``, once the server has shut down. Stopped during warm-up (the engine thread cannot be interrupted
    mid-compile), or with step shapes still compiling in the background (the interpreter's exit would wait for
    them, up to a compile's length): the process ends now instead."""
    from jaxserve.executor.background_compile import still_compiling

    if code < 0 or still_compiling():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(max(code, 0))
    return code


def follow(args) -> int:
    """A process other than 0 of a multi-host server: build the same engine, run the steps process 0 sends until
    it stops (its shutdown), then exit."""
    import dataclasses
    import logging

    from jaxserve.engine.engine import Engine

    log = logging.getLogger("jaxserve.serve")
    # Process 0 plans every step and owns the prefix cache: only it publishes KV-cache events.
    engine = Engine(dataclasses.replace(args.engine_config, kv_events_config=None))
    log.info("following process 0's steps")
    engine.follow()
    log.info("process 0 stopped; this follower exits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
