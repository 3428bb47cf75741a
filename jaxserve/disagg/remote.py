"""Prefill/decode disaggregation across processes: ``jaxserve serve --role prefill`` and ``--role decode``.

A prefill process (``--role prefill --kv-port P``) runs an engine on its own devices and serves one gRPC method,
``jaxserve.disagg.staged.v1.Prefill/Run``: given a prompt, its sampling parameters and the request's index, it runs
the prompt (chunked, with prefix caching), samples the first token exactly as the colocated engine would, and
streams back a JSON header (the token, its logprobs and prompt logprobs, a finish reason if the token ended the
request, the KV layout). The pages are read out of its pool with one gather and freed once it has run; then
either offered to JAX's transfer server, the header naming the offer (``jaxserve/disagg/kv_transfer.py``, when both
sides run one: ``--kv-transfer``), or copied to the host and streamed after the header in chunks of at most
``CHUNK_BYTES``.

The decode process (``--role decode --prefill-url HOST:P[,HOST:P...]``) is the front door: clients speak the
usual OpenAI and gRPC APIs to it. Its engine (``RemotePrefillEngine``) sends each new request to a prefill
process (round robin over the live ones), emits the first token when it arrives, writes the received pages
into its own pool (``PageWriter``: ``jax.device_put`` onto its mesh, one scatter) once it has room, and decodes
with continuous batching. Pulled pages are fetched by the call's receiving thread, before the engine sees them.

Failure and load: a prefill call that fails ends its request with an error naming the prefill server; a
server that cannot be reached is skipped for ``RETRY_DEAD_S`` seconds, and with none left new requests are
refused with 503 ("no prefill server is reachable"). A cancelled request cancels its call, and the prefill
process aborts it and frees its pages. At most ``max_pending_transfers`` prefills are in flight or waiting for
room on the decode side; further requests wait in the decode process's queue (never dropped).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import logging
import queue
import threading
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.disagg.staged import PageReader, PageWriter, StagedEngine
from jaxserve.engine.engine import Engine
from jaxserve.engine.request_stream import EngineNotReady, take_all
from jaxserve.outputs import RequestOutput, TokenRecord
from jaxserve.sampling_params import SamplingParams, sequence_seed
from jaxserve.scheduler.sequence import Sequence
from jaxserve.text.structured_output import StructuredOutputsParams

logger = logging.getLogger(__name__)

METHOD = "/jaxserve.disagg.staged.v1.Prefill/Run"
STATS_METHOD = "/jaxserve.disagg.staged.v1.Prefill/Stats"  # the prefill engine's stats() as JSON
CHUNK_BYTES = 1 << 20
RETRY_DEAD_S = 5.0
_RETRY = object()


def _identity(b: bytes) -> bytes:
    return b


def params_to_json(p: SamplingParams) -> dict:
    d = dataclasses.asdict(p)
    if d.get("logit_bias"):
        d["logit_bias"] = {str(k): v for k, v in d["logit_bias"].items()}
    return d


def params_from_json(d: dict) -> SamplingParams:
    d = dict(d)
    for name in ("stop", "stop_token_ids"):
        d[name] = tuple(d.get(name) or ())
    so = d.get("structured_outputs")
    if so is not None:
        if so.get("choice") is not None:
            so["choice"] = tuple(so["choice"])
        d["structured_outputs"] = StructuredOutputsParams(**so)
    return SamplingParams(**d)


# ---- the prefill process ---------------------------------------------------------------------------------------
class PrefillEngine(Engine):
    """An ``Engine`` that only prefills: after each step, sequences whose first token was sampled (and that it
    did not finish) leave it with their KV pages (``step_prefill`` returns them as hand-offs): offered to JAX's
    transfer server (``transfer``) for requests whose decode side pulls them, else as NumPy bytes."""

    steps_async = False  # a sequence leaves once its first token is on the host, before any further step

    def __init__(self, config: EngineConfig, **kwargs):
        if config.speculative_config is not None:
            raise ValueError("speculative_config: speculation verifies decodes, which run on the decode side; start "
                             "the prefill process without --speculative-config")
        super().__init__(config, **kwargs)
        self.reader = PageReader(self.executor.runner)
        self.transfer = None  # a JaxTransfer, set by the server
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
            kv = {"parts": [{"shape": list(a.shape), "dtype": jnp.dtype(a.dtype).name} for a in staged],
                  "full": full, "local": local, "nbytes": nbytes, "num_cached_tokens": seq.num_cached_tokens}
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

    def __init__(self, config: EngineConfig, host: str, port: int, engine_factory=None, kv_transfer: str = "auto"):
        import grpc

        from jaxserve.disagg import kv_transfer as kvt
        self.config = config
        self.engine = (engine_factory or PrefillEngine)(config)
        self.engine.transfer = kvt.start(kv_transfer, host)
        self.stats = self.engine.stats()  # the engine's latest, refreshed by its thread after each iteration
        self._intake: queue.Queue = queue.Queue()
        self._streams: dict[str, queue.Queue] = {}
        self._stop = threading.Event()
        handler = grpc.method_handlers_generic_handler("jaxserve.disagg.staged.v1.Prefill", {
            "Run": grpc.unary_stream_rpc_method_handler(self._run, request_deserializer=_identity,
                                                        response_serializer=_identity),
            "Stats": grpc.unary_unary_rpc_method_handler(
                lambda _req, _ctx: json.dumps(self.stats).encode(), request_deserializer=_identity,
                response_serializer=_identity)})
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=64),
                                  options=[("grpc.max_send_message_length", 4 * CHUNK_BYTES)])
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if not self.port:
            raise OSError(f"cannot listen on {host}:{port}")
        self._thread = threading.Thread(target=self._loop, name="prefill-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self.server.start()

    def stop(self, grace: float = 1.0) -> None:
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
        while not self._stop.is_set():
            block = not engine.has_unfinished()
            items = take_all(self._intake, block)
            for item in items:
                if item is None:
                    return
                kind, rid, msg, out = item
                if kind == "add":
                    try:
                        engine.add_prefill(rid, [int(t) for t in msg["prompt_token_ids"]],
                                           params_from_json(msg["params"]), int(msg["request_index"]),
                                           pull=msg.get("kv_transfer") == "jax")
                        self._streams[rid] = out
                    except Exception as e:  # noqa: BLE001 - reported to the caller
                        out.put(e if isinstance(e, ValueError) else RuntimeError(f"{type(e).__name__}: {e}"))
                elif rid in self._streams:  # the caller went away: free its pages now
                    engine.abort_request(rid)
                    self._streams.pop(rid).put(None)
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
            kv = {rid: (meta, data) for rid, meta, data in handoffs}
            for o in outputs:
                stream = self._streams.pop(o.request_id, None)
                if stream is None:
                    continue
                c = o.outputs[0]  # the request's first output: its first token is this step's
                record = c.delta_records[0] if c.delta_records else None
                header = {"token": c.delta_token_ids[0] if c.delta_token_ids else None,
                          "finish_reason": c.finish_reason if o.finished else None,
                          "stop_reason": c.stop_reason if o.finished else None,
                          "error": o.error,
                          "logprobs": record.to_json() if record is not None and record.logprob is not None
                          else None,
                          "num_cached_tokens": int(o.metrics.num_cached_tokens or 0) if o.metrics else 0}
                if o.prompt_records is not None:
                    header["prompt_logprobs"] = [None if r is None else r.to_json() for r in o.prompt_records]
                meta, data = kv.get(o.request_id, (None, b""))
                if meta is None and not o.finished:
                    continue
                if meta is not None:
                    header["kv"] = meta
                    header["num_cached_tokens"] = meta["num_cached_tokens"]
                stream.put(json.dumps(header).encode())
                for i in range(0, len(data), CHUNK_BYTES):
                    stream.put(data[i:i + CHUNK_BYTES])
                stream.put(None)
            self.stats = engine.stats()


def serve_prefill(args) -> int:
    """``jaxserve serve --role prefill``: the prefill service until SIGTERM/SIGINT."""
    import signal

    server = PrefillServer(args.engine_config, args.host, args.kv_port, kv_transfer=args.kv_transfer)
    server.start()
    t = server.engine.transfer
    print(f"jaxserve prefill ready: kv=grpc://{args.host}:{server.port} "
          f"transfer={'jax://' + t.address if t else 'grpc'} path={server.engine.model_path}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.stop()
    return 0


# ---- the decode process ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Remote:
    seq: Sequence
    since: float
    url: str | None = None
    call: object = None
    result: dict | None = None  # the header, once received
    data: bytes = b""
    arrays: tuple | None = None  # the pages, pulled through JAX's transfer server
    sent: float = 0.0
    landed: float = 0.0


class _Endpoint:
    def __init__(self, url: str):
        import grpc

        self.url = url
        self.channel = grpc.insecure_channel(url, options=[("grpc.max_receive_message_length", 4 * CHUNK_BYTES)])
        self.run = self.channel.unary_stream(METHOD, request_serializer=_identity, response_deserializer=_identity)
        self.dead_until = 0.0
        self.last_error = ""


class RemotePrefill:
    """The decode process's prefill stage: sequences sent to prefill processes, and their results."""

    def __init__(self, urls: list[str], engine: RemotePrefillEngine, transfer=None):
        if not urls:
            raise ValueError("prefill_url: a decode process needs at least one prefill server (HOST:PORT)")
        self.endpoints = [_Endpoint(u) for u in urls]
        self.engine = engine
        self.transfer = transfer  # a JaxTransfer: pages are pulled through it, not sent over the stream
        self.queue: deque[_Remote] = deque()  # not sent yet
        self.calls: dict[int, _Remote] = {}  # seq_id -> sent, or received and waiting for room
        self.results: queue.Queue = queue.Queue()
        self._rr = itertools.count()
        self._pinned: dict[str, _Endpoint] = {}  # request id -> where its first output went: its siblings follow

    # the Scheduler-like interface of a stage
    def live(self) -> list[_Endpoint]:
        now = time.monotonic()
        return [e for e in self.endpoints if e.dead_until <= now]

    def add(self, seq: Sequence) -> list[Sequence]:
        p = seq.sampling_params
        limit = self.engine.max_model_len
        if seq.num_prompt_tokens >= limit:
            raise ValueError(f"prompt_token_ids has {seq.num_prompt_tokens} tokens; max_model_len={limit} leaves "
                             "no room for output")
        if p.max_tokens is not None and seq.num_prompt_tokens + p.max_tokens > limit:
            raise ValueError(f"SamplingParams.max_tokens={p.max_tokens} with a {seq.num_prompt_tokens}-token "
                             f"prompt exceeds max_model_len={limit}")
        if not self.live():
            reasons = "; ".join(f"{e.url}: {e.last_error}" for e in self.endpoints)
            raise EngineNotReady(f"no prefill server is reachable ({reasons})")
        seqs = [seq] + [seq.make_sibling(i) for i in range(1, p.n)]  # each of the n outputs is its own call
        now = time.monotonic()
        self.queue.extend(_Remote(s, now) for s in seqs)
        return seqs

    def holds(self, seq: Sequence) -> bool:
        return seq.seq_id in self.calls or any(r.seq is seq for r in self.queue)

    def get_request(self, request_id: str) -> list[Sequence]:
        return [r.seq for r in (*self.queue, *self.calls.values()) if r.seq.request_id == request_id]

    def forget(self, seq: Sequence) -> _Remote | None:
        r = self.calls.pop(seq.seq_id, None)
        if r is None:
            r = next((x for x in self.queue if x.seq is seq), None)
            if r is not None:
                self.queue.remove(r)
        return r

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        r = self.forget(seq)
        if r is not None and r.call is not None and r.result is None:
            r.call.cancel()  # the prefill process aborts the request and frees its pages
        seq.set_finished(reason, stop_reason)
        if not self.get_request(seq.request_id):
            self._pinned.pop(seq.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.queue or self.calls)

    @property
    def num_waiting(self) -> int:
        return len(self.queue) + len(self.calls)

    @property
    def num_running(self) -> int:
        return 0

    def stats(self) -> dict[str, int]:
        return {"num_waiting": self.num_waiting, "prefill_servers_live": len(self.live())}

    # sending and receiving
    def pump(self, limit: int) -> None:
        while self.queue and len(self.calls) < limit:
            live = self.live()
            if not live:
                while self.queue:  # every prefill server is gone: the waiting requests fail with the reason
                    r = self.queue.popleft()
                    self.calls[r.seq.seq_id] = r
                    self.results.put((r, RuntimeError("no prefill server is reachable (" + "; ".join(
                        f"{e.url}: {e.last_error}" for e in self.endpoints) + ")")))
                return
            r = self.queue.popleft()
            seq = r.seq
            ep = self._pinned.pop(seq.request_id, None) if seq.index else None  # the prompt's pages are there
            if ep is None or ep not in live:
                ep = live[next(self._rr) % len(live)]
            if seq.index + 1 < seq.sampling_params.n:
                self._pinned[seq.request_id] = ep
            r.url, r.sent = ep.url, time.monotonic()
            self.calls[seq.seq_id] = r
            msg = {"request_id": f"{seq.request_id}#{seq.seq_id}", "prompt_token_ids": seq.prompt_token_ids,
                   "params": params_to_json(self.call_params(seq)), "request_index": seq.request_index,
                   "engine_seed": self.engine.config.seed, "kv_cache_dtype": self.engine.config.kv_cache_dtype,
                   "kv_transfer": "jax" if self.transfer is not None else "grpc"}
            r.call = ep.run(json.dumps(msg).encode())
            threading.Thread(target=self._receive, args=(ep, r), daemon=True).start()

    def call_params(self, seq: Sequence) -> SamplingParams:
        """One output's parameters for its prefill call: ``n`` = 1, and the seed the sequence samples with here
        (``sequence_seed`` of its request and output index) as its explicit seed, so the prefill process samples
        the first token from the same stream; prompt logprobs are asked of the first output only."""
        p = seq.sampling_params
        seed = sequence_seed(p, engine_seed=self.engine.config.seed, request_index=seq.request_index,
                             sample_index=seq.index)
        return dataclasses.replace(p, n=1, seed=seed - (1 << 64) if seed >= 1 << 63 else seed,
                                   prompt_logprobs=p.prompt_logprobs if seq.index == 0 else None)

    def _receive(self, ep: _Endpoint, r: _Remote) -> None:
        import grpc

        try:
            it = iter(r.call)
            header = json.loads(next(it))
            chunks = [c for c in it]
            r.data = b"".join(chunks)
            kv = header.get("kv") or {}
            if kv.get("pull"):
                try:
                    r.arrays = self.transfer.pull(kv["pull"], kv["parts"], ep.url.rpartition(":")[0])
                except Exception as e:  # noqa: BLE001 - the request fails with the reason
                    self.results.put((r, RuntimeError(f"pulling the KV pages from the prefill server at {ep.url} "
                                                      f"failed: {type(e).__name__}: {e}")))
                    return
            r.result = header
            r.landed = time.monotonic()
            self.results.put((r, None))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED:
                return
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                ep.dead_until = time.monotonic() + RETRY_DEAD_S
            ep.last_error = f"{e.code().name}: {e.details()}"
            if e.code() == grpc.StatusCode.UNAVAILABLE and "failed to connect" in (e.details() or ""):
                self.results.put((r, _RETRY))  # never reached it: another prefill server takes the request
                return
            self.results.put((r, RuntimeError(f"the prefill server at {ep.url} failed: {ep.last_error}")))
        except StopIteration:
            self.results.put((r, RuntimeError(f"the prefill server at {ep.url} closed the stream early")))


