"""What a connection to the front ends may hold: the server's HTTP (uvicorn) and gRPC options, the same for a
server and the router.

- At most ``ConnectionLimits.max_connections`` HTTP connections (and requests in flight) at once: uvicorn's
  ``limit_concurrency``, which answers 503 beyond it; at most ``max_concurrent_rpcs`` gRPC calls (gRPC answers
  RESOURCE_EXHAUSTED beyond it).
- Read deadlines: a request's head (request line and headers) must arrive within ``header_timeout`` seconds of
  its first byte (of the connection's opening, for the first request: a connection that sends nothing is closed
  too), and its body within ``body_timeout`` seconds of the head. uvicorn has neither (its keep-alive timeout
  only runs between requests), so the HTTP protocol class is uvicorn's own with the deadlines added
  (``read_deadlines``): for h11 it follows the parser's ``their_state`` after each read; for httptools the
  parser's message callbacks. A connection past its deadline is closed; the others are not held up.
- gRPC: the handshake (TLS and HTTP/2 settings) of a new connection within ``header_timeout``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import uvicorn

from jaxserve.config.network import ServerTLS

logger = logging.getLogger(__name__)

# HTTP/1.1 keep-alive between two requests on one connection (uvicorn's own timer).
KEEP_ALIVE_S = 5


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    """``--max-connections``, ``--max-concurrent-rpcs``, ``--request-header-timeout``, ``--request-body-timeout``."""

    max_connections: int = 1024
    max_concurrent_rpcs: int = 1024
    header_timeout: float = 10.0
    body_timeout: float = 30.0

    def __post_init__(self):
        for name in ("max_connections", "max_concurrent_rpcs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        for name in ("header_timeout", "body_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name}={value!r} must be > 0 seconds")

    def grpc_options(self) -> list[tuple[str, int]]:
        return [("grpc.server_handshake_timeout_ms", int(self.header_timeout * 1000))]


class _Deadline:
    """One timer per connection: which part of a request it waits for, closing the transport when it runs out."""

    def __init__(self, protocol: asyncio.Protocol, limits: ConnectionLimits):
        self.protocol, self.limits = protocol, limits
        self.phase: str | None = None
        self.timer: asyncio.TimerHandle | None = None

    def wait_for(self, phase: str | None) -> None:
        """Start the deadline of ``phase`` ("head", "body") unless it already runs; None: stop."""
        if phase == self.phase:
            return
        self.stop()
        self.phase = phase
        if phase is not None:
            seconds = self.limits.header_timeout if phase == "head" else self.limits.body_timeout
            self.timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer, self.phase = None, None

    def _expire(self) -> None:
        transport = getattr(self.protocol, "transport", None)
        logger.debug("closing a connection whose request %s did not arrive in time (%s)", self.phase,
                     getattr(self.protocol, "client", None))
        self.timer = None
        if transport is not None and not transport.is_closing():
            transport.close()


def _h11_guarded(base: type, limits: ConnectionLimits) -> type:
    import h11

    class H11WithReadDeadlines(base):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._deadline = _Deadline(self, limits)
            self._deadline.wait_for("head")

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            state = self.conn.their_state
            if state is h11.IDLE:  # bytes of a head that is not complete yet
                self._deadline.wait_for("head")
            elif state is h11.SEND_BODY:
                self._deadline.wait_for("body")
            else:  # DONE, MUST_CLOSE, CLOSED, ERROR: nothing more to read for this request
                self._deadline.wait_for(None)

        def connection_lost(self, exc):
            self._deadline.stop()
            super().connection_lost(exc)

    return H11WithReadDeadlines


def _httptools_guarded(base: type, limits: ConnectionLimits) -> type:
    class HttpToolsWithReadDeadlines(base):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._deadline = _Deadline(self, limits)
            self._deadline.wait_for("head")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._deadline.wait_for("head")

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._deadline.wait_for("body")

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._deadline.wait_for(None)

        def connection_lost(self, exc):
            self._deadline.stop()
            super().connection_lost(exc)

    return HttpToolsWithReadDeadlines


def read_deadlines(limits: ConnectionLimits, base: type | None = None) -> type:
    """uvicorn's HTTP protocol class (``base``, default the one uvicorn picks itself: httptools when installed,
    else h11) with the read deadlines of ``limits``."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol as base
    from uvicorn.protocols.http.h11_impl import H11Protocol

    if issubclass(base, H11Protocol):
        return _h11_guarded(base, limits)
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        HttpToolsProtocol = None
    if HttpToolsProtocol is not None and issubclass(base, HttpToolsProtocol):
        return _httptools_guarded(base, limits)
    raise ValueError(f"no read deadlines for uvicorn's HTTP protocol {base.__name__}")


def uvicorn_config(app, limits: ConnectionLimits | None = None, tls: ServerTLS | None = None,
                   http: type | None = None, grace_s: float = 5, root_path: str | None = None,
                   log_level: str | None = None) -> uvicorn.Config:
    """The front end's uvicorn configuration (our own logging and signals; no lifespan): the connection cap,
    the read deadlines, TLS when given, and ``grace_s``: how long open requests may finish once it is told to
    stop (after that uvicorn cancels them); ``root_path`` (``--root-path``): the prefix a proxy strips;
    ``log_level`` (``--uvicorn-log-level``): uvicorn's own loggers' level (None: they follow ours)."""
    limits = limits or ConnectionLimits()
    return uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, timeout_keep_alive=KEEP_ALIVE_S,
                          root_path=root_path or "", log_level=log_level,
                          timeout_graceful_shutdown=grace_s, limit_concurrency=limits.max_connections,
                          http=read_deadlines(limits, http), **(tls.uvicorn_options() if tls else {}))
