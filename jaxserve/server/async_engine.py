"""The engine in a thread of its own, driven from asyncio.

``Engine`` is synchronous and not thread-safe, so one thread owns it for its whole life: it builds and warms
it up, then loops: take commands from a thread-safe intake queue (add already-tokenized prompts, abort),
run one ``step()`` while any request is unfinished, and hand the outputs back to the asyncio loop with one
``loop.call_soon_threadsafe`` per iteration. With nothing to do it blocks on the intake queue: no busy-spin.

On the asyncio side each request is a ``RequestStream``: an async iterator of the engine's outputs (a
``RequestDelta`` per step with news, then the final ``RequestOutput``) fed by its own ``asyncio.Queue``. Every
front end (gRPC, HTTP) goes through ``AsyncEngine.add_request``, so all streams share one engine and one batch.
An exception inside ``step()`` does not end the loop: the requests that were in the batch finish with reason
``"error"`` and everything else keeps running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.request_stream import (
    EngineDraining,
    EngineFailure,
    EngineNotReady,
    EngineOverloaded,
    EngineSleeping,
    RequestStream,
    take_all,
)
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import RequestDelta, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.metrics import ServerMetrics
from jaxserve.text.prompt_tokenizer import PromptTokenizer, token_bytes
from jaxserve.text.request_checks import RequestChecks

logger = logging.getLogger(__name__)
STATS_REFRESH_S = 1.0  # how often an idle engine refreshes its stats while step shapes compile in the background


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
    future: asyncio.Future


_STOP = object()


class _LoopClosed(Exception):
    """The event loop that owns the engine closed while the engine thread still ran."""


class AsyncEngine:
    """Owns an ``Engine`` in a dedicated thread; thread-safe entry points for asyncio front ends.

    Args:
      config: the engine's options; ``config.max_waiting_requests`` bounds the sequences that may wait.
      metrics: where latencies and finish reasons are recorded (optional).
      engine_factory: builds the engine from ``config`` inside the engine thread (default: ``Engine``).
    """

    def __init__(self, config: EngineConfig, *, metrics: ServerMetrics | None = None,
                 engine_factory: Callable[[EngineConfig], Any] | None = None,
                 lora_modules: Sequence[LoRARequest] = ()):
        self.config = config
        self._initial_loras = list(lora_modules)  # registered as the engine starts (--lora-modules)
        self.loras: dict[str, LoRARequest] = {}  # the adapters clients may name in ``model``
        self.metrics = metrics
        self._factory = engine_factory
        self._intake: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future | None = None
        self._stopped: asyncio.Future | None = None
        self.engine = None  # touched only by the engine thread once it runs
        self.prompts: PromptTokenizer | None = None  # tokenizes in worker threads, once the engine is ready
        self.checks: RequestChecks | None = None  # the engine's request checks, run here at intake
        self.info: dict[str, Any] = {}
        self.draining = False
        self.sleeping = False  # between ``sleep`` and ``wake_up``: requests are refused
        # asyncio-side view, only touched in the event loop thread
        self._live: dict[str, RequestStream] = {}
        self._pending_seqs = 0  # sequences sent to the engine thread and not yet acknowledged
        # The engine's counts at its last iteration; ``max_num_running``: the sequences it may run at once (with
        # data > 1, max_num_seqs per replica), read from its stats once it is ready.
        self._sched = {"num_running": 0, "num_waiting": 0, "max_num_running": config.max_num_seqs}
        self._idle: asyncio.Event | None = None
        # engine-thread state
        self._stats: dict | None = None
        self._kv_events: Callable[[], None] | None = None  # the engine's publish_kv_events
        self._unready: Callable[[], str | None] | None = None  # the engine's unready_reason (thread-safe)
        self._last_token_time: dict[str, float] = {}
        self._engine_live: set[str] = set()  # request ids the engine holds
        self._token_text_cache: dict[int, str] = {}
        self._token_bytes_cache: dict[int, bytes] = {}
        self._prompt_texts_sent: set[str] = set()  # requests whose prompt tokens' texts went with an output

    # Life cycle ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; it builds (and warms up) the engine. Call from the event loop."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._stopped = self._loop.create_future()
        self._idle = asyncio.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._thread_main, name="jaxserve-engine", daemon=True)
        self._thread.start()

    async def wait_ready(self) -> None:
        """Return once the engine is warm; raise what its construction raised, if it failed."""
        await asyncio.shield(self._ready)

    @property
    def ready(self) -> bool:
        return self._ready is not None and self._ready.done() and self._ready.exception() is None

    def unready_reason(self) -> str | None:
        """Why a warm engine cannot serve now (e.g. a decode process with no prefill server reachable), or None."""
        return self._unready() if self._unready is not None and self.ready else None

    @property
    def num_live_requests(self) -> int:
        return len(self._live)

    def stats(self) -> dict | None:
        """The engine's latest ``stats()`` (after its last iteration); None before it is ready."""
        return self._stats

    def intake_length(self) -> int:
        return self._intake.qsize()

    # LoRA adapters ------------------------------------------------------------------------------------------
    async def load_lora(self, lora_request: LoRARequest) -> None:
        """Register an adapter (read and checked in the engine thread); ValueError if it does not fit."""
        if lora_request.lora_name in self.loras:
            raise ValueError(f"lora_name: the adapter {lora_request.lora_name!r} has already been loaded")
        await self.call(lambda engine: engine.add_lora(lora_request))
        self.loras[lora_request.lora_name] = lora_request

    async def unload_lora(self, name: str) -> None:
        """Unload an adapter; ValueError if a live request runs it."""
        await self.call(lambda engine: engine.remove_lora(name))
        self.loras.pop(name, None)

    # Sleep and live weights ---------------------------------------------------------------------------------
    async def sleep(self, level: int = 1) -> None:
        """Refuse new requests (``EngineSleeping``), wait for the live ones to finish, then free the KV cache
        (level 1) or the weights too (level 2) until ``wake_up``."""
        if level not in (1, 2):
            raise ValueError(f"level={level} must be 1 (free the KV cache) or 2 (the weights too)")
        if not self.ready:
            raise EngineNotReady("the engine is still starting up (loading and compiling the model)")
        if self.sleeping:
            return
        self.sleeping = True
        try:
            await self._idle.wait()
            await self.call(lambda engine: engine.sleep(level))
        except BaseException:
            self.sleeping = False
            raise

    async def wake_up(self) -> None:
        """The engine's memory back; requests are admitted again."""
        await self.call(lambda engine: engine.wake_up())
        self.sleeping = False

    async def update_weights(self, path: str) -> None:
        """Load a checkpoint folder's weights onto the mesh (in a worker thread, while the engine serves on),
        then swap them in between two steps (``Engine.update_weights``)."""
        if not self.ready:
            raise EngineNotReady("the engine is still starting up (loading and compiling the model)")
        executor = self.engine.executor
        state = await asyncio.to_thread(executor.weights.read, path)
        await self.call(lambda engine: engine.update_weights(state))

    def begin_drain(self) -> None:
        """Refuse new requests from now on (``EngineDraining``); live ones continue."""
        self.draining = True

    async def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no request is live; False if ``timeout`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def stop(self) -> None:
        """Abort whatever is live, end the engine thread and wait for it."""
        if self._thread is None or not self._thread.is_alive():
            return
        self._put(_STOP)
        await asyncio.shield(self._stopped)
        await asyncio.to_thread(self._thread.join, 30)
        if self.prompts is not None:
            self.prompts.close()

    # Requests -----------------------------------------------------------------------------------------------
    def _admission_check(self, num_seqs: int) -> None:
        if self.draining:
            raise EngineDraining("the server is shutting down and accepts no new requests")
        if self.sleeping:
            raise EngineSleeping("the engine is asleep (POST /sleep); POST /wake_up to serve requests again")
        if not self.ready:
            if self._ready is not None and self._ready.done():
                raise EngineNotReady("the engine failed to start")
            raise EngineNotReady("the engine is still starting up (loading and compiling the model)")
        limit = self.config.max_waiting_requests
        if limit is not None:
            free_slots = max(0, self._sched["max_num_running"] - self._sched["num_running"])
            would_wait = self._pending_seqs + self._sched["num_waiting"] + num_seqs - free_slots
            if would_wait > limit:
                raise EngineOverloaded(f"the server is overloaded: more than max_waiting_requests={limit} "
                                       "(--max-waiting-requests) "
                                       "sequences would be waiting; retry later")

    async def add_request(self, prompt: str | Sequence[int] | None, params: SamplingParams, *,
                          messages: list[dict] | None = None, add_generation_prompt: bool = True,
                          request_id: str | None = None, template_options: dict | None = None,
                          add_special_tokens: bool = True, lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue a request (a text or token-id prompt, or chat ``messages``) and return its stream once the
        engine has accepted it. Text and chat templates are tokenized in ``self.prompts``' worker threads, never
        in the engine thread.

        Every check of the request (``self.checks``) runs here, so the engine thread adds it unchecked.

        Raises:
          ValueError: naming the problem (empty prompt, ids outside the vocabulary, too long, bad template...).
          EngineOverloaded, EngineDraining, EngineNotReady: the request was not admitted.
        """
        self._admission_check(params.n)
        if messages is None and (prompt is None or len(prompt) == 0):
            raise ValueError("prompt is empty")
        ids = await self.prompts.encode(prompt, messages, add_generation_prompt, template_options=template_options,
                                        add_special_tokens=add_special_tokens)  # runs checks.prompt
        if params.structured_outputs is not None:  # the grammar compiles in a worker thread (cached for the engine)
            await asyncio.get_running_loop().run_in_executor(None, self.checks.params, params, len(ids))
        else:
            self.checks.params(params, len(ids))
        self._admission_check(params.n)  # the queue (or the server's state) may have changed meanwhile
        rid = request_id or uuid.uuid4().hex
        stream = RequestStream(self, rid, params)
        self._live[rid] = stream
        self._idle.clear()
        self._pending_seqs += params.n
        self._put(_Add(rid, ids, params, time.monotonic(), lora_request))
        try:
            await asyncio.shield(stream._accepted)
        except asyncio.CancelledError:
            stream._accepted.add_done_callback(lambda f: f.cancelled() or f.exception())
            self.abort(rid)  # queued behind the add, so the engine sees it right after
            raise
        return stream

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Finish a live request (reason "abort") before the engine's next step; no-op if it is not live."""
        self._put(_Abort(request_id, reason))

    def abort_all(self) -> None:
        self._put(_Abort(None))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread between steps and return its result."""
        if not self.ready:
            raise EngineNotReady("the engine is still starting up (loading and compiling the model)")
        future = self._loop.create_future()
        self._put(_Call(fn, future))
        return await future

    async def tokenize(self, text: str) -> tuple[list[int], list[str]]:
        """Token ids of ``text`` as a prompt, and each token decoded on its own (in a worker thread)."""
        if not self.ready:
            raise EngineNotReady("the engine is still starting up (loading and compiling the model)")
        return await self.prompts.tokens(text)

    async def tokenize_prompt(self, prompt: str | Sequence[int] | None, messages: list[dict] | None = None,
                              add_generation_prompt: bool = True, *, template_options: dict | None = None,
                              add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt or conversation as ``add_request`` would see them (in a worker thread)."""
        if not self.ready:
            raise EngineNotReady("the engine is still starting up (loading and compiling the model)")
        return await self.prompts.encode(prompt, messages, add_generation_prompt, fit=False,
                                         template_options=template_options, add_special_tokens=add_special_tokens)

    async def token_strings(self, ids: Sequence[int]) -> list[str]:
        return await self.prompts.token_strings(ids)

    async def token_pieces(self, ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary entry (``convert_ids_to_tokens``: vLLM's ``token_strs``)."""
        return await self.prompts.token_pieces(ids)

    async def detokenize(self, ids: Sequence[int]) -> str:
        """The text of token ids (in a worker thread); ValueError for ids outside the vocabulary."""
        if not self.ready:
            raise EngineNotReady("the engine is still starting up (loading and compiling the model)")
        return await self.prompts.decode(ids)

    def _put(self, item) -> None:
        self._intake.put(item)

    # Engine thread ------------------------------------------------------------------------------------------
    def _thread_main(self) -> None:
        started = time.monotonic()
        try:
            if self._factory is not None:
                engine = self._factory(self.config)
            else:
                from jaxserve.disagg.factory import make_engine

                engine = make_engine(self.config)
            self.engine = engine
            for lora in self._initial_loras:
                engine.add_lora(lora)
                self.loras[lora.lora_name] = lora
            self.checks = engine.checks
            self.prompts = PromptTokenizer(engine.tokenizer, int(engine.max_model_len),
                                           int(engine.model_config.vocab_size), checks=self.checks)
            self.info = engine.describe()
            self._stats = engine.stats()
            self._unready = getattr(engine, "unready_reason", None)
            self._kv_events = getattr(engine, "publish_kv_events", None)
            if self._kv_events is not None:
                self._kv_events()  # from now on the prefix cache's pages are announced
            _log_ready(self.info, time.monotonic() - started, engine.warmup_summary)
            self._to_loop(self._deliver, [], [], self._sched_of(self._stats))  # before the first admission check
        except BaseException as e:  # noqa: BLE001 - reported to the event loop, which exits
            if isinstance(e, ValueError):  # a bad option or checkpoint: its message says what to change
                logger.error("the engine failed to start: %s", e)
            else:
                logger.exception("the engine failed to start")
            self._to_loop(self._set_future, self._ready, None, e)
            self._to_loop(self._set_future, self._stopped, None, None)
            return
        self._to_loop(self._set_future, self._ready, None, None)
        try:
            self._run(engine)
            engine.close()  # a multi-host run's followers stop with it
        except _LoopClosed:
            logger.warning("the event loop closed without stopping the engine; the engine thread ends")
        except BaseException:  # noqa: BLE001 - the loop itself catches step errors; this is a bug
            logger.exception("the engine loop died")
            self._to_loop(self._fail_all, EngineFailure("the engine loop stopped"))
        finally:
            self._to_loop(self._set_future, self._stopped, None, None)

    def _to_loop(self, fn: Callable, *args) -> bool:
        """Schedule ``fn(*args)`` on the event loop; False if that loop is already closed."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:
            if self._loop.is_closed():
                return False
            raise

    def _take(self, block: bool) -> list:
        # While step shapes compile in the background, an idle engine still wakes every second, so its stats
        # (the pending-shapes gauge) stay current.
        pending = (self._stats or {}).get("step_shapes_pending", 0)
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
            self._to_loop(self._set_future, cmd.future, result, error)

    def _abort_one(self, engine, rid: str, reason: str) -> RequestOutput | BaseException | None:
        try:
            return engine.abort_request(rid, reason=reason)
        except Exception:  # noqa: BLE001
            logger.exception("aborting request %s failed", rid)
            return _Failed(rid, EngineFailure(f"internal error: request {rid} could not be finished cleanly; the "
                                              "server log has the details"))

    def _step(self, engine) -> list:
        try:
            return engine.step()
        except Exception:  # noqa: BLE001 - one bad step must not take the server down
            logger.exception("engine step failed; the requests in its batch finish with reason 'error'")
            if self.metrics is not None:
                self.metrics.step_errors.inc()
            affected = list(dict.fromkeys(s.request_id for s in engine.scheduler.running))
            if not affected:  # the failure is not tied to the batch: nothing else can make progress either
                affected = list(self._engine_live)
            outs = []
            for rid in affected:
                out = self._abort_one(engine, rid, "error")
                if out is not None:
                    outs.append(out)
            return outs

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
            stats = self._stats or {}
        self._stats = stats
        if not self._to_loop(self._deliver, acks, items, self._sched_of(stats)):
            raise _LoopClosed

    def _sched_of(self, stats: dict) -> dict:
        """What the admission check reads of the engine's stats (an engine that does not say how many sequences
        it may run at once runs ``max_num_seqs``)."""
        return {"num_running": int(stats.get("num_running", 0)), "num_waiting": int(stats.get("num_waiting", 0)),
                "max_num_running": int(stats.get("max_num_running", self.config.max_num_seqs))}

    # Event loop side ----------------------------------------------------------------------------------------
    def _deliver(self, acks: list, items: list, sched: dict) -> None:
        self._sched = sched
        for rid, result in acks:
            stream = self._live.get(rid)
            if stream is None:
                continue
            self._pending_seqs -= stream.params.n
            if isinstance(result, BaseException):
                del self._live[rid]
                stream._done = True
                self._set_future(stream._accepted, None, result)
            else:
                stream.prompt_token_ids = result
                self._set_future(stream._accepted, None, None)
        for rid, out, texts in items:
            stream = self._live.get(rid)
            if stream is None:
                continue
            if texts and texts[0]:
                stream.token_texts.update(texts[0])
                stream.token_bytes.update(texts[1])
            stream._queue.put_nowait(out)
            if isinstance(out, BaseException) or out.finished:
                del self._live[rid]
        if not self._live:
            self._idle.set()

    def _fail_all(self, error: BaseException) -> None:
        for rid, stream in list(self._live.items()):
            if not stream._accepted.done():
                self._set_future(stream._accepted, None, error)
            stream._queue.put_nowait(error)
        self._live.clear()
        self._idle.set()

    @staticmethod
    def _set_future(future: asyncio.Future, result, error) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


def _log_ready(info: dict, seconds: float, warm: dict | None) -> None:
    """One line: what was loaded, on which devices, and where the start-up time went (``warm``: the executor's
    warm-up summary, None without one)."""
    try:
        import jax

        devices = f"{len(jax.devices())} {jax.default_backend()} device(s)"
    except Exception:  # noqa: BLE001 - informational only
        devices = "unknown devices"
    if warm is None:
        timing = f"in {seconds:.1f}s (no warm-up compile)"
    else:
        hits, misses = warm["cache_hits"], warm["cache_misses"]
        cache = (f"compilation cache: {hits} hits, {misses} misses" if warm["cache_dir"]
                 else "compilation cache off")
        if "executables_loaded" in warm:
            cache += (f"; step executables: {warm['executables_loaded']} loaded, "
                      f"{warm['executables_compiled']} compiled")
        timing = (f"in {seconds:.1f}s: loading {max(seconds - warm['seconds'], 0):.1f}s, warm-up "
                  f"{warm['seconds']:.1f}s ({cache})")
    logger.info("engine ready: %s (%s) on %s %s", info.get("model_path"), info.get("dtype"), devices, timing)


@dataclasses.dataclass
class _Failed:
    request_id: str
    error: BaseException
