"""The engine's driver thread: one thread owns an ``Engine`` for its whole life.

``Engine`` is synchronous and not thread-safe, so the driver builds it (loading, warm-up) in a thread of its own
and then loops: take commands from a thread-safe intake queue (add already-tokenized prompts, abort, call a
function between steps), run one ``step()`` while any request is unfinished, and hand the iteration's news to its
consumer with one ``post`` per iteration. With nothing to do it blocks on the intake queue: no busy-spin. A step
that raises does not end the loop: its requests end by the one step-failure rule (``step_failure``) and everything
else keeps running.

No asyncio and no jax here: the consumer (the servers' asyncio bridge, ``jaxserve.server.async_engine``) supplies
``post``, which runs a function on its own side, and a ``DriverListener`` that receives what the driver posts.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from jaxserve.engine.request_stream import EngineFailure, EngineNotReady, EngineSleeping, take_all
from jaxserve.engine.step_failure import end_failed_step
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import RequestDelta, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.text.prompt_tokenizer import token_bytes

logger = logging.getLogger(__name__)
STATS_REFRESH_S = 1.0  # how often an idle engine refreshes its stats while step shapes compile in the background


class DriverListener(Protocol):
    """What the driver tells its consumer; each call runs on the consumer's side (through ``post``)."""

    def engine_started(self, error: BaseException | None) -> None:
        """The engine is built and warm (``error`` None), or building it raised ``error``."""
        ...

    def engine_news(self, acks: list[tuple[str, list[int] | BaseException]], items: list[tuple], stats: dict) -> None:
        """One iteration's news: each added request's prompt ids (or what refused it); ``(request_id, output or
        error, (token texts, token bytes) or None)`` per output; the engine's stats after the iteration."""
        ...

    def engine_lost(self, error: BaseException) -> None:
        """The loop itself died: every live request ends with ``error``."""
        ...

    def engine_stopped(self) -> None:
        """The driver thread is ending (after ``stop``, a failed start or a lost loop)."""
        ...


class DriverMetrics(Protocol):
    """What the driver records (``jaxserve.server.metrics.ServerMetrics``)."""

    step_errors: Any  # a counter: ``inc()`` per step that raised

    def observe_tokens(self, out: RequestOutput | RequestDelta, now: float, last_time: float | None) -> None:
        ...

    def observe_finished(self, out: RequestOutput) -> None:
        ...


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]  # already tokenized, off the engine thread
    params: SamplingParams
    arrival_time: float
    lora_request: LoRARequest | None = None


@dataclasses.dataclass
class _Abort:
    request_id: str | None  # None: every live request
    reason: str = "abort"


@dataclasses.dataclass
class _Call:
    fn: Callable[[Any], Any]
    reply: Callable[[Any, BaseException | None], None]  # posted to the consumer with (result, error)


@dataclasses.dataclass
class _Failed:
    """A request that could not be finished cleanly: its stream ends with ``error``."""

    request_id: str
    error: BaseException


_STOP = object()


class _ConsumerGone(Exception):
    """The consumer's side (its event loop) closed while the driver thread still ran."""


