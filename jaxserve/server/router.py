"""A front door over several decode processes: ``jaxserve serve --role router --decode-url H:HTTP:GRPC[,...]``.

The router runs no engine. It serves the same OpenAI HTTP API and gRPC ``jaxserve.v1.JaxServe`` service as a
server, and forwards each request, unchanged, to one live decode process (the one with the fewest requests the
router has in flight there; ties go round robin). HTTP is relayed with httpx (a streamed response chunk by
chunk), gRPC with raw-bytes calls on the decode process's own method names, so no message is re-encoded.
A client that goes away closes the forwarded call, and the decode process aborts the request.

Liveness: every decode process's ``/health`` is probed (every ``PROBE_S`` seconds while it is live); one that
cannot be reached, answers anything but 200, or fails a forwarded call is out of rotation until a probe finds it
healthy again, probes backing off from ``BACKOFF_MIN_S`` to ``BACKOFF_MAX_S`` (one that answers "not ready",
e.g. starting, draining, or without a reachable prefill server, is probed every ``UNREADY_PROBE_S``).

A request refused before its first byte moves to another live process: one that could not connect (refused,
or a kept-alive connection the server closed before answering), and one the process answered 503 (shutting
down, starting, no prefill server: it was never admitted, and the process leaves the rotation until a probe
finds it ready) or 429 (overloaded); gRPC likewise for UNAVAILABLE and RESOURCE_EXHAUSTED before the first
message. So a rolling restart of the decode processes loses no request while one of them is live.

Routing (``--routing``): ``least-loaded`` (the default) as above; ``prefix``: the router follows each decode
process's KV-cache events (``--kv-events-url``, ``jaxserve/server/prefix_index.py``), computes the page hashes
of a request's prompt (token ids as given, or text and chat messages through ``--tokenizer``), and sends it to
the live process holding the longest cached prefix, unless that one has more than ``PREFIX_LOAD_SLACK`` requests
in flight beyond the least loaded (then, and with no page cached anywhere, least loaded).

A process that dies with requests in flight turns them into errors naming it:
HTTP 500 (or, once a stream has started, an ``error`` event and ``[DONE]``), gRPC UNAVAILABLE. With no live
process the router answers 503 / UNAVAILABLE ``no decode server is reachable (...)`` with each one's reason.

Checks before work: the router forwards only the public API's routes (``PUBLIC_ROUTES``; the admin routes only
with ``--enable-admin-endpoints`` or vLLM's variables, as on a server), every other path is a 404 here; with its
own ``--api-key`` a request under ``/v1`` without one of the keys (vLLM's rule, ``access.needs_api_key``) is a
401 / UNAUTHENTICATED before its body is read, tokenized or rendered through a chat template (an admin route
needs ``--admin-api-key`` instead). Calls to a decode process
have finite timeouts: ``--router-connect-timeout`` to connect, ``--router-read-timeout`` for each wait on it (its
answer, or the next chunk of a stream); one that stops answering ends the request with 504 (an ``error`` event
once a stream has started), gRPC DEADLINE_EXCEEDED, naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import signal
import time

import grpc
import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import jaxserve
from jaxserve.config.network import ClusterSecurity
from jaxserve.scheduler.block_hash import DEFAULT_HASH_ALGO, BlockHasher
from jaxserve.server import prefix_index
from jaxserve.server.access import AdminConfig, api_keys, matching_key, matching_token, needs_api_key
from jaxserve.server.connections import ConnectionLimits, uvicorn_config
from jaxserve.server.metrics import CONTENT_TYPE
from jaxserve.server.openai.streaming import DONE, EventStream, error_body, sse, until_disconnect

logger = logging.getLogger("jaxserve.server.router")

SERVICE = "jaxserve.v1.JaxServe"
PROBE_S = 1.0
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 8.0
UNREADY_PROBE_S = 0.2
PREFIX_LOAD_SLACK = 2  # --routing prefix: requests in flight a cache holder may carry beyond the least loaded
CONNECT_TIMEOUT_S = 5.0  # --router-connect-timeout
READ_TIMEOUT_S = 600.0  # --router-read-timeout
# The OpenAI front end's routes that the router forwards (method, path); the admin routes only when enabled.
PUBLIC_ROUTES = (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                 ("POST", "/v1/responses"), ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
                 ("POST", "/tokenize"), ("POST", "/detokenize"))
# The Messages API's routes take the key as Anthropic's clients send it too (``x-api-key``), as the replicas do.
X_API_KEY_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")
_FORWARDED_HEADERS = ("authorization", "content-type", "accept", "x-api-key", "anthropic-version", "anthropic-beta")
_METADATA = ("authorization",)


def parse_decode_urls(spec: str) -> list[tuple[str, str]]:
    """``HOST:HTTP_PORT:GRPC_PORT[,...]`` (IPv6 hosts in brackets) -> [(http base URL, gRPC target)]."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        host, sep, ports = item.rpartition("]") if item.startswith("[") else ("", "", item)
        parts = (ports.lstrip(":") if sep else ports).split(":")
        host = host + "]" if sep else None
        if host is None:
            if len(parts) != 3:
                raise ValueError(f"--decode-url {item!r}: expected HOST:HTTP_PORT:GRPC_PORT")
            host, parts = parts[0], parts[1:]
        if len(parts) != 2 or not host or not all(p.isdigit() and 0 < int(p) <= 65535 for p in parts):
            raise ValueError(f"--decode-url {item!r}: expected HOST:HTTP_PORT:GRPC_PORT (ports in 1..65535)")
        out.append((f"http://{host}:{parts[0]}", f"{host}:{parts[1]}"))
    if len({u for u, _ in out}) != len(out):
        raise ValueError(f"--decode-url {spec!r} names a decode server twice")
    return out


class NoBackend(Exception):
    """No decode server is live; the message has each one's reason."""


class Backend:
    """One decode process: its addresses, liveness and the router's requests in flight there."""

    def __init__(self, http: str, grpc_target: str, cluster: ClusterSecurity | None = None):
        cluster = cluster or ClusterSecurity()
        self.name = http.removeprefix("http://")
        self.http = "https://" + self.name if cluster.tls else http  # cluster TLS: the replicas' --ssl-* ports
        self.grpc_target = grpc_target
        self.live = False
        self.reason = "not probed yet"
        self.in_flight = 0
        self.next_probe = 0.0
        self.backoff = BACKOFF_MIN_S
        self.channel = cluster.channel(grpc_target, aio=True)

    def method(self, name: str, stream: bool):
        kind = self.channel.unary_stream if stream else self.channel.unary_unary
        return kind(f"/{SERVICE}/{name}", request_serializer=None, response_deserializer=None)


class Pool:
    """The decode processes, their liveness and the router's counters."""

    def __init__(self, urls: list[tuple[str, str]], registry: CollectorRegistry,
                 cluster: ClusterSecurity | None = None):
        self.backends = [Backend(h, g, cluster) for h, g in urls]
        self._rr = itertools.count()
        names = [b.name for b in self.backends]
        self.requests = Counter("jaxserve_router_requests", "Requests forwarded, by decode server, API and outcome "
                                "(ok: answered 2xx / OK; refused: answered with an error status; failed: the "
                                "server failed or died in flight).", ["server", "api", "outcome"], registry=registry)
        self.failovers = Counter("jaxserve_router_failovers", "Requests moved to another decode server because "
                                 "this one could not be reached.", ["server"], registry=registry)
        self.retries = Counter("jaxserve_router_retries", "Requests moved to another decode server because this "
                               "one refused them before admitting them (shutting down, starting, no prefill "
                               "server, overloaded).", ["server"], registry=registry)
        self.rejected = Counter("jaxserve_router_rejected", "Requests answered 503 / UNAVAILABLE: no decode server "
                                "was live.", ["api"], registry=registry)
        self.prefix_routed = Counter("jaxserve_router_prefix_routed", "Requests sent to a decode server for the "
                                     "prompt pages it holds cached (--routing prefix).", ["server"],
                                     registry=registry)
        self.in_flight = Gauge("jaxserve_router_in_flight", "Requests in flight at each decode server.", ["server"],
                               registry=registry)
        self.up = Gauge("jaxserve_router_server_up", "1 while a decode server is in rotation.", ["server"],
                        registry=registry)
        self.live_count = Gauge("jaxserve_router_servers_live", "Decode servers in rotation.", registry=registry)
        for n in names:
            self.up.labels(n).set(0)
            self.in_flight.labels(n).set(0)
        self.live_count.set(0)

    def live(self) -> list[Backend]:
        return [b for b in self.backends if b.live]

    def reasons(self) -> str:
        return "; ".join(f"{b.name}: {b.reason}" for b in self.backends)

    def pick(self, api: str, exclude: set[str] = frozenset(), cached=None) -> Backend:
        """The live process with the fewest requests in flight; with ``cached`` (name -> leading pages of the
        request's prompt it holds), the one holding the most, within ``PREFIX_LOAD_SLACK`` of the least loaded."""
        live = [b for b in self.live() if b.name not in exclude]
        if not live:
            self.rejected.labels(api).inc()
            raise NoBackend(f"no decode server is reachable ({self.reasons()})")
        start = next(self._rr)
        order = [live[(start + i) % len(live)] for i in range(len(live))]
        least = min(order, key=lambda b: b.in_flight)  # min keeps the first of equals: round robin among them
        if cached:
            near = [b for b in order if b.in_flight <= least.in_flight + PREFIX_LOAD_SLACK]
            best = max(near, key=lambda b: (cached(b.name), -b.in_flight))
            if cached(best.name) > 0:
                self.prefix_routed.labels(best.name).inc()
                return best
        return least

    @contextlib.contextmanager
    def use(self, b: Backend):
        b.in_flight += 1
        self.in_flight.labels(b.name).set(b.in_flight)
        try:
            yield
        finally:
            b.in_flight -= 1
            self.in_flight.labels(b.name).set(b.in_flight)

    def set_live(self, b: Backend) -> None:
        if not b.live:
            logger.info("decode server %s is live", b.name)
        b.live, b.reason, b.backoff = True, "ok", BACKOFF_MIN_S
        b.next_probe = time.monotonic() + PROBE_S
        self._publish()

    def set_dead(self, b: Backend, reason: str, *, reachable: bool = False) -> None:
        """Out of rotation until a probe finds it healthy; ``reachable`` (it answered, e.g. still starting):
        probed again soon, without growing the back-off."""
        if b.live:
            logger.warning("decode server %s is out of rotation: %s", b.name, reason)
        b.live, b.reason = False, reason
        b.next_probe = time.monotonic() + (UNREADY_PROBE_S if reachable else b.backoff)
        if not reachable:
            b.backoff = min(2 * b.backoff, BACKOFF_MAX_S)
        self._publish()

    def _publish(self) -> None:
        for b in self.backends:
            self.up.labels(b.name).set(1 if b.live else 0)
        self.live_count.set(len(self.live()))

    async def probe_forever(self, client: httpx.AsyncClient) -> None:
        while True:
            now = time.monotonic()
            due = [b for b in self.backends if b.next_probe <= now]
            await asyncio.gather(*(self._probe(client, b) for b in due))
            await asyncio.sleep(0.1)

    async def _probe(self, client: httpx.AsyncClient, b: Backend) -> None:
        b.next_probe = float("inf")  # one probe at a time
        try:
            r = await client.get(b.http + "/health", timeout=2.0)
        except httpx.HTTPError as e:
            self.set_dead(b, _reason(e))
            return
        if r.status_code == 200:
            self.set_live(b)
        else:
            try:
                status = r.json().get("status", r.text)
            except ValueError:
                status = r.text[:200]
            self.set_dead(b, f"health {r.status_code} ({status})", reachable=True)


def _error_body(message: str, status: int) -> dict:
    return error_body(message, "service_unavailable" if status == 503 else "internal_error", status)


class Router:
    """The HTTP app and the gRPC server over a ``Pool``."""

    def __init__(self, urls: list[tuple[str, str]], *, max_body_bytes: int = 4 * 2**20,
                 prefix_index=None, tokenizer=None, cluster: ClusterSecurity | None = None, api_key=None,
                 admin: AdminConfig | None = None, connect_timeout: float = CONNECT_TIMEOUT_S,
                 read_timeout: float = READ_TIMEOUT_S):
        self.registry = CollectorRegistry()
        self.cluster = cluster or ClusterSecurity()  # its secret goes with every call to a replica, its TLS too
        self.pool = Pool(urls, self.registry, self.cluster)
        self.max_body_bytes = max_body_bytes
        self.index = prefix_index  # a PrefixIndex: --routing prefix
        self.tokenizer = tokenizer  # tokenizes text prompts for it (token-id prompts need none)
        self.api_keys = api_keys(api_key)  # the router's own --api-key
        self.admin = admin or AdminConfig()
        self.read_timeout = read_timeout
        # read: each wait for bytes from the decode server (a stream's next chunk, or a whole unstreamed answer);
        # the cluster secret goes with every call, as a default header
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(read_timeout, connect=connect_timeout),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                                        headers=dict(self.cluster.metadata()),
                                        verify=self.cluster.client_ssl_context() or True)

    def _outgoing_headers(self, incoming) -> dict[str, str]:
        """The headers of a call to a decode server (HTTP), or its metadata (gRPC), from the client's: the one
        place they are built."""
        return {k.lower(): v for k, v in incoming if k.lower() in _FORWARDED_HEADERS}

    def _refusal(self, method: str, path: str, authorization: str | None,
                 x_api_key: str | None = None) -> tuple[int, str] | None:
        """(status, message) if the router refuses the call before doing anything for it, else None."""
        admin = (method, path) in self.admin.routes()
        if not admin and (method, path) not in PUBLIC_ROUTES:
            return 404, f"no route {method} {path}"
        if admin and not self.admin.authorized(authorization):
            return 401, "missing or invalid admin key: send 'Authorization: Bearer <admin key>'"
        if not admin and self.api_keys and needs_api_key(path) and matching_key(authorization, self.api_keys) is None:
            if path in X_API_KEY_ROUTES and matching_token(x_api_key, self.api_keys) is not None:
                return None
            return 401, "missing or invalid API key: send 'Authorization: Bearer <key>'" + (
                " or 'x-api-key: <key>'" if path in X_API_KEY_ROUTES else "")
        return None

    def failed(self, b: Backend, reason: str, api: str) -> str:
        """A forwarded call failed in flight: the server leaves the rotation; the client's error names it."""
        self.pool.set_dead(b, reason)
        self.pool.requests.labels(b.name, api, "failed").inc()
        return f"the decode server {b.name} failed while serving this request ({reason})"

    # HTTP ----------------------------------------------------------------------------------------------------
    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/live", lambda request: JSONResponse({"status": "live"}), methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/version", lambda request: JSONResponse({"version": jaxserve.__version__}), methods=["GET"]),
            Route("/{path:path}", self.forward, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]),
        ])

    async def health(self, request: Request) -> Response:
        live = [b.name for b in self.pool.live()]
        if live:
            return JSONResponse({"status": "ok", "decode_servers_live": live})
        return JSONResponse({"status": f"no decode server is reachable ({self.pool.reasons()})"}, status_code=503)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE)

    async def _body(self, request: Request) -> bytes | Response:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                return JSONResponse(error_body(f"the request body is over the limit of {self.max_body_bytes} bytes",
                                               "invalid_request_error", 400), status_code=400)
            chunks.append(chunk)
        return b"".join(chunks)

    async def forward(self, request: Request) -> Response:
        refused = self._refusal(request.method, request.url.path, request.headers.get("authorization"),
                                request.headers.get("x-api-key"))
        if refused is not None:
            status, message = refused
            kind = "authentication_error" if status == 401 else "invalid_request_error"
            return JSONResponse(error_body(message, kind, status), status_code=status,
                                headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        headers = self._outgoing_headers(request.headers.items())
        tried: set[str] = set()
        overloaded = None  # the last 429 answer: passed on if no process admits the request
        cached = await self._cached_pages(request.url.path, body) if self.index is not None else None
        while True:
            try:
                b = self.pool.pick("http", tried, cached)
            except NoBackend as e:
                if overloaded is not None:
                    return overloaded
                return JSONResponse(_error_body(str(e), 503), status_code=503)
            use = self.pool.use(b)
            use.__enter__()
            upstream, handed_off = None, False
            try:
                req = self.client.build_request(request.method, b.http + request.url.path,
                                                params=request.query_params, headers=headers, content=body)
                upstream = await until_disconnect(request.receive, self.client.send(req, stream=True),
                                                  discard=lambda late: late.aclose())
                if upstream is None:  # the client went away first
                    return Response(status_code=499)
                if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                    handed_off = True
                    return self._relay(b, upstream, use)  # it closes ``upstream`` and releases ``use``
                content = await until_disconnect(request.receive, upstream.aread())
                if content is None:
                    return Response(status_code=499)
                self.pool.requests.labels(b.name, "http", "ok" if upstream.status_code < 400 else "refused").inc()
                answer = Response(content, status_code=upstream.status_code,
                                  media_type=upstream.headers.get("content-type"))
                if upstream.status_code in (429, 503):  # not admitted there: another one takes it
                    if upstream.status_code == 503:
                        self.pool.set_dead(b, f"503: {_message(content)}", reachable=True)
                    else:
                        overloaded = answer
                    self.pool.retries.labels(b.name).inc()
                    tried.add(b.name)
                    continue
                return answer
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # never reached it: another one takes it
                self.pool.set_dead(b, _reason(e))
                self.pool.failovers.labels(b.name).inc()
                tried.add(b.name)
            except httpx.TimeoutException as e:  # connected, then it stopped answering
                message = self.failed(b, f"nothing for {self.read_timeout:g}s (--router-read-timeout): "
                                         f"{_reason(e)}", "http")
                return JSONResponse(error_body(message, "timeout", 504), status_code=504)
            except httpx.TransportError as e:
                if upstream is not None:
                    return JSONResponse(_error_body(self.failed(b, _reason(e), "http"), 500), status_code=500)
                # Nothing came back: a kept-alive connection the server closed (it is stopping) before it read the
                # request, or a connection reset (the process died under it). Another one takes the request.
                if not isinstance(e, httpx.RemoteProtocolError):
                    self.pool.set_dead(b, _reason(e))
                self.pool.failovers.labels(b.name).inc()
                tried.add(b.name)
            finally:
                if not handed_off:
                    if upstream is not None:
                        await upstream.aclose()
                    use.__exit__(None, None, None)

    def _relay(self, b: Backend, upstream: httpx.Response, use) -> EventStream:
        """The decode server's streamed response, chunk by chunk; if the server fails mid-stream, an ``error``
        event and ``[DONE]`` end it. The upstream response is closed however this ends (a client that goes away
        included), which aborts the request there, and ``use`` (the request in flight there) released."""
        async def chunks():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
                self.pool.requests.labels(b.name, "http", "ok").inc()
            except httpx.TimeoutException as e:
                reason = f"nothing for {self.read_timeout:g}s (--router-read-timeout): {_reason(e)}"
                yield sse(error_body(self.failed(b, reason, "http"), "timeout", 504)) + DONE
            except httpx.TransportError as e:
                yield sse(_error_body(self.failed(b, _reason(e), "http"), 500)) + DONE

        async def close():
            await upstream.aclose()
            use.__exit__(None, None, None)

        headers = [(k.encode(), v.encode()) for k, v in upstream.headers.items()
                   if k.lower() in ("content-type", "cache-control", "x-accel-buffering")]
        return EventStream(chunks(), close, status_code=upstream.status_code, headers=headers)

    async def _cached_pages(self, path: str, body: bytes):
        """``name -> leading pages of this request's prompt that process holds``, or None (not a generation
        request, no page size known yet, or a text prompt without a tokenizer)."""
        page_size = self.index.page_size
        if page_size is None or path not in ("/v1/completions", "/v1/chat/completions"):
            return None
        try:
            req = json.loads(body)
            ids = await self._prompt_ids(req)
        except Exception:  # noqa: BLE001 - the decode server answers a bad request; routing just falls back
            return None
        if not ids:
            return None
        salt = req.get("cache_salt")
        hashes = self.index.prompt_hashes(ids, page_size, salt if isinstance(salt, str) else None)
        return lambda name: self.index.longest_prefix(name, hashes)

    async def _prompt_ids(self, req: dict) -> list[int] | None:
        prompt = req.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        if self.tokenizer is None:
            return None
        if isinstance(prompt, str):
            return await asyncio.to_thread(self.tokenizer.encode, prompt)
        messages = req.get("messages")
        if isinstance(messages, list) and messages:
            from jaxserve.text.tokenizer import chat_template_ids

            return await asyncio.to_thread(
                chat_template_ids, self.tokenizer, messages, req.get("add_generation_prompt", True),
                continue_final_message=bool(req.get("continue_final_message")), tools=req.get("tools"),
                chat_template_kwargs=req.get("chat_template_kwargs"))
        return None

    # gRPC ----------------------------------------------------------------------------------------------------
    def grpc_server(self, max_message_bytes: int, connections: ConnectionLimits | None = None) -> grpc.aio.Server:
        from grpc_health.v1 import health_pb2_grpc
        from grpc_health.v1._async import HealthServicer

        connections = connections or ConnectionLimits()
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes),
                                          ("grpc.so_reuseport", 0), *connections.grpc_options()],
                                 maximum_concurrent_rpcs=connections.max_concurrent_rpcs)
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(self._generate),
            "Tokenize": grpc.unary_unary_rpc_method_handler(self._tokenize),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(self._model_info),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.grpc_health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.grpc_health, server)
        return server

    async def set_health(self) -> None:
        from grpc_health.v1 import health_pb2

        status = health_pb2.HealthCheckResponse.SERVING if self.pool.live() else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE):
            await self.grpc_health.set(service, status)

    def _metadata(self, context) -> tuple:
        return tuple((k, v) for k, v in self._outgoing_headers(context.invocation_metadata() or ()).items()
                     if k in _METADATA) + self.cluster.metadata()

    async def _check_grpc(self, context) -> None:
        """The router's API key, before anything is done for the call."""
        if self.api_keys:
            metadata = dict(context.invocation_metadata() or ())
            if matching_key(metadata.get("authorization"), self.api_keys) is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                    "missing or invalid API key: send metadata 'authorization: Bearer <key>'")

    async def _call(self, name: str, stream: bool, request: bytes, context, cached=None):
        """Yields the decode server's responses to the call (one for a unary method)."""
        tried: set[str] = set()
        overloaded = None  # the last RESOURCE_EXHAUSTED details: passed on if no process admits the request
        while True:
            try:
                b = self.pool.pick("grpc", tried, cached)
            except NoBackend as e:
                if overloaded is not None:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, overloaded)
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            received = False
            with self.pool.use(b):
                call = b.method(name, stream)(request, metadata=self._metadata(context))
                try:
                    if stream:
                        while True:  # each message within the read timeout
                            msg = await asyncio.wait_for(call.read(), self.read_timeout)
                            if msg is grpc.aio.EOF:
                                break
                            received = True
                            yield msg
                    else:
                        yield await asyncio.wait_for(call, self.read_timeout)
                    self.pool.requests.labels(b.name, "grpc", "ok").inc()
                    return
                except TimeoutError:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, self.failed(
                        b, f"nothing for {self.read_timeout:g}s (--router-read-timeout)", "grpc"))
                except grpc.aio.AioRpcError as e:
                    code, details = e.code(), e.details() or ""
                    if code == grpc.StatusCode.UNAVAILABLE and not received and _never_connected(details):
                        self.pool.set_dead(b, f"UNAVAILABLE: {details}")
                        self.pool.failovers.labels(b.name).inc()
                        tried.add(b.name)
                        continue
                    if not received and (code == grpc.StatusCode.RESOURCE_EXHAUSTED or (
                            code == grpc.StatusCode.UNAVAILABLE and _not_admitted(details))):
                        if code == grpc.StatusCode.UNAVAILABLE:  # not ready there: another one takes it
                            self.pool.set_dead(b, f"UNAVAILABLE: {details}", reachable=True)
                        else:
                            overloaded = details
                        self.pool.retries.labels(b.name).inc()
                        tried.add(b.name)
                        continue
                    if code == grpc.StatusCode.UNAVAILABLE and "shutting down" not in details \
                            and "no prefill server" not in details:
                        await context.abort(code, self.failed(b, f"UNAVAILABLE: {details}", "grpc"))
                    self.pool.requests.labels(b.name, "grpc", "refused").inc()
                    await context.abort(code, details)  # the decode server's own answer, passed through
                finally:
                    call.cancel()  # no-op once done; on the client's cancellation it aborts the request there

    async def _generate(self, request: bytes, context):
        await self._check_grpc(context)  # before the prompt is tokenized for routing
        async for msg in self._call("Generate", True, request, context, await self._grpc_cached_pages(request)):
            yield msg

    async def _grpc_cached_pages(self, request: bytes):
        """As ``_cached_pages``, for a ``GenerateRequest`` (decoded here only to read its prompt)."""
        if self.index is None or self.index.page_size is None:
            return None
        from jaxserve.server.protos import jaxserve_pb2 as pb

        try:
            req = pb.GenerateRequest.FromString(request)
        except Exception:  # noqa: BLE001 - the decode server answers a malformed request
            return None
        which = req.WhichOneof("prompt")
        if which == "token_ids":
            ids = list(req.token_ids.ids)
        elif which == "text" and self.tokenizer is not None:
            ids = await asyncio.to_thread(self.tokenizer.encode, req.text)
        else:
            return None
        hashes = self.index.prompt_hashes(ids, self.index.page_size,
                                          req.cache_salt if req.HasField("cache_salt") else None)
        return lambda name: self.index.longest_prefix(name, hashes)

    async def _tokenize(self, request: bytes, context):
        await self._check_grpc(context)
        return [m async for m in self._call("Tokenize", False, request, context)][0]

    async def _model_info(self, request: bytes, context):
        await self._check_grpc(context)
        return [m async for m in self._call("GetModelInfo", False, request, context)][0]

    async def aclose(self) -> None:
        await self.client.aclose()
        for b in self.pool.backends:
            await b.channel.close()


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _not_admitted(details: str) -> bool:
    """A decode server's UNAVAILABLE refusal of a request it never admitted."""
    d = details.lower()
    return "shutting down" in d or "starting up" in d or "failed to start" in d or "no prefill server" in d


