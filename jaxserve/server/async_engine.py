"""The engine's driver thread (``jaxserve.engine.driver``) bridged to asyncio.

On the asyncio side each request is a ``RequestStream``: an async iterator of the engine's outputs (a
``RequestDelta`` per step with news, then the final ``RequestOutput``) fed by its own ``asyncio.Queue``. Every
front end (gRPC, HTTP) goes through ``AsyncEngine.add_request``, so all streams share one engine and one batch.
Prompts are tokenized and checked here, in worker threads, never on the engine thread; the driver's news comes
back with one ``loop.call_soon_threadsafe`` per engine iteration.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.driver import EngineDriver
from jaxserve.engine.request_stream import (
    EngineDraining,
    EngineNotReady,
    EngineOverloaded,
    EngineSleeping,
    RequestStream,
)
from jaxserve.lora_request import LoRARequest
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.metrics import ServerMetrics
from jaxserve.text.prompt_tokenizer import PromptTokenizer
from jaxserve.text.request_checks import RequestChecks

logger = logging.getLogger(__name__)

# What one token of an admitted request costs the host at most: its id in the prompt's list and the sequence's,
# the detokenizer's share, the output's. The requests held (waiting or running) may take a quarter of the memory
# that was available when the server started.
HOST_BYTES_PER_TOKEN = 128
HOST_MEMORY_SHARE = 0.25


def host_token_budget() -> int:
    """Tokens the admitted requests may hold: ``HOST_MEMORY_SHARE`` of the host memory available now, at
    ``HOST_BYTES_PER_TOKEN`` each (prompt tokens plus the most each sequence may generate)."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, int(available * HOST_MEMORY_SHARE) // HOST_BYTES_PER_TOKEN)