class EngineDriver:
    """Owns an engine in a dedicated thread; its methods are thread-safe.

    Args:
      build: builds the engine, in the driver thread (the consumer's start-up work on the engine goes with it).
      post: ``post(fn, *args)`` runs ``fn(*args)`` on the consumer's side; False if that side has closed.
      listener: receives what the driver posts.
      metrics: where token latencies, finish reasons and step errors are recorded (optional).
    """

    def __init__(self, build: Callable[[], Any], *, post: Callable[..., bool], listener: DriverListener,
                 metrics: DriverMetrics | None = None):
        self._build = build
        self._post = post
        self._listener = listener
        self.metrics = metrics
        self._intake: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._thread_main, name="jaxserve-engine", daemon=True)
        self.engine = None  # touched only by the driver thread once it runs
        self.stats: dict | None = None  # the engine's ``stats()`` after its last iteration
        self._kv_events: Callable[[], None] | None = None  # the engine's publish_kv_events
        self._unready: Callable[[], str | None] | None = None  # the engine's unready_reason (thread-safe)
        self._last_token_time: dict[str, float] = {}
        self._engine_live: set[str] = set()  # request ids the engine holds
        self._token_text_cache: dict[int, str] = {}
        self._token_bytes_cache: dict[int, bytes] = {}
        self._prompt_texts_sent: set[str] = set()  # requests whose prompt tokens' texts went with an output

    # Commands (any thread) ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the driver thread; it builds the engine, then serves the commands."""
        self.thread.start()

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, arrival_time: float,
            lora_request: LoRARequest | None = None) -> None:
        """Queue a request (token ids checked already); its ack comes with the next ``deliver``."""
        self._intake.put(_Add(request_id, prompt_ids, params, arrival_time, lora_request))

    def abort(self, request_id: str | None, reason: str = "abort") -> None:
        """Finish a live request (every live one for None) before the engine's next step."""
        self._intake.put(_Abort(request_id, reason))

    def call(self, fn: Callable[[Any], Any], reply: Callable[[Any, BaseException | None], None]) -> None:
        """Run ``fn(engine)`` in the driver thread between steps; ``reply(result, error)`` is posted back."""
        self._intake.put(_Call(fn, reply))

    def stop(self) -> None:
        """Abort whatever is live and end the thread (``listener.engine_stopped`` follows)."""
        self._intake.put(_STOP)

    def intake_length(self) -> int:
        return self._intake.qsize()

    def unready_reason(self) -> str | None:
        """Why a built engine cannot serve now (e.g. a decode process with no prefill server reachable), or None."""
        return self._unready() if self._unready is not None else None

    # The driver thread --------------------------------------------------------------------------------------
    def _thread_main(self) -> None:
        try:
            engine = self._build()
            self.engine = engine
            self.stats = engine.stats()
            self._unready = getattr(engine, "unready_reason", None)
            self._kv_events = getattr(engine, "publish_kv_events", None)
            if self._kv_events is not None:
                self._kv_events()  # from now on the prefix cache's pages are announced
            self._post(self._listener.engine_news, [], [], self.stats)  # before the first admission check
        except BaseException as e:  # noqa: BLE001 - reported to the consumer, which exits
            if isinstance(e, ValueError):  # a bad option or checkpoint: the consumer reports it, once
                logger.debug("the engine refused to start: %s", e)
            else:
                logger.exception("the engine failed to start")
            self._post(self._listener.engine_started, e)
            self._post(self._listener.engine_stopped)
            return
        self._post(self._listener.engine_started, None)
        try:
            self._run(engine)
            engine.close()  # a multi-host run's followers stop with it
        except _ConsumerGone:
            logger.warning("the event loop closed without stopping the engine; the engine thread ends")
        except BaseException:  # noqa: BLE001 - the loop itself catches step errors; this is a bug
            logger.exception("the engine loop died")
            self._post(self._listener.engine_lost, EngineFailure("the engine loop stopped"))
        finally:
            self._post(self._listener.engine_stopped)

    def _take(self, block: bool) -> list:
        # While step shapes compile in the background, an idle engine still wakes every second, so its stats
        # (the pending-shapes gauge) stay current.
        pending = (self.stats or {}).get("step_shapes_pending", 0)
        return take_all(self._intake, block, timeout=STATS_REFRESH_S if pending else None)

    def _run(self, engine) -> None:
        while True:
            acks: list[tuple[str, list[int] | BaseException]] = []
            outputs: list[RequestOutput | RequestDelta] = []
            stop = False
            for cmd in self._take(block=not engine.has_unfinished()):
                if cmd is _STOP:
                    stop = True
                    cmd = _Abort(None)
                self._handle(engine, cmd, acks, outputs)
            if not stop and engine.has_unfinished():
                outputs.extend(self._step(engine))
            self._publish(engine, acks, outputs)
            if stop:
                return

    def _handle(self, engine, cmd, acks: list, outputs: list) -> None:
        if isinstance(cmd, _Add):
            try:
                ids = list(cmd.prompt_ids)  # tokenized (and templated) and checked once, off this thread
                lora = {} if cmd.lora_request is None else {"lora_request": cmd.lora_request}
                engine.add_request(cmd.request_id, ids, cmd.params, arrival_time=cmd.arrival_time, checked=True,
                                   **lora)
                self._engine_live.add(cmd.request_id)
                acks.append((cmd.request_id, ids))
            except Exception as e:  # noqa: BLE001 - ValueError for bad input; anything else is reported too
                # EngineNotReady: e.g. no prefill server
                if not isinstance(e, (ValueError, EngineNotReady, EngineSleeping)):
                    logger.exception("adding request %s failed", cmd.request_id)
                    e = EngineFailure(f"internal error: the engine could not add request {cmd.request_id}; the "
                                      "server log has the details")
                acks.append((cmd.request_id, e))
        elif isinstance(cmd, _Abort):
            ids = [cmd.request_id] if cmd.request_id is not None else list(self._engine_live)
            for rid in ids:
                out = self._abort_one(engine, rid, cmd.reason)
                if out is not None:
                    outputs.append(out)
        elif isinstance(cmd, _Call):
            try:
                result, error = cmd.fn(engine), None
            except Exception as e:  # noqa: BLE001 - goes back to the caller
                result, error = None, e
            self._post(cmd.reply, result, error)

    def _abort_one(self, engine, rid: str, reason: str, error: str | None = None
                   ) -> RequestOutput | _Failed | None:
        try:
            return engine.abort_request(rid, reason=reason, error=error)
        except Exception:  # noqa: BLE001
            logger.exception("aborting request %s failed", rid)
            return _Failed(rid, EngineFailure(f"internal error: request {rid} could not be finished cleanly; the "
                                              "server log has the details"))

    def _step(self, engine) -> list:
        try:
            return engine.step()
        except Exception as e:  # noqa: BLE001 - one bad step must not take the server down
            if self.metrics is not None:
                self.metrics.step_errors.inc()
            return end_failed_step(lambda rid, message: self._abort_one(engine, rid, "error", message),
                                   engine.scheduler.running, e, otherwise=self._engine_live)

    def _token_bytes(self, engine, token_id: int, text: str) -> bytes:
        raw = self._token_bytes_cache.get(token_id)
        if raw is None:
            raw = self._token_bytes_cache[token_id] = token_bytes(engine.tokenizer, token_id, text)
        return raw

    def _token_text(self, engine, token_id: int) -> str:
        text = self._token_text_cache.get(token_id)
        if text is None and engine.tokenizer is None:  # --skip-tokenizer-init: token ids only
            return ""
        if text is None:
            text = self._token_text_cache[token_id] = engine.tokenizer.decode([token_id])
        return text

    def _publish(self, engine, acks: list, outputs: list) -> None:
        now = time.monotonic()
        if self._kv_events is not None:
            try:
                self._kv_events()
            except Exception:  # noqa: BLE001 - events must never break serving
                logger.exception("publishing KV-cache events failed")
        items = []
        for out in outputs:
            if isinstance(out, _Failed):
                items.append((out.request_id, out.error, None))
                self._last_token_time.pop(out.request_id, None)
                self._engine_live.discard(out.request_id)
                self._prompt_texts_sent.discard(out.request_id)
                continue
            texts, raw = {}, {}
            ids: list[int] = []  # the tokens whose texts this output's logprobs show
            for c in out.outputs:
                for r in c.delta_records or ():
                    ids.append(r.id)
                    ids.extend(t for t, _ in r.top)
            if out.prompt_records is not None and out.request_id not in self._prompt_texts_sent:
                self._prompt_texts_sent.add(out.request_id)  # the prompt tokens (echo) and their top-n
                ids.extend(out.prompt_token_ids)
                for r in out.prompt_records:
                    if r is not None:
                        ids.extend(t for t, _ in r.top)
            for t in ids:
                if t not in texts:
                    texts[t] = self._token_text(engine, t)
                    raw[t] = self._token_bytes(engine, t, texts[t])
            if self.metrics is not None:
                try:
                    self.metrics.observe_tokens(out, now, self._last_token_time.get(out.request_id))
                    if out.finished:
                        self.metrics.observe_finished(out)
                except Exception:  # noqa: BLE001 - metrics must never break serving
                    logger.exception("recording metrics failed")
            if out.finished:
                self._last_token_time.pop(out.request_id, None)
                self._engine_live.discard(out.request_id)
                self._prompt_texts_sent.discard(out.request_id)
            elif any(c.delta_token_ids for c in out.outputs):
                self._last_token_time[out.request_id] = now
            items.append((out.request_id, out, (texts, raw)))
        try:
            stats = engine.stats()
        except Exception:  # noqa: BLE001
            logger.exception("engine stats failed")
            stats = self.stats or {}
        self.stats = stats
        if not self._post(self._listener.engine_news, acks, items, stats):
            raise _ConsumerGone
