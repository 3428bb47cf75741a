"""The decode process of disaggregation across processes: ``jaxserve serve --role decode``.

The decode process (``--role decode --prefill-url HOST:P[,HOST:P...]``) is the front door: clients speak the
usual OpenAI and gRPC APIs to it. Its engine (``RemotePrefillEngine``) sends each new request to a prefill
process (``jaxserve.disagg.prefill``; round robin over the live ones), emits the first token when it arrives,
writes the received pages into its own pool (``PageWriter``: ``jax.device_put`` onto its mesh, one scatter) once
it has room, and decodes with continuous batching. Pulled pages are fetched by the call's receiving thread, before
the engine sees them. What travels is ``jaxserve.disagg.wire``'s.

Failure and load: a prefill call that fails ends its request with an error naming the prefill server. Every
prefill server is probed (its ``Stats`` call) every ``PROBE_S`` seconds, on channels that reconnect within
``RECONNECT_MAX_MS``: one that cannot be reached (or failed a call) is skipped until a probe answers, and with
none left new requests are refused with 503 ("no prefill server is reachable") and the process reports itself
not ready (``unready_reason``: /health 503, gRPC health NOT_SERVING), so a router sends its requests elsewhere.
A prefill server that comes back is in use again within ``PROBE_S`` plus one reconnect.

A cancelled request cancels its call, and the prefill
process aborts it and frees its pages. At most ``max_pending_transfers`` prefills are in flight or waiting for
room on the decode side; further requests wait in the decode process's queue (never dropped).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import queue
import threading
import time
from collections import deque

from jaxserve.config.engine import EngineConfig
from jaxserve.config.network import ClusterSecurity
from jaxserve.disagg.staged import StagedEngine
from jaxserve.disagg.wire import CHUNK_BYTES, METHOD, STATS_METHOD, identity, pages_from_bytes, params_to_json
from jaxserve.engine.request_stream import EngineNotReady
from jaxserve.outputs import RequestOutput, TokenRecord
from jaxserve.sampling_params import SamplingParams, sequence_seed
from jaxserve.scheduler.replicas import ReplicatedScheduler
from jaxserve.scheduler.sequence import Sequence

logger = logging.getLogger(__name__)

PROBE_S = 0.1
PROBE_TIMEOUT_S = 1.0
# gRPC's reconnect back-off grows to 120 s by default; a prefill server that restarts must be found at once.
RECONNECT_MAX_MS = 300
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS)]
_RETRY = object()


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
    def __init__(self, url: str, security: ClusterSecurity):
        self.url = url
        self.channel = security.channel(url, options=[("grpc.max_receive_message_length", 4 * CHUNK_BYTES),
                                                      *_CHANNEL_OPTIONS])
        self.metadata = security.metadata()  # the cluster secret, on every call
        self._run = self.channel.unary_stream(METHOD, request_serializer=identity, response_deserializer=identity)
        self._stats = self.channel.unary_unary(STATS_METHOD, request_serializer=identity,
                                               response_deserializer=identity)
        self.up = False  # the last probe answered (and no call failed since)
        self.last_error = "not probed yet"

    def probe(self) -> None:
        import grpc

        try:
            self._stats(b"", timeout=PROBE_TIMEOUT_S, metadata=self.metadata)
        except grpc.RpcError as e:
            if self.up:
                logger.warning("prefill server %s is unreachable: %s", self.url, e.code().name)
            self.up, self.last_error = False, f"{e.code().name}: {e.details()}"
            return
        if not self.up:
            logger.info("prefill server %s is reachable", self.url)
        self.up, self.last_error = True, "ok"

    def run(self, message: bytes):
        return self._run(message, metadata=self.metadata)


class RemotePrefill:
    """The decode process's prefill stage: sequences sent to prefill processes, and their results."""

    def __init__(self, urls: list[str], engine: RemotePrefillEngine, transfer=None,
                 security: ClusterSecurity | None = None):
        if not urls:
            raise ValueError("prefill_url: a decode process needs at least one prefill server (HOST:PORT)")
        self.endpoints = [_Endpoint(u, security or ClusterSecurity()) for u in urls]
        self.engine = engine
        self.transfer = transfer  # a JaxTransfer: pages are pulled through it, not sent over the stream
        self.queue: deque[_Remote] = deque()  # not sent yet
        self.calls: dict[int, _Remote] = {}  # seq_id -> sent, or received and waiting for room
        self.results: queue.Queue = queue.Queue()
        self._rr = itertools.count()
        self._pinned: dict[str, _Endpoint] = {}  # request id -> where its first output went: its siblings follow
        for e in self.endpoints:  # the first answers before the engine serves
            e.probe()
        self._closed = threading.Event()
        self._prober = threading.Thread(target=self._probe_forever, name="prefill-probes", daemon=True)
        self._prober.start()

    def _probe_forever(self) -> None:
        while not self._closed.wait(PROBE_S):
            for e in self.endpoints:
                e.probe()

    def close(self) -> None:
        self._closed.set()

    def unready_reason(self) -> str | None:
        """None while a prefill server is reachable, else why this process cannot serve."""
        if self.live():
            return None
        return "no prefill server is reachable (" + "; ".join(f"{e.url}: {e.last_error}" for e in self.endpoints) \
            + ")"

    # the Scheduler-like interface of a stage
    def live(self) -> list[_Endpoint]:
        return [e for e in self.endpoints if e.up]

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
                ep.up = False  # skipped until a probe answers again
            ep.last_error = f"{e.code().name}: {e.details()}"
            if e.code() == grpc.StatusCode.UNAVAILABLE and "failed to connect" in (e.details() or ""):
                self.results.put((r, _RETRY))  # never reached it: another prefill server takes the request
                return
            self.results.put((r, RuntimeError(f"the prefill server at {ep.url} failed: {ep.last_error}")))
        except StopIteration:
            self.results.put((r, RuntimeError(f"the prefill server at {ep.url} closed the stream early")))


