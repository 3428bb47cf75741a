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
import dataclasses
import gc
import logging
import os
import signal
import socket

import uvicorn

from jaxserve.server.async_engine import AsyncEngine
from jaxserve.server.connections import uvicorn_config
from jaxserve.server.grpc_api import GrpcServer
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.openai.server import OpenAIServer
from jaxserve.server.stats_log import STATS_INTERVAL_S, StatsLogger

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


def _make_cache_dir(cache_dir: str | None) -> None:
    if cache_dir:  # XLA only writes cache entries into a folder that exists
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as e:
            logger.warning("cannot create the compilation cache folder %s: %s", cache_dir, e)


@dataclasses.dataclass(frozen=True)
class _FrontEnds:
    """The two servers, bound to their ports but not yet serving."""

    grpc: GrpcServer
    grpc_port: int
    http: _UvicornServer
    http_sock: socket.socket
    http_port: int


def _open_front_ends(args: argparse.Namespace, engine: AsyncEngine, metrics: ServerMetrics) -> _FrontEnds | None:
    """Both servers bound to their ports; None (logged) when a port cannot be had."""
    names, limits = args.served_model_name, getattr(args, "limits", None)
    cluster, tls, connections = (getattr(args, name, None) for name in ("cluster", "tls", "connections"))
    tenants = dict(prompt_tokens_details=getattr(args, "enable_prompt_tokens_details", False),
                   cache_salt_per_api_key=getattr(args, "cache_salt_per_api_key", False))
    grpc_server = GrpcServer(engine, metrics, names, api_key=args.api_key, max_message_bytes=args.max_request_bytes,
                             limits=limits, cluster=cluster, tls=tls, connections=connections,
                             reasoning_parser=getattr(args, "reasoning_parser", None),
                             tool_call_parser=getattr(args, "tool_call_parser", None),
                             structured_in_reasoning=_in_reasoning(args), **tenants)
    try:
        grpc_port = grpc_server.bind(args.host, args.grpc_port)
        http_sock = _listen(args.host, args.http_port)
    except (OSError, RuntimeError) as e:
        logger.error("cannot listen on %s (HTTP port %d, gRPC port %d): %s", args.host, args.http_port,
                     args.grpc_port, e)
        return None
    app = OpenAIServer(engine, metrics, names, api_key=args.api_key, max_body_bytes=args.max_request_bytes,
                       limits=limits, enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
                       tool_call_parser=getattr(args, "tool_call_parser", None), admin=getattr(args, "admin", None),
                       cluster=cluster, reasoning_parser=getattr(args, "reasoning_parser", None),
                       structured_in_reasoning=_in_reasoning(args),
                       response_role=getattr(args, "response_role", "assistant"), **tenants).app()
    http_server = _UvicornServer(uvicorn_config(app, connections, tls, root_path=getattr(args, "root_path", None),
                                                log_level=getattr(args, "uvicorn_log_level", None)))
    return _FrontEnds(grpc_server, grpc_port, http_server, http_sock, http_sock.getsockname()[1])


def _in_reasoning(args) -> bool:
    """``--structured-outputs-config``'s enable_in_reasoning: structured output constrains the reasoning too."""
    return bool((getattr(args, "structured_outputs_config", None) or {}).get("enable_in_reasoning", False))


def _stop_events() -> tuple[asyncio.Event, asyncio.Event]:
    """(stop, force): SIGTERM or SIGINT sets stop (drain); a second one also sets force (cut the grace short)."""
    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:  # the first signal drains; a second one cuts the grace period short
        if stop.is_set():
            force.set()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    return stop, force


