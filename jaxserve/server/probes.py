"""The prefill process's probes and metrics over HTTP (``--host:--http-port``), so Kubernetes can probe it as it
probes the other roles and Prometheus can scrape it: ``GET /health`` (200 while its engine thread serves, else
503), ``GET /live`` (200 while the process answers) and ``GET /metrics`` (the engine-stats families every server
exports, jaxserve's and vLLM's names, from its engine's latest stats: ``metrics.EngineStatsCollector``). Nothing
else is served: every other path is a 404, every other method a 405. No request reaches the engine, so no
cluster secret is asked for, as for the other roles' ``/health`` and ``/metrics``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest

from jaxserve.server.metrics import CONTENT_TYPE, EngineStatsCollector


class ProbeServer:
    """``/health``, ``/live`` and ``/metrics`` on a thread of its own (module docstring): ``stats()`` the engine's
    latest stats, ``intake_length()`` the requests not yet taken by its thread, ``healthy()`` whether it serves."""

    def __init__(self, host: str, port: int, *, stats: Callable[[], dict | None], intake_length: Callable[[], int],
                 healthy: Callable[[], bool], model_name: str = ""):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(EngineStatsCollector(stats, intake_length, model_name))

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802 - the stdlib's name
                path = self.path.split("?", 1)[0]
                if path == "/health":
                    ok = healthy()
                    self._answer(200 if ok else 503, json.dumps({"status": "ok" if ok else "unavailable"}).encode())
                elif path == "/live":
                    self._answer(200, b'{"status": "live"}')
                elif path == "/metrics":
                    self._answer(200, generate_latest(registry), CONTENT_TYPE)
                else:
                    self._answer(404, b'{"error": "not found"}')

            def _refuse(self):
                self._answer(405, b'{"error": "method not allowed"}')

            do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815

            def log_message(self, *args):  # probes every few seconds: not a log line each
                pass

        family = ThreadingHTTPServer
        if ":" in host:
            import socket

            family = type("ThreadingHTTPServer6", (ThreadingHTTPServer,), {"address_family": socket.AF_INET6})
        self._http = family((host, port), Handler)
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        self.url = f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self._http.serve_forever, name="prefill-probes", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()