class _RemoteStages:
    """The ``RequestScheduler`` (``jaxserve.scheduler.protocol``) over the remote prefill stage and the local
    decode scheduler."""

    def __init__(self, prefill: RemotePrefill, decode: ReplicatedScheduler):
        self.prefill, self.decode = prefill, decode

    def add(self, seq: Sequence) -> list[Sequence]:
        return self.prefill.add(seq)

    def get_request(self, request_id: str) -> list[Sequence]:
        return self.prefill.get_request(request_id) + self.decode.get_request(request_id)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        if seq.is_finished:
            return
        if self.prefill.holds(seq):
            self.prefill.finish(seq, reason, stop_reason)
        else:
            self.decode.finish(seq, reason, stop_reason)

    def has_unfinished(self) -> bool:
        return self.prefill.has_unfinished() or self.decode.has_unfinished()

    @property
    def num_waiting(self) -> int:
        return self.prefill.num_waiting + self.decode.num_waiting

    @property
    def num_running(self) -> int:
        return self.decode.num_running

    @property
    def max_num_running(self) -> int:
        return self.decode.max_num_running

    @property
    def running(self) -> list[Sequence]:
        return self.decode.running

    def stats(self) -> dict[str, int]:
        out = dict(self.decode.stats())
        out["num_waiting"] = self.num_waiting
        out["prefill_servers_live"] = len(self.prefill.live())
        # The prefix cache is the prefill processes' (their /metrics count its queries and hits): prompts arrive
        # here with their pages, and nothing is looked up.
        out["prefix_cache_queries"] = out["prefix_cache_hits"] = 0
        return out


class RemotePrefillEngine(StagedEngine):
    """The decode process's engine: prompts prefilled by prefill processes, decodes run here (module doc)."""

    def __init__(self, config: EngineConfig, prefill_urls: list[str], kv_transfer: str = "auto",
                 transfer_host: str = "127.0.0.1", security: ClusterSecurity | None = None, **kwargs):
        """``transfer_host``: where JAX's transfer server listens (``--kv-host``); ``security``: the cluster
        secret and TLS of the calls to the prefill servers (``--cluster-secret``, ``--cluster-ssl-*``)."""
        if config.speculative_config is not None and config.speculative_config.model:
            raise ValueError("speculative_config: a draft model cannot be used by a decode process (it would need "
                             "the prompt's KV in the draft's pool too, which prefill processes do not compute); use "
                             "method 'ngram'")
        super().__init__(config, **kwargs)
        from jaxserve.disagg import kv_transfer as kvt
        self.remote = RemotePrefill(prefill_urls, self, kvt.start(kv_transfer, transfer_host, security), security)
        self.decode_scheduler = self.scheduler
        self.scheduler = _RemoteStages(self.remote, self.decode_scheduler)
        self.writer = self.executor.kv_pages
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
            pages = r.arrays if r.arrays is not None else pages_from_bytes(kv, r.data)  # pulled, or streamed
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

    def unready_reason(self) -> str | None:
        """None while this process can serve; else why not (no prefill server is reachable). Thread-safe."""
        return self.remote.unready_reason()

    def close(self) -> None:
        self.remote.close()
        super().close()

    def describe(self) -> dict:
        info = super().describe()
        info["prefill_urls"] = [e.url for e in self.remote.endpoints]
        info["kv_transfer"] = "jax" if self.remote.transfer is not None else "grpc"
        return info