class _RemoteStages:
    """The ``Scheduler`` interface over the remote prefill stage and the local decode scheduler."""

    def __init__(self, prefill: RemotePrefill, decode):
        self.prefill, self.decode = prefill, decode

    def add(self, seq):
        return self.prefill.add(seq)

    def get_request(self, request_id):
        return self.prefill.get_request(request_id) + self.decode.get_request(request_id)

    def finish(self, seq, reason, stop_reason=None):
        if seq.is_finished:
            return
        if self.prefill.holds(seq):
            self.prefill.finish(seq, reason, stop_reason)
        else:
            self.decode.finish(seq, reason, stop_reason)

    def has_unfinished(self):
        return self.prefill.has_unfinished() or self.decode.has_unfinished()

    @property
    def num_waiting(self):
        return self.prefill.num_waiting + self.decode.num_waiting

    @property
    def num_running(self):
        return self.decode.num_running

    @property
    def running(self):
        return [s for r in self.decode.replicas for s in r.running]

    def stats(self):
        out = dict(self.decode.stats())
        out["num_waiting"] = self.num_waiting
        out["prefill_servers_live"] = len(self.prefill.live())
        return out


class RemotePrefillEngine(StagedEngine):
    """The decode process's engine: prompts prefilled by prefill processes, decodes run here (module doc)."""

    def __init__(self, config: EngineConfig, prefill_urls: list[str], kv_transfer: str = "auto",
                 transfer_host: str = "127.0.0.1", **kwargs):
        if config.speculative_config is not None and config.speculative_config.model:
            raise ValueError("speculative_config: a draft model cannot be used by a decode process (it would need "
                             "the prompt's KV in the draft's pool too, which prefill processes do not compute); use "
                             "method 'ngram'")
        super().__init__(config, **kwargs)
        from jaxserve.disagg import kv_transfer as kvt
        self.remote = RemotePrefill(prefill_urls, self, kvt.start(kv_transfer, transfer_host))
        self.decode_scheduler = self.scheduler
        self.scheduler = _RemoteStages(self.remote, self.decode_scheduler)
        self.writer = PageWriter(self.executor.runner)
        self._landed: deque[_Remote] = deque()  # received, waiting for room on this side
        self._held: list = []  # received before their request's first output (which brings prompt logprobs)
        self.stats_counters.update(kv_transfers=0, kv_transfer_bytes=0, kv_transfer_seconds=0.0,
                                   kv_transfer_queue_seconds=0.0, decode_steps=0, prefill_steps=0,
                                   kv_transfer_pulls=0)

    def step(self) -> list[RequestOutput]:
        outputs = self._receive()
        self._adopt()
        self.remote.pump(self.config.max_pending_transfers)
        outputs += self._stage_step(self.decode_scheduler, self.executor, prefill=False)
        if not outputs and not self.decode_scheduler.has_unfinished() and self.remote.has_unfinished():
            try:  # nothing to decode: wait a little for a prefill instead of spinning
                self.remote.results.put(self.remote.results.get(timeout=0.01))
            except queue.Empty:
                pass
        return outputs

    def _receive(self) -> list[RequestOutput]:
        outputs = []
        held, self._held = self._held, []
        while True:
            if held:
                r, error = held.pop(0)
            else:
                try:
                    r, error = self.remote.results.get_nowait()
                except queue.Empty:
                    return outputs
            seq = r.seq
            if seq.is_finished or not self.remote.holds(seq):
                continue  # cancelled meanwhile
            if error is _RETRY:
                self.remote.forget(seq)
                self.remote.queue.appendleft(dataclasses.replace(r, url=None, call=None))
                continue
            if error is not None:
                logger.warning("request %s fails: %s", seq.request_id, error)
                out = self.abort_request(seq.request_id, "error", error=str(error))
                if out is not None:
                    outputs.append(out)
                continue
            h = r.result
            lead = seq.leader
            if lead is not None and seq.sampling_params.prompt_logprobs is not None and not lead.is_finished \
                    and not lead.num_output_tokens:
                self._held.append((r, None))  # the first output carries the prompt's logprobs: it goes first
                continue
            if h.get("error"):
                out = self.abort_request(seq.request_id, "error", error=f"prefill server {r.url}: {h['error']}")
                if out is not None:
                    outputs.append(out)
                continue
            req = self._requests.get(seq.request_id)
            if h.get("prompt_logprobs") is not None and req is not None:
                req.prompt_records = [None if e is None else TokenRecord.from_json(e) for e in h["prompt_logprobs"]]
            seq.append_token(int(h["token"]))
            seq.num_computed_tokens = seq.num_prompt_tokens
            seq.num_cached_tokens = int(h.get("num_cached_tokens") or 0)
            finished = []
            if h.get("finish_reason"):
                self.remote.forget(seq)
                seq.set_finished(h["finish_reason"], h.get("stop_reason"))
                finished.append(seq)
            self.structured.accept([seq])
            lps = {seq.seq_id: TokenRecord.from_json(h["logprobs"])} if h.get("logprobs") else {}
            outputs += self._collect(finished, [seq], lps)
            if not seq.is_finished:
                self._landed.append(r)

    def _adopt(self) -> None:
        while self._landed:
            r = self._landed[0]
            seq = r.seq
            if seq.is_finished or not self.remote.holds(seq):
                self._landed.popleft()
                continue
            replica = self.decode_scheduler.adopt(seq)
            if replica is None:
                return  # full: they wait in order, their pages on the host
            self._landed.popleft()
            self.remote.forget(seq)
            kv = r.result["kv"]
            pages, offset = r.arrays, 0
            if pages is None:  # bytes from the stream
                pages = []
                for part in kv["parts"]:
                    dtype = jnp.dtype(part["dtype"])  # knows the 8-bit float names NumPy alone does not
                    count = int(np.prod(part["shape"]))
                    pages.append(np.frombuffer(r.data, dtype, count, offset).reshape(part["shape"]))
                    offset += count * dtype.itemsize
            self.writer.write(tuple(pages), kv["full"], kv["local"], replica, seq)
            if r.arrays is not None:
                self.stats_counters["kv_transfer_pulls"] += 1
            now = time.monotonic()
            self.stats_counters["kv_transfers"] += 1
            self.stats_counters["kv_transfer_bytes"] += int(kv["nbytes"])
            self.stats_counters["kv_transfer_seconds"] += r.landed - r.sent
            self.stats_counters["kv_transfer_queue_seconds"] += (r.sent - r.since) + (now - r.landed)

    def stats(self) -> dict[str, float]:
        s = super().stats()
        s["kv_transfers_pending"] = len(self.remote.calls)
        return s

    def describe(self) -> dict:
        info = super().describe()
        info["prefill_urls"] = [e.url for e in self.remote.endpoints]
        info["kv_transfer"] = "jax" if self.remote.transfer is not None else "grpc"
        return info