def _message(content: bytes) -> str:
    """The error message of a JSON error body (the body itself, cut short, if it is not one)."""
    try:
        return str(json.loads(content)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return content[:200].decode("utf-8", "replace")


def _never_connected(details: str) -> bool:
    d = details.lower()
    return "failed to connect" in d or "connection refused" in d or "connect failed" in d


async def run_router(args) -> int:
    """``jaxserve serve --role router``: serve until SIGTERM/SIGINT; returns the exit code."""
    import socket

    import uvicorn

    class _UvicornServer(uvicorn.Server):  # in our event loop; our signal handlers decide when it stops
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    def _url(host: str, port: int) -> str:
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per forwarded request and probe
    urls = parse_decode_urls(args.decode_url)
    index, tokenizer = None, None
    if getattr(args, "routing", "least-loaded") == "prefix":
        names = [h.removeprefix("http://") for h, _ in urls]
        pubs = args.kv_events_url.split(",")
        replays = args.kv_events_replay_url.split(",") if args.kv_events_replay_url else [None] * len(names)
        engine_config = getattr(args, "engine_config", None)  # --prefix-caching-hash-algo: the replicas' choice
        hasher = BlockHasher(getattr(engine_config, "prefix_caching_hash_algo", DEFAULT_HASH_ALGO))
        index = prefix_index.PrefixIndex(dict(zip(names, pubs)), dict(zip(names, replays)), hasher=hasher)
        if args.tokenizer:
            from jaxserve.text.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(args.tokenizer)
    router = Router(urls, max_body_bytes=args.max_request_bytes, prefix_index=index, tokenizer=tokenizer,
                    cluster=getattr(args, "cluster", None), api_key=args.api_key, admin=getattr(args, "admin", None),
                    connect_timeout=getattr(args, "router_connect_timeout", CONNECT_TIMEOUT_S),
                    read_timeout=getattr(args, "router_read_timeout", READ_TIMEOUT_S))
    tls = getattr(args, "tls", None)
    grpc_server = router.grpc_server(args.max_request_bytes, getattr(args, "connections", None))
    try:
        grpc_port = (grpc_server.add_secure_port(_url(args.host, args.grpc_port), tls.grpc_credentials())
                     if tls is not None else grpc_server.add_insecure_port(_url(args.host, args.grpc_port)))
        if not grpc_port:
            raise OSError("the gRPC port is taken")
        http_sock = socket.create_server((args.host, args.http_port), reuse_port=False, backlog=2048,
                                         family=socket.AF_INET6 if ":" in args.host else socket.AF_INET)
        http_sock.setblocking(False)
    except (OSError, RuntimeError) as e:
        logger.error("cannot listen on %s (HTTP port %d, gRPC port %d): %s", args.host, args.http_port,
                     args.grpc_port, e)
        return 1
    http_port = http_sock.getsockname()[1]
    # On SIGTERM, in-flight requests have the whole --shutdown-grace-period to finish (uvicorn's own 5 s cut them)
    http_server = _UvicornServer(uvicorn_config(router.app(), getattr(args, "connections", None), tls,
                                                grace_s=args.shutdown_grace_period,
                                                root_path=getattr(args, "root_path", None),
                                                log_level=getattr(args, "uvicorn_log_level", None)))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await grpc_server.start()
    await router.set_health()
    http_task = asyncio.create_task(http_server.serve(sockets=[http_sock]))
    probe_task = asyncio.create_task(router.pool.probe_forever(router.client))
    index_task = asyncio.create_task(index.run()) if index is not None else None

    async def health_forever():
        while True:
            await router.set_health()
            await asyncio.sleep(0.2)

    health_task = asyncio.create_task(health_forever())
    logger.info("routing: HTTP on %s and gRPC on %s, to %d decode server(s); ready once one is live",
                _url(args.host, http_port), _url(args.host, grpc_port), len(router.pool.backends))
    while not router.pool.live() and not stop.is_set() and not http_task.done():
        await asyncio.sleep(0.1)
    if router.pool.live():
        print(f"jaxserve ready: router http={'https' if tls else 'http'}://{_url(args.host, http_port)} "
              f"grpc={_url(args.host, grpc_port)} "
              f"decode={','.join(b.name for b in router.pool.backends)}", flush=True)
        await asyncio.wait({asyncio.ensure_future(stop.wait()), http_task}, return_when=asyncio.FIRST_COMPLETED)
    logger.info("stopping the router: in-flight requests have %.0f s to finish", args.shutdown_grace_period)
    http_server.should_exit = True  # both front ends drain at once, each within the grace period
    with contextlib.suppress(Exception):
        await asyncio.gather(grpc_server.stop(grace=args.shutdown_grace_period), http_task)
    tasks = [t for t in (probe_task, health_task, index_task) if t is not None]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await router.aclose()
    logger.info("stopped")
    return 0
