"""The prefill process of disaggregation across processes: ``jaxserve serve --role prefill``.

A prefill process (``--role prefill --kv-port P``) runs an engine on its own devices and serves one gRPC method
(``jaxserve.disagg.wire``): given a prompt, its sampling parameters and the request's index, it runs the prompt
(chunked, with prefix caching), samples the first token exactly as the colocated engine would, and streams back a
JSON header (the token, its logprobs and prompt logprobs, a finish reason if the token ended the request, the KV
layout). The pages are read out of its pool with one gather and freed once it has run; then either offered to
JAX's transfer server, the header naming the offer (``jaxserve/disagg/kv_transfer.py``, when both sides run one:
``--kv-transfer``), or copied to the host and streamed after the header in chunks of at most ``CHUNK_BYTES``.
A cancelled call aborts its request and frees its pages. The decode side is ``jaxserve.disagg.remote``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import queue
import threading
from collections.abc import Callable

import jax
import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.config.network import ClusterSecurity
from jaxserve.disagg.wire import CHUNK_BYTES, SERVICE, identity, kv_layout, output_header, params_from_json
from jaxserve.engine.engine import Engine
from jaxserve.engine.request_stream import take_all
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class PrefillEngine(Engine):
    """An ``Engine`` that only prefills: after each step, sequences whose first token was sampled (and that it
    did not finish) leave it with their KV pages (``step_prefill`` returns them as hand-offs): offered to JAX's
    transfer server (``transfer``) for requests whose decode side pulls them, else as NumPy bytes."""

    steps_async = False  # a sequence leaves once its first token is on the host, before any further step

    def __init__(self, config: EngineConfig, *, transfer: Callable[[], object | None] | None = None, **kwargs):
        """``transfer``: starts the transfer server (a ``JaxTransfer``, or None for none) once the engine is built;
        the other options are the ``Engine``'s."""
        if config.speculative_config is not None:
            raise ValueError("speculative_config: speculation verifies decodes, which run on the decode side; start "
                             "the prefill process without --speculative-config")
        super().__init__(config, **kwargs)
        self.reader = self.executor.kv_pages
        self.transfer = None if transfer is None else transfer()  # a JaxTransfer, or None: pages go as bytes
        self._pulled: set[str] = set()  # request ids whose pages the decode side pulls through it
        self.stats_counters.update(kv_transfer_offers=0)

    def add_prefill(self, request_id: str, ids: list[int], params: SamplingParams, request_index: int,
                    pull: bool = False) -> None:
        if params.n != 1:  # the decode process sends each of a request's n outputs as its own call
            raise ValueError(f"n={params.n}: a prefill process serves one sequence per request")
        self.add_request(request_id, ids, params)
        for seq in self.scheduler.get_request(request_id):
            seq.request_index = request_index  # the decode side's: seeds of unseeded sampling depend on it
        if pull and self.transfer is not None:
            self._pulled.add(request_id)

    def abort_request(self, request_id: str, reason: str = "abort", **kwargs):
        self._pulled.discard(request_id)
        return super().abort_request(request_id, reason, **kwargs)

    def step_prefill(self) -> tuple[list[RequestOutput], list[tuple[str, dict, bytes]]]:
        outputs = self.step()
        handoffs = []
        for out in outputs:
            if out.finished:
                continue
            req = self._requests[out.request_id]
            seq = req.seqs[0]
            replica, holder = self.scheduler.detach(seq)
            staged, full, local, nbytes = self.reader.read(replica, holder, seq.num_computed_tokens)
            pull = out.request_id in self._pulled
            self._pulled.discard(out.request_id)
            if pull:
                jax.block_until_ready(staged)  # the gather has run: its copy no longer needs the pool ...
            else:
                staged = [np.ascontiguousarray(np.asarray(a)) for a in staged]  # (or the copy to the host)
            self.scheduler.replicas[replica].block_manager.free(holder)  # ... so the pages are free again
            self.executor.release([seq])
            self.structured.release([seq])
            del self._requests[out.request_id]
            kv = kv_layout(staged, full, local, nbytes, seq.num_cached_tokens)
            if pull:
                kv["pull"] = self.transfer.offer(staged)
                self.stats_counters["kv_transfer_offers"] += 1
                data = b""
            else:
                data = b"".join(a.tobytes() for a in staged)
            handoffs.append((out.request_id, kv, data))
        return outputs, handoffs


