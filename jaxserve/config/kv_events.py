"""``KVEventsConfig``: the ``--kv-events-config`` JSON / ``LLM(kv_events_config=...)`` dict, with vLLM's keys
(host-only). Unknown keys and impossible values are refused on construction, naming the key."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxserve.config.json_option import json_object

PUBLISHERS = ("null", "zmq")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVEventsConfig:
    """Where the engine announces the pages of its prefix cache (``jaxserve/engine/kv_events.py``).

    ``endpoint``: the ZMQ PUB socket (bound when it holds ``*``, ``::``, ``ipc://`` or ``inproc://``, else
    connected); ``replay_endpoint``: an optional ROUTER socket serving the last ``buffer_steps`` batches from a
    sequence number on; ``topic``: the first frame of every message; ``hwm``: the PUB socket's high-water mark;
    ``max_queue_size``: batches waiting for the publishing thread before new ones are dropped (never blocking a
    step).
    """

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self):
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config: enable_kv_cache_events={self.enable_kv_cache_events!r} must be "
                             "true or false")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config: publisher={self.publisher!r} must be one of "
                             f"{', '.join(map(repr, PUBLISHERS))}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config: {name}={getattr(self, name)!r} must be a string")
        if self.publisher == "zmq" and "://" not in self.endpoint:
            raise ValueError(f"kv_events_config: endpoint={self.endpoint!r} must be a ZMQ address such as "
                             "'tcp://*:5557'")
        if self.replay_endpoint is not None and (not isinstance(self.replay_endpoint, str)
                                                 or "://" not in self.replay_endpoint):
            raise ValueError(f"kv_events_config: replay_endpoint={self.replay_endpoint!r} must be a ZMQ address "
                             "such as 'tcp://*:5558'")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config: {name}={value!r} must be a positive integer")

    @property
    def enabled(self) -> bool:
        """Whether events are recorded and published (vLLM's rule: the flag on and a real publisher)."""
        return self.enable_kv_cache_events and self.publisher != "null"

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
        keys = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(keys))
        if unknown:
            raise ValueError(f"kv_events_config: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                             f"{', '.join(keys)}")
        fields = dict(value)
        if fields.get("publisher") is None:  # vLLM: the flag alone means the ZMQ publisher
            fields["publisher"] = "zmq" if fields.get("enable_kv_cache_events") else "null"
        return cls(**fields)
