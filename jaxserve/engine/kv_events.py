"""The KV-event publisher: the prefix cache's events on a ZMQ PUB socket, in vLLM's format, for the routers that
choose a replica by what it has cached (llm-d's inference scheduler, NVIDIA Dynamo, ``--routing prefix``).

Each message is three frames: the topic, an 8-byte big-endian sequence number (0, 1, 2, ... per publisher), and
a msgpack ``KVEventBatch``: the array ``[ts, events, data_parallel_rank]`` (``ts`` in seconds since the epoch;
the events as ``jaxserve/scheduler/kv_events.py`` encodes them). The first batch a publisher sends is
``[AllBlocksCleared]``: a restarted replica starts with an empty cache.

With a replay endpoint, a ROUTER socket answers a request ``[b"", start_seq (8 bytes big-endian)]`` with one
message ``[b"", seq, payload]`` per buffered batch from ``start_seq`` on (the last ``buffer_steps``), then
``[b"", -1 (8 bytes, signed), b""]``: a late subscriber or one that saw a gap in the sequence numbers catches up.

The engine's host loop only appends to a bounded queue (``publish``); encoding and sending happen on the
publisher's own thread, so a slow subscriber never holds up a step. A full queue drops the batch and says so
in the log once (the sequence numbers then show the gap to nobody, so the queue is sized large).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

from jaxserve.config.kv_events import KVEventsConfig
from jaxserve.scheduler.kv_events import AllBlocksCleared, KVCacheEvent

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ZmqEventPublisher:
    """Publishes ``KVEventBatch`` es on ``config.endpoint`` from a thread of its own (module doc)."""

    def __init__(self, config: KVEventsConfig, rank: int = 0):
        """``rank``: the data-parallel rank whose pool it announces (its first batch clears that rank)."""
        import msgpack
        import zmq

        self.config = config
        self._pack = msgpack.Packer(use_bin_type=True)
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)  # (seq, payload)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        address, bind = config.publish_address
        try:
            if "[" in address or "[" in (config.replay_endpoint or ""):
                self._pub.setsockopt(zmq.IPV6, 1)
            (self._pub.bind if bind else self._pub.connect)(address)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                if "[" in config.replay_endpoint:
                    self._replay.setsockopt(zmq.IPV6, 1)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._pub.close(0)
            if self._replay is not None:
                self._replay.close(0)
            raise ValueError(f"kv_events_config: cannot open {address} / {config.replay_endpoint}: {e}") from None
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.replay_endpoint = (self._replay.getsockopt(zmq.LAST_ENDPOINT).decode()
                                if self._replay is not None else None)
        self._seq = 0
        self._dropped = False
        self._running = True
        self.publish([AllBlocksCleared()], rank)
        self._thread = threading.Thread(target=self._loop, name="jaxserve-kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV-cache events on %s (replay: %s, topic %r)", self.endpoint,
                    self.replay_endpoint or "none", config.topic)

    def publish(self, events: list[KVCacheEvent], data_parallel_rank: int = 0) -> None:
        """Queue one batch (never blocks); the publishing thread encodes and sends it."""
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), [e.to_wire() for e in events], data_parallel_rank))
        except queue.Full:
            if not self._dropped:
                logger.warning("KV-event queue full (max_queue_size=%d): dropping batches",
                               self.config.max_queue_size)
                self._dropped = True

    def _loop(self) -> None:
        import zmq

        topic = self.config.topic.encode()
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if self._replay is not None and poller.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if item is None:
                return
            ts, events, rank = item
            payload = self._pack.pack([ts, events, rank])
            seq = self._seq
            self._seq += 1
            try:
                self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                logger.exception("sending KV events failed")
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring a malformed KV-event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        """Send what is queued (for up to a second), then close the sockets."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._thread.join(2.0)
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)


class RankPublishers:
    """One ``ZmqEventPublisher`` per data-parallel rank, each on its rank's sockets (``KVEventsConfig.for_rank``:
    the ports plus the rank, as vLLM's ranks publish and Dynamo's relay subscribes), made when the rank first
    publishes; each starts with its ``AllBlocksCleared``."""

    def __init__(self, config: KVEventsConfig):
        self.config = config
        self.ranks: dict[int, ZmqEventPublisher] = {0: ZmqEventPublisher(config)}

    def rank(self, rank: int) -> ZmqEventPublisher:
        if rank not in self.ranks:
            self.ranks[rank] = ZmqEventPublisher(self.config.for_rank(rank), rank=rank)
        return self.ranks[rank]

    def publish(self, events: list[KVCacheEvent], data_parallel_rank: int = 0) -> None:
        self.rank(data_parallel_rank).publish(events, data_parallel_rank)

    def close(self) -> None:
        for publisher in self.ranks.values():
            publisher.close()


def make_publisher(config: KVEventsConfig | None) -> RankPublishers | None:
    """The publishers ``config`` asks for; None when events are off."""
    if config is None or not config.enabled:
        return None
    return RankPublishers(config)