class PrefillServer:
    """The prefill process's gRPC service around a ``PrefillEngine`` stepped by one thread."""

    def __init__(self, config: EngineConfig, host: str, port: int, engine_factory=None, kv_transfer: str = "auto",
                 security: ClusterSecurity | None = None):
        """``host``/``port``: where the service (and JAX's transfer server) listen; ``security``: the cluster
        secret every call must carry and the TLS of the port (``--cluster-secret``, ``--cluster-ssl-*``)."""
        import grpc

        from jaxserve.disagg import kv_transfer as kvt
        self.config = config
        security = security or ClusterSecurity()
        self.engine = (engine_factory or PrefillEngine)(
            config, transfer=functools.partial(kvt.start, kv_transfer, host, security))
        self.stats = self.engine.stats()  # the engine's latest, refreshed by its thread after each iteration
        self._intake: queue.Queue = queue.Queue()
        self._streams: dict[str, queue.Queue] = {}
        self._stop = threading.Event()
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            "Run": grpc.unary_stream_rpc_method_handler(self._run, request_deserializer=identity,
                                                        response_serializer=identity),
            "Stats": grpc.unary_unary_rpc_method_handler(
                lambda _req, _ctx: json.dumps(self.stats).encode(), request_deserializer=identity,
                response_serializer=identity)})
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=64),
                                  options=[("grpc.max_send_message_length", 4 * CHUNK_BYTES)],
                                  interceptors=security.interceptors())
        self.server.add_generic_rpc_handlers((handler,))
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        self._health, self._health_pb2 = health.HealthServicer(), health_pb2
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self.server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = security.bind(self.server, address)
        except RuntimeError as e:  # recent grpcio raises where older versions returned 0
            raise OSError(f"cannot listen on {address}: {e}") from None
        if not self.port:
            raise OSError(f"cannot listen on {address}")
        self._thread = threading.Thread(target=self._loop, name="prefill-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self.server.start()
        self._set_health(True)

    def _set_health(self, serving: bool) -> None:
        status = self._health_pb2.HealthCheckResponse.SERVING if serving else \
            self._health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE):
            self._health.set(service, status)

    @property
    def intake_length(self) -> int:
        """Calls handed to the engine thread and not yet taken."""
        return self._intake.qsize()

    @property
    def healthy(self) -> bool:
        """The engine thread is running (a failed step loop ends it)."""
        return self._thread.is_alive() and not self._stop.is_set()

    def stop(self, grace: float = 1.0) -> None:
        self._set_health(False)
        self._stop.set()
        self._intake.put(None)
        self.server.stop(grace).wait()

    def _run(self, request: bytes, context):
        import grpc

        msg = json.loads(request)
        if int(msg.get("engine_seed", self.config.seed)) != self.config.seed:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"engine seed {msg['engine_seed']} differs from this prefill server's --seed "
                          f"{self.config.seed}; start both with the same --seed")
        if msg.get("kv_cache_dtype", "auto") != self.config.kv_cache_dtype:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"kv_cache_dtype {msg.get('kv_cache_dtype', 'auto')!r} differs from this prefill server's "
                          f"--kv-cache-dtype {self.config.kv_cache_dtype!r}; start both with the same one")
        rid = str(msg["request_id"])
        out: queue.Queue = queue.Queue()
        self._intake.put(("add", rid, msg, out))
        context.add_callback(lambda: self._intake.put(("abort", rid, None, None)))
        while True:
            item = out.get()
            if isinstance(item, Exception):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT if isinstance(item, ValueError)
                              else grpc.StatusCode.INTERNAL, str(item))
            if item is None:
                return
            yield item

    def _loop(self) -> None:
        engine = self.engine
        engine.publish_kv_events()  # --kv-events-config: the prefix cache (this side's) is announced from now on
        while not self._stop.is_set():
            if not self._take(take_all(self._intake, not engine.has_unfinished())):
                return
            if not engine.has_unfinished():
                self.stats = engine.stats()
                continue
            try:
                outputs, handoffs = engine.step_prefill()
            except Exception as e:  # noqa: BLE001 - one bad step fails its requests, not the server
                logger.exception("a prefill step failed")
                for rid in list(self._streams):
                    engine.abort_request(rid, "error", error=str(e))
                    self._streams.pop(rid).put(RuntimeError(f"the prefill step failed: {e}"))
                continue
            self._send(outputs, handoffs)
            engine.publish_kv_events()
            self.stats = engine.stats()

    def _take(self, items: list) -> bool:
        """Add the calls' requests, abort those whose callers went away; False once told to stop."""
        for item in items:
            if item is None:
                return False
            kind, rid, msg, out = item
            if kind == "add":
                try:
                    self.engine.add_prefill(rid, [int(t) for t in msg["prompt_token_ids"]],
                                            params_from_json(msg["params"]), int(msg["request_index"]),
                                            pull=msg.get("kv_transfer") == "jax")
                    self._streams[rid] = out
                except Exception as e:  # noqa: BLE001 - reported to the caller
                    out.put(e if isinstance(e, ValueError) else RuntimeError(f"{type(e).__name__}: {e}"))
            elif rid in self._streams:  # the caller went away: free its pages now
                self.engine.abort_request(rid)
                self._streams.pop(rid).put(None)
        return True

    def _send(self, outputs: list[RequestOutput], handoffs: list[tuple[str, dict, bytes]]) -> None:
        """Answer each call whose prefill finished: the header, then the pages' bytes, then the stream's end."""
        kv = {rid: (meta, data) for rid, meta, data in handoffs}
        for o in outputs:
            stream = self._streams.pop(o.request_id, None)
            if stream is None:
                continue
            meta, data = kv.get(o.request_id, (None, b""))
            if meta is None and not o.finished:
                continue
            stream.put(json.dumps(output_header(o, meta)).encode())
            for i in range(0, len(data), CHUNK_BYTES):
                stream.put(data[i:i + CHUNK_BYTES])
            stream.put(None)


def serve_prefill(args, probes: Callable[[PrefillServer], object]) -> int:
    """``jaxserve serve --role prefill``: the prefill service until SIGTERM/SIGINT. ``probes(server)``: its
    ``/health``, ``/live`` and ``/metrics`` (``jaxserve.server.probes.ProbeServer``, which the caller binds to
    ``--host:--http-port``), started with it; an ``OSError`` from it (the port taken) is the exit code 1."""
    import signal

    server = PrefillServer(args.engine_config, args.kv_host, args.kv_port, kv_transfer=args.kv_transfer,
                           security=args.cluster)
    try:
        http = probes(server)
    except OSError as e:
        server.stop()
        logger.error("cannot listen on %s port %d for /health and /metrics: %s", args.host, args.http_port, e)
        return 1
    server.start()
    http.start()
    t = server.engine.transfer
    host = f"[{args.kv_host}]" if ":" in args.kv_host else args.kv_host
    print(f"jaxserve prefill ready: kv=grpc{'s' if args.cluster.tls else ''}://{host}:{server.port} "
          f"transfer={'jax://' + t.address if t else 'grpc'} http={http.url} path={server.engine.model_path}",
          flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    http.stop()
    server.stop()
    return 0
