"""Streaming for the OpenAI HTTP API and the router that relays it: server-sent-event framing, the response that
streams them and stops (aborting the request) the moment its client goes away, waiting on work with the same
watch, and the shape of an error event.

Imports nothing of the engine: the router (``--role router``), which loads no model, streams through this module.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import Response

logger = logging.getLogger(__name__)

T = TypeVar("T")

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
DONE = b"data: [DONE]\n\n"


def sse(payload: dict | str, event: str | None = None) -> bytes:
    """One server-sent event: ``data: <compact JSON>`` (a string goes as it is, e.g. ``[DONE]``), after an
    ``event: NAME`` line if ``event`` is given."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {data}\n\n".encode()


def error_body(message: str, type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object, as a JSON response's body or an in-band ``error`` event."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


async def events(payloads: AsyncIterator[dict], on_error: Callable[[Exception], dict]) -> AsyncIterator[bytes]:
    """The events of a streamed answer: each payload framed, then ``[DONE]``. The status line has gone out with
    the first event, so a failure is told in-band: ``on_error(exception)``'s body as one more event before
    ``[DONE]``."""
    try:
        async for payload in payloads:
            yield sse(payload)
    except Exception as e:  # noqa: BLE001 - the status line is already sent; report in-band
        yield sse(on_error(e))
    yield DONE


async def named_events(payloads: AsyncIterator[dict],
                       on_error: Callable[[Exception], dict]) -> AsyncIterator[bytes]:
    """Named-event framing of a streamed answer (Anthropic's Messages API, OpenAI's Responses API): each payload
    as an event named by its ``type``, no ``[DONE]``; a failure after the status line is one more event,
    ``on_error(exception)``'s body (named ``error``)."""
    try:
        async for payload in payloads:
            yield sse(payload, payload["type"])
    except Exception as e:  # noqa: BLE001 - the status line is already sent; report in-band
        yield sse(on_error(e), "error")


async def wait_disconnect(receive) -> None:
    """Return when the client of an ASGI connection (``receive``: its receive channel) goes away."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(Response):
    """Server-sent events from an async iterator of ``bytes``. ``on_close`` (a function, or a coroutine function)
    runs once however the response ends (finished, client disconnected, or failed), after the stream has
    stopped, so an unfinished request is aborted (or an upstream call closed) at once."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None] | None], *,
                 status_code: int = 200, headers: list[tuple[bytes, bytes]] | None = None):
        super().__init__(status_code=status_code)
        self.events = events
        self.on_close = on_close
        self.start_headers = SSE_HEADERS if headers is None else headers

    async def __call__(self, scope, receive, send) -> None:
        async def stream():
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.start_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        streamer = asyncio.ensure_future(stream())
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            try:
                for task in (streamer, watcher):
                    task.cancel()
                error = (await asyncio.gather(streamer, watcher, return_exceptions=True))[0]
            finally:
                closing = self.on_close()
                if inspect.isawaitable(closing):
                    await closing
        # A client that went away mid-send shows as an OSError; anything else is a failure worth the log.
        if isinstance(error, Exception) and not isinstance(error, OSError):
            logger.error("streaming a response failed", exc_info=error)


async def until_disconnect(receive, work: Awaitable[T], *, on_disconnect: Callable[[], None] | None = None,
                           discard: Callable[[Any], Awaitable[None]] | None = None) -> T | None:
    """Await ``work``, watching the client (``receive``: the ASGI receive channel). If the client goes away first,
    ``on_disconnect()`` runs (e.g. aborting the engine's requests), ``work`` is cancelled and None is returned;
    ``discard`` gets what ``work`` returned all the same while being cancelled (e.g. an upstream response, to
    close)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        gone = not task.done()
        if gone:
            if on_disconnect is not None:
                on_disconnect()
            task.cancel()
        late = (await asyncio.gather(task, watcher, return_exceptions=True))[0]
    if not gone:
        return task.result()
    if discard is not None and not isinstance(late, BaseException):
        await discard(late)
    return None