async def _serve_until_stopped(args: argparse.Namespace, engine: AsyncEngine, metrics: ServerMetrics,
                               fronts: _FrontEnds, ready: asyncio.Future, stopping: asyncio.Future,
                               http_task: asyncio.Task) -> int:
    """Waits for the engine to be ready, turns health to serving, then serves until a signal; returns 1 when the
    engine failed to start (its thread logged why) or the HTTP server stopped on its own, 2 when the engine
    refused what it was given (a ``ValueError``, which ``serve`` raises once both servers are closed), else 0."""
    names, host = args.served_model_name, args.host
    await asyncio.wait({ready, stopping, http_task}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if ready.done() and ready.exception() is None and not http_task.done():
        # What start-up made (imports, the model's Python side, the steps' executables) lives as long as the
        # process: out of the cyclic collector's reach, its full passes stay short while serving (vLLM does so).
        gc.collect()
        gc.freeze()
        serving = engine.unready_reason() is None
        await fronts.grpc.set_serving(serving)
        metrics.ready.set(1 if serving else 0)
        scheme = "https" if getattr(args, "tls", None) is not None else "http"
        print(f"jaxserve ready: model={names[0]} http={scheme}://{_url(host, fronts.http_port)} "
              f"grpc={_url(host, fronts.grpc_port)} path={engine.info.get('model_path', '')}", flush=True)
        watchers = _watchers(args, engine, metrics, fronts, serving)
        await asyncio.wait({stopping, http_task}, return_when=asyncio.FIRST_COMPLETED)
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
    elif ready.done():
        # A ValueError is the engine refusing what it was given (a flag's value, the model folder, a mesh or a
        # model too large for the devices): a user error, reported by the command in one line with exit code 2
        # like every command's. Anything else failed while starting (its traceback is logged once): 1.
        code = 2 if isinstance(ready.exception(), ValueError) else 1
    if http_task.done() and not stopping.done():
        logger.error("the HTTP server stopped unexpectedly: %s", http_task.exception() if not
                     http_task.cancelled() else "cancelled")
        code = 1
    return code


def _watchers(args: argparse.Namespace, engine: AsyncEngine, metrics: ServerMetrics, fronts: _FrontEnds,
              serving: bool) -> list[asyncio.Future]:
    """What runs beside serving: readiness following the engine, and vLLM's periodic stats line (unless
    --disable-log-stats)."""
    tasks = [asyncio.ensure_future(_follow_readiness(engine, metrics, fronts, serving))]
    if not getattr(args, "disable_log_stats", False):
        tasks.append(asyncio.ensure_future(StatsLogger(engine.stats, STATS_INTERVAL_S).run()))
    return tasks


async def _follow_readiness(engine: AsyncEngine, metrics: ServerMetrics, fronts: _FrontEnds, serving: bool,
                            every: float = 0.1) -> None:
    """While serving: gRPC health and ``jaxserve_ready`` follow ``engine.unready_reason()`` (a decode process whose
    prefill servers are all unreachable is not ready), as /health does."""
    while True:
        now = engine.unready_reason() is None
        if now != serving:
            logger.warning("%s", "ready again" if now else f"not ready: {engine.unready_reason()}")
            serving = now
            await fronts.grpc.set_serving(now)
            metrics.ready.set(1 if now else 0)
        await asyncio.sleep(every)


async def _shut_down(engine: AsyncEngine, metrics: ServerMetrics, fronts: _FrontEnds, http_task: asyncio.Task,
                     grace: float, force: asyncio.Event) -> bool:
    """Stops admitting, drains (when the engine got warm), closes both servers and stops the engine; returns
    whether the engine was warm (if not, its thread is still busy starting)."""
    engine.begin_drain()
    metrics.ready.set(0)
    await fronts.grpc.set_serving(False)
    warm = engine.ready
    if warm:
        await _drain(engine, grace, force)
    await fronts.grpc.stop(grace=3)
    fronts.http.should_exit = True
    with contextlib.suppress(Exception):
        await http_task
    if warm:
        await engine.stop()
    return warm


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


async def serve(args: argparse.Namespace) -> int:
    """Run the server until a signal; returns the process exit code. When the engine refuses to start (a
    ``ValueError``: a flag's value, the checkpoint, a mesh or a model the devices cannot hold), both servers are
    closed and that error is raised, for the command to report in one line."""
    _make_cache_dir(args.engine_config.compilation_cache_dir)
    metrics = ServerMetrics(args.served_model_name[0], slo_ttft_s=_seconds(getattr(args, "slo_ttft_ms", None)),
                            slo_tpot_s=_seconds(getattr(args, "slo_tpot_ms", None)))
    engine = AsyncEngine(args.engine_config, metrics=metrics, engine_factory=getattr(args, "engine_factory", None),
                         lora_modules=getattr(args, "lora_requests", ()))
    metrics.attach_engine(engine.stats, engine.intake_length)
    fronts = _open_front_ends(args, engine, metrics)
    if fronts is None:
        return 1
    stop, force = _stop_events()

    await fronts.grpc.start()
    http_task = asyncio.create_task(fronts.http.serve(sockets=[fronts.http_sock]))
    engine.start()
    logger.info("loading and warming up %s; HTTP on %s and gRPC on %s answer 'not ready' until then",
                args.model or "the demo model", _url(args.host, fronts.http_port), _url(args.host, fronts.grpc_port))
    ready = asyncio.ensure_future(engine.wait_ready())
    stopping = asyncio.ensure_future(stop.wait())
    code = await _serve_until_stopped(args, engine, metrics, fronts, ready, stopping, http_task)
    warm = await _shut_down(engine, metrics, fronts, http_task, args.shutdown_grace_period, force)
    ready.cancel()
    stopping.cancel()
    logger.info("stopped")
    if code == 2 and ready.done() and not ready.cancelled() and isinstance(ready.exception(), ValueError):
        raise ready.exception()
    return code if warm else (code or -1)  # -1: the engine thread is still busy starting; exit hard
