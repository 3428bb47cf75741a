"""One process, one engine, two front ends: start-up, readiness and graceful shutdown.

Start-up: both servers listen at once (health says NOT_SERVING / 503) while the engine thread loads and warms
up the model; then health turns SERVING / 200 and one line with both addresses goes to stdout.

Shutdown (SIGTERM or SIGINT): stop admitting (health NOT_SERVING / 503, new requests 503 / UNAVAILABLE), let
in-flight requests finish for up to ``--shutdown-grace-period`` seconds (a second signal ends the wait), abort
what is left, close both servers, stop the engine thread and return 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket

import uvicorn

from jaxserve.server.async_engine import AsyncEngine
from jaxserve.server.grpc_api import GrpcServer
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.openai_api import OpenAIServer

logger = logging.getLogger("jaxserve.serve")


class _UvicornServer(uvicorn.Server):
    """uvicorn in our event loop; the process's signal handlers (ours) decide when it stops."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn versions
        pass


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _url(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _drain(engine: AsyncEngine, grace: float, force: asyncio.Event) -> None:
    """Let live requests finish for up to ``grace`` seconds (or until ``force``), then abort the rest."""
    live = engine.num_live_requests
    logger.info("shutting down: %d request(s) in flight, up to %gs to finish", live, grace)
    if not live:
        return
    idle = asyncio.ensure_future(engine.wait_idle(None))
    forced = asyncio.ensure_future(force.wait())
    await asyncio.wait({idle, forced}, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
    if not idle.done():
        why = "second signal" if forced.done() else "grace period over"
        logger.warning("%s: aborting %d request(s)", why, engine.num_live_requests)
        engine.abort_all()
        await engine.wait_idle(10)
    idle.cancel()
    forced.cancel()


async def serve(args: argparse.Namespace) -> int:
    """Run the server until a signal; returns the process exit code."""
    names = args.served_model_name
    cache_dir = args.engine_config.compilation_cache_dir
    if cache_dir:  # XLA only writes cache entries into a folder that exists
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as e:
            logger.warning("cannot create the compilation cache folder %s: %s", cache_dir, e)
    metrics = ServerMetrics(names[0])
    engine = AsyncEngine(args.engine_config, metrics=metrics, engine_factory=getattr(args, "engine_factory", None))
    metrics.attach_engine(engine.stats, engine.intake_length)

    limits = getattr(args, "limits", None)
    grpc_server = GrpcServer(engine, metrics, names, api_key=args.api_key, max_message_bytes=args.max_request_bytes,
                             limits=limits)
    try:
        grpc_port = grpc_server.bind(args.host, args.grpc_port)
        http_sock = _listen(args.host, args.http_port)
    except (OSError, RuntimeError) as e:
        logger.error("cannot listen on %s (HTTP port %d, gRPC port %d): %s", args.host, args.http_port,
                     args.grpc_port, e)
        return 1
    http_port = http_sock.getsockname()[1]
    app = OpenAIServer(engine, metrics, names, api_key=args.api_key, max_body_bytes=args.max_request_bytes,
                       limits=limits, enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
                       tool_call_parser=getattr(args, "tool_call_parser", None)).app()
    http_server = _UvicornServer(uvicorn.Config(
        app, lifespan="off", log_config=None, access_log=False, timeout_keep_alive=5, timeout_graceful_shutdown=5))

    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:  # the first signal drains; a second one cuts the grace period short
        if stop.is_set():
            force.set()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)

    await grpc_server.start()
    http_task = asyncio.create_task(http_server.serve(sockets=[http_sock]))
    engine.start()
    logger.info("loading and warming up %s; HTTP on %s and gRPC on %s answer 'not ready' until then",
                args.model or "the demo model", _url(args.host, http_port), _url(args.host, grpc_port))

    ready = asyncio.ensure_future(engine.wait_ready())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({ready, stopping, http_task}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if ready.done() and ready.exception() is None and not http_task.done():
        await grpc_server.set_serving(True)
        metrics.ready.set(1)
        print(f"jaxserve ready: model={names[0]} http=http://{_url(args.host, http_port)} "
              f"grpc={_url(args.host, grpc_port)} path={engine.info.get('model_path', '')}", flush=True)
        await asyncio.wait({stopping, http_task}, return_when=asyncio.FIRST_COMPLETED)
    elif ready.done():
        logger.error("the engine failed to start: %s", ready.exception())
        code = 1
    if http_task.done() and not stopping.done():
        logger.error("the HTTP server stopped unexpectedly: %s", http_task.exception() if not
                     http_task.cancelled() else "cancelled")
        code = 1

    engine.begin_drain()
    metrics.ready.set(0)
    await grpc_server.set_serving(False)
    warm = engine.ready
    if warm:
        await _drain(engine, args.shutdown_grace_period, force)
    await grpc_server.stop(grace=3)
    http_server.should_exit = True
    with contextlib.suppress(Exception):
        await http_task
    if warm:
        await engine.stop()
    ready.cancel()
    stopping.cancel()
    logger.info("stopped")
    return code if warm else (code or -1)  # -1: the engine thread is still busy starting; exit hard
