"""What a front end holds while a request runs: its ``RequestStream``, the errors that refuse or end it, and
``take_all``, which drains an engine thread's intake queue.

These stand on their own (asyncio and the outputs only): the servers and their tests use them without the
engine thread that feeds them (``jaxserve.engine.driver``, bridged to asyncio by ``jaxserve.server.async_engine``).
"""

from __future__ import annotations

import asyncio
import queue

from jaxserve.outputs import RequestDelta, RequestOutput
from jaxserve.sampling_params import SamplingParams


class EngineNotReady(RuntimeError):
    """The engine is still starting (loading, compiling) or failed to start."""


class EngineDraining(RuntimeError):
    """The server is shutting down and admits no new requests."""


class EngineOverloaded(RuntimeError):
    """Admitting the request would queue more than ``max_waiting_requests`` sequences."""


class EngineSleeping(RuntimeError):
    """The engine sleeps (``Engine.sleep``): its KV cache (and maybe its weights) are off the device until
    ``wake_up``."""


class EngineFailure(RuntimeError):
    """The engine could not finish a request cleanly (reported to that request only)."""


class RequestStream:
    """The outputs of one request, in order; the last one has ``finished=True``.

    ``prompt_token_ids`` is set once the engine has accepted the request. ``token_texts`` maps every token id
    seen in this request's logprobs to its text decoded on its own (filled before the output is delivered).
    ``abort()`` finishes the request with reason "abort" and frees its pages before the engine's next step
    (``engine`` is what it asks: anything with ``abort(request_id)``, the ``AsyncEngine`` when serving).

    The producer (the asyncio bridge, on the stream's event loop) calls ``accept`` or ``refuse`` once, then
    ``put`` each output, or ``fail`` to end the stream with an error.
    """

    def __init__(self, engine, request_id: str, params: SamplingParams):
        self.request_id = request_id
        self.params = params
        self.prompt_token_ids: list[int] = []
        self.token_texts: dict[int, str] = {}
        self.token_bytes: dict[int, bytes] = {}  # the same tokens' raw bytes (a token can hold part of a character)
        self._engine = engine
        self._queue: asyncio.Queue = asyncio.Queue()
        self._accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        self._done = False  # the consumer has received the final output (or an error)

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        if not self._done:
            self._engine.abort(self.request_id)

    # The producer's side ------------------------------------------------------------------------------------
    async def wait_accepted(self) -> None:
        """Return once the engine has accepted the request; raise what refused it. Cancelling the wait leaves
        the answer to come unread (the caller aborts the request)."""
        try:
            await asyncio.shield(self._accepted)
        except asyncio.CancelledError:
            self._accepted.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise

    def accept(self, prompt_token_ids: list[int]) -> None:
        """The engine has queued the request, with these prompt token ids."""
        self.prompt_token_ids = prompt_token_ids
        _settle(self._accepted, None)

    def refuse(self, error: BaseException) -> None:
        """The engine did not take the request: ``wait_accepted`` raises ``error``; the stream yields nothing."""
        self._done = True
        _settle(self._accepted, error)

    def put(self, item: RequestOutput | RequestDelta | BaseException, token_texts: dict[int, str] | None = None,
            token_bytes: dict[int, bytes] | None = None) -> None:
        """The next output (or an error that ends the stream), with the texts and raw bytes of the tokens its
        logprobs show."""
        if token_texts:
            self.token_texts.update(token_texts)
            self.token_bytes.update(token_bytes or {})
        self._queue.put_nowait(item)

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error``, whether or not the request was accepted yet."""
        _settle(self._accepted, error)
        self._queue.put_nowait(error)

    # The consumer's side ------------------------------------------------------------------------------------
    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput | RequestDelta:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(None)


def take_all(q: queue.Queue, block: bool, timeout: float | None = None) -> list:
    """Everything queued in ``q`` now (waiting for a first item if ``block``, at most ``timeout`` seconds)."""
    items = []
    try:
        items.append(q.get(block=block, timeout=timeout))
        while True:
            items.append(q.get_nowait())
    except queue.Empty:
        pass
    return items
