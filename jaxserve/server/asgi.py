"""Small ASGI helpers shared by the OpenAI server and the router (no engine imports: the router loads no model)."""

from __future__ import annotations


async def wait_disconnect(receive) -> None:
    """Return when the client of an ASGI connection (``receive``: its receive channel) goes away."""
    while (await receive())["type"] != "http.disconnect":
        pass
