"""``KVEventsConfig``: the ``--kv-events-config`` JSON / ``LLM(kv_events_config=...)`` dict, with vLLM's keys
(host-only). Unknown keys and impossible values are refused on construction, naming the key."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxserve.config.json_option import json_object

PUBLISHERS = ("null", "zmq")
DEFAULT_PORT = 5557


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """vLLM's ``offset_endpoint_port``: a TCP endpoint's port plus ``rank``; other transports get ``_dp<rank>``."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1].isdigit():
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def binds(endpoint: str) -> bool:
    """vLLM's rule: a PUB endpoint holding a wildcard, or an ipc/inproc one, is bound; any other is connected."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVEventsConfig:
    """Where the engine announces the pages of its prefix cache (``jaxserve/engine/kv_events.py``).

    ``endpoint``: the ZMQ PUB socket (bound when it holds ``*``, ``::``, ``ipc://`` or ``inproc://``, else
    connected, vLLM's rule); unset, it binds ``tcp://<bind_host>:5557``: the events carry the prompts' token ids,
    so no interface is opened that the server's ``--host`` does not name (vLLM's default, ``tcp://*:5557``,
    every interface, is had by asking for it); ``replay_endpoint``: an optional ROUTER socket serving the last
    ``buffer_steps`` batches from a sequence number on; ``topic``: the first frame of every message; ``hwm``: the PUB socket's high-water mark;
    ``max_queue_size``: batches waiting for the publishing thread before new ones are dropped (never blocking a
    step). Each data-parallel rank publishes on its own sockets, as vLLM's do: the ports plus the rank
    (``for_rank``). ``bind_host``: where the unset endpoint binds: the server's ``--host`` (set by the server, not a JSON
    key; 127.0.0.1 for ``LLM``).
    """

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str | None = None
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    bind_host: str = "127.0.0.1"
    port_offset: int = 0  # a data-parallel rank's publisher: the unset endpoint's port plus its rank (for_rank)

    def __post_init__(self):
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config: enable_kv_cache_events={self.enable_kv_cache_events!r} must be "
                             "true or false")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config: publisher={self.publisher!r} must be one of "
                             f"{', '.join(map(repr, PUBLISHERS))}")
        for name in ("endpoint", "topic", "bind_host"):
            if not isinstance(getattr(self, name), str) and not (name == "endpoint" and self.endpoint is None):
                raise ValueError(f"kv_events_config: {name}={getattr(self, name)!r} must be a string")
        if self.publisher == "zmq" and self.endpoint is not None and "://" not in self.endpoint:
            raise ValueError(f"kv_events_config: endpoint={self.endpoint!r} must be a ZMQ address such as "
                             "'tcp://127.0.0.1:5557'")
        if self.replay_endpoint is not None and (not isinstance(self.replay_endpoint, str)
                                                 or "://" not in self.replay_endpoint):
            raise ValueError(f"kv_events_config: replay_endpoint={self.replay_endpoint!r} must be a ZMQ address "
                             "such as 'tcp://127.0.0.1:5558'")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config: {name}={value!r} must be a positive integer")

    @property
    def enabled(self) -> bool:
        """Whether events are recorded and published (vLLM's rule: the flag on and a real publisher)."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @property
    def publish_address(self) -> tuple[str, bool]:
        """(the PUB socket's address, whether it is bound rather than connected)."""
        if self.endpoint is None:
            host = f"[{self.bind_host}]" if ":" in self.bind_host else self.bind_host
            return f"tcp://{host}:{DEFAULT_PORT + self.port_offset}", True
        return self.endpoint, binds(self.endpoint)

    def for_rank(self, rank: int) -> "KVEventsConfig":
        """The config of data-parallel rank ``rank``'s own publisher, as vLLM places it (what Dynamo's relay
        subscribes to): each endpoint's TCP port plus ``rank`` (an ipc/inproc address gets ``_dp<rank>``)."""
        if rank == 0:
            return self
        return dataclasses.replace(self, endpoint=offset_endpoint(self.endpoint, rank),
                                   replay_endpoint=offset_endpoint(self.replay_endpoint, rank),
                                   port_offset=self.port_offset + rank)

    @classmethod
    def parse(cls, value: "str | Mapping | KVEventsConfig | None") -> "KVEventsConfig | None":
        """From a JSON object (the flag), a dict (``LLM``), an instance, or None (no events).

        Raises:
          ValueError: naming the key that is unknown or out of range, or saying why the JSON is bad.
        """
        if value is None or isinstance(value, KVEventsConfig):
            return value
        value = json_object(value, "kv_events_config")
        if value is None:
            return None
        keys = [f.name for f in dataclasses.fields(cls) if f.name not in ("bind_host", "port_offset")]
        unknown = sorted(set(value) - set(keys))
        if unknown:
            raise ValueError(f"kv_events_config: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                             f"{', '.join(keys)}")
        fields = dict(value)
        if fields.get("publisher") is None:  # vLLM: the flag alone means the ZMQ publisher
            fields["publisher"] = "zmq" if fields.get("enable_kv_cache_events") else "null"
        return cls(**fields)
