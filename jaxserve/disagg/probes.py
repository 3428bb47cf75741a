"""The prefill process's probes and metrics over HTTP (``--host:--http-port``), so Kubernetes can probe it as it
probes the other roles and Prometheus can scrape it: ``GET /health`` (200 while its engine thread serves, else
503), ``GET /live`` (200 while the process answers) and ``GET /metrics`` (vLLM's names for what a prefill process
does, from its engine's latest stats: running and waiting requests, KV-cache usage, prefix-cache queries and
hits, preemptions). Nothing else is served: every other path is a 404, every other method a 405. No request
reaches the engine, so no cluster secret is asked for, as for the other roles' ``/health`` and ``/metrics``.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _StatsCollector:
    """vLLM's metric names over a stats dict read at each scrape (``stats()``), labelled ``model_name``."""

    def __init__(self, stats, model_name: str):
        self.stats, self.model_name = stats, model_name

    def collect(self):
        s = self.stats()
        labels = ["model_name"]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self.model_name], float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self.model_name], float(value))
            return c

        used = s.get("pages_used", 0) / max(s.get("num_pages", 0) or 1, 1)
        yield gauge("vllm:num_requests_running", "Requests being prefilled.", s.get("num_running", 0))
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be prefilled.", s.get("num_waiting", 0))
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of the KV-cache pages in use (1 = 100%).", used)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.get("prefix_cache_queries", 0))
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      s.get("prefix_cache_hits", 0))
        yield counter("vllm:num_preemptions", "Sequences preempted for room.", s.get("num_preemptions", 0))


class ProbeServer:
    """``/health``, ``/live`` and ``/metrics`` of a ``PrefillServer`` on a thread of its own (module docstring)."""

    def __init__(self, host: str, port: int, prefill, model_names: list[str] | None = None):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_StatsCollector(lambda: prefill.stats, (model_names or ["model"])[0]))
        healthy = lambda: prefill.healthy  # noqa: E731

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