class AsyncEngine:
    """An ``Engine`` in its driver thread (``EngineDriver``), with entry points for asyncio front ends.

    Args:
      config: the engine's options; ``config.max_waiting_requests`` bounds the sequences that may wait (None:
        no bound but memory's, as vLLM's queue).
      metrics: where latencies and finish reasons are recorded (optional).
      engine_factory: builds the engine from ``config`` inside the engine thread (default: ``make_engine``).
      token_budget: the tokens the admitted requests (waiting or running) may hold on the host, prompts plus the
        most each sequence may generate; past it a request is refused as overloaded (default:
        ``host_token_budget()``, a quarter of the memory available now).
    """

    def __init__(self, config: EngineConfig, *, metrics: ServerMetrics | None = None,
                 engine_factory: Callable[[EngineConfig], Any] | None = None,
                 lora_modules: Sequence[LoRARequest] = (), token_budget: int | None = None):
        self.config = config
        self.token_budget = token_budget if token_budget is not None else host_token_budget()
        self._held_tokens = 0  # what the live requests may hold, by ``_hold``
        self._initial_loras = list(lora_modules)  # registered as the engine starts (--lora-modules)
        self.loras: dict[str, LoRARequest] = {}  # the adapters clients may name in ``model``
        self.metrics = metrics
        self._factory = engine_factory
        self.driver = EngineDriver(self._build, post=self._to_loop, listener=self, metrics=metrics)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future | None = None
        self._stopped: asyncio.Future | None = None
        self.prompts: PromptTokenizer | None = None  # tokenizes in worker threads, once the engine is ready
        self.checks: RequestChecks | None = None  # the engine's request checks, run here at intake
        self.info: dict[str, Any] = {}
        self.draining = False
        self.sleeping = False  # between ``sleep`` and ``wake_up``: requests are refused
        # asyncio-side view, only touched in the event loop thread
        self._live: dict[str, RequestStream] = {}
        self._pending_seqs = 0  # sequences sent to the engine thread and not yet acknowledged
        self._held: dict[str, int] = {}  # live request id -> the tokens it may hold (``_hold``)
        # The engine's counts at its last iteration; ``max_num_running``: the sequences it may run at once (with
        # data > 1, max_num_seqs per replica), read from its stats once it is ready.
        self._sched = {"num_running": 0, "num_waiting": 0, "max_num_running": config.max_num_seqs}
        self._idle: asyncio.Event | None = None

    @property
    def engine(self):
        """The engine the driver thread owns (None until it is built); touched only by that thread."""
        return self.driver.engine

    # Life cycle ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; it builds (and warms up) the engine. Call from the event loop."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._stopped = self._loop.create_future()
        self._idle = asyncio.Event()
        self._idle.set()
        self.driver.start()

    async def wait_ready(self) -> None:
        """Return once the engine is warm; raise what its construction raised, if it failed."""
        await asyncio.shield(self._ready)

    @property
    def ready(self) -> bool:
        return self._ready is not None and self._ready.done() and self._ready.exception() is None

    def unready_reason(self) -> str | None:
        """Why a warm engine cannot serve now (e.g. a decode process with no prefill server reachable), or None."""
        return self.driver.unready_reason() if self.ready else None

    @property
    def num_live_requests(self) -> int:
        return len(self._live)

    def stats(self) -> dict | None:
        """The engine's latest ``stats()`` (after its last iteration); None before it is ready."""
        return self.driver.stats

    def intake_length(self) -> int:
        return self.driver.intake_length()

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
        if not self.driver.thread.is_alive():
            return
        self.driver.stop()
        await asyncio.shield(self._stopped)
        await asyncio.to_thread(self.driver.thread.join, 30)
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
        held = self._hold(params, len(ids))
        if self._held_tokens + held > self.token_budget:
            raise EngineOverloaded(
                f"the server is overloaded: the requests it holds would take more than {self.token_budget} tokens "
                f"of host memory ({self.token_budget * HOST_BYTES_PER_TOKEN / 2**30:.1f} GiB); retry later")
        rid = request_id or uuid.uuid4().hex
        stream = RequestStream(self, rid, params)
        self._live[rid] = stream
        self._held[rid] = held
        self._held_tokens += held
        self._idle.clear()
        self._pending_seqs += params.n
        self.driver.add(rid, ids, params, time.monotonic(), lora_request)
        try:
            await stream.wait_accepted()
        except asyncio.CancelledError:
            self.abort(rid)  # queued behind the add, so the engine sees it right after
            raise
        return stream

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Finish a live request (reason "abort") before the engine's next step; no-op if it is not live."""
        self.driver.abort(request_id, reason)

    def abort_all(self) -> None:
        self.driver.abort(None)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread between steps and return its result."""
        if not self.ready:
            raise EngineNotReady("the engine is still starting up (loading and compiling the model)")
        future = self._loop.create_future()
        self.driver.call(fn, lambda result, error: self._set_future(future, result, error))
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

    # The driver's side: built in its thread, news posted to the event loop ---------------------------------
    def _build(self):
        """Build the engine (in the driver thread) and what this side needs of it: the adapters given at start,
        the request checks and the prompt tokenizer."""
        started = time.monotonic()
        if self._factory is not None:
            engine = self._factory(self.config)
        else:
            from jaxserve.disagg.factory import make_engine

            engine = make_engine(self.config)
        for lora in self._initial_loras:
            engine.add_lora(lora)
            self.loras[lora.lora_name] = lora
        self.checks = engine.checks
        self.prompts = PromptTokenizer(engine.tokenizer, int(engine.max_model_len),
                                       int(engine.model_config.vocab_size), checks=self.checks)
        self.info = engine.describe()
        _log_ready(self.info, time.monotonic() - started, engine.warmup_summary)
        return engine

    def _to_loop(self, fn: Callable, *args) -> bool:
        """Schedule ``fn(*args)`` on the event loop; False if that loop is already closed."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:
            if self._loop.is_closed():
                return False
            raise

    def engine_started(self, error: BaseException | None) -> None:
        self._set_future(self._ready, None, error)

    def engine_stopped(self) -> None:
        self._set_future(self._stopped, None, None)

    def engine_news(self, acks: list, items: list, stats: dict) -> None:
        """One engine iteration's acks and outputs, handed to their streams."""
        self._sched = self._sched_of(stats)
        for rid, result in acks:
            stream = self._live.get(rid)
            if stream is None:
                continue
            self._pending_seqs -= stream.params.n
            if isinstance(result, BaseException):
                self._forget(rid)
                stream.refuse(result)
            else:
                stream.accept(result)
        for rid, out, texts in items:
            stream = self._live.get(rid)
            if stream is None:
                continue
            stream.put(out, *(texts or ()))
            if isinstance(out, BaseException) or out.finished:
                self._forget(rid)
        if not self._live:
            self._idle.set()

    def engine_lost(self, error: BaseException) -> None:
        """The driver's loop died: every live stream ends with ``error``."""
        for stream in self._live.values():
            stream.fail(error)
        self._live.clear()
        self._held.clear()
        self._held_tokens = 0
        self._idle.set()

    def _hold(self, params: SamplingParams, prompt_tokens: int) -> int:
        """The tokens a request may hold on the host: each sequence's prompt and the most it may generate."""
        room = max(int(self.prompts.max_model_len) - prompt_tokens, 0)
        most = room if params.max_tokens is None else min(params.max_tokens, room)
        return params.n * (prompt_tokens + most)

    def _forget(self, rid: str) -> None:
        del self._live[rid]
        self._held_tokens -= self._held.pop(rid, 0)

    def _sched_of(self, stats: dict) -> dict:
        """What the admission check reads of the engine's stats (an engine that does not say how many sequences
        it may run at once runs ``max_num_seqs``)."""
        return {"num_running": int(stats.get("num_running", 0)), "num_waiting": int(stats.get("num_waiting", 0)),
                "max_num_running": int(stats.get("max_num_running", self.config.max_num_seqs))}

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
