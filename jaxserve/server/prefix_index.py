"""What each replica has cached, from its KV-cache events (``--kv-events-config``), for the router's
``--routing prefix``: a subscriber per replica keeps the set of page hashes it announced, and ``longest_prefix``
says how many leading pages of a prompt a replica holds.

A prompt's page hashes are computed here as the engine (and vLLM) computes its page keys: vLLM's block hash
(``jaxserve/scheduler/block_hash.py``, the replicas' ``--prefix-caching-hash-algo`` and ``PYTHONHASHSEED``)
chained over ``page_size`` tokens with the request's ``cache_salt`` on the first page, then taken in the form the
events announce (the low 64 bits, or whole digests with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``). The page
size is the one the replicas announce (``block_size`` of their events). Requests for a LoRA adapter are not
matched: vLLM's keys hold the adapter's folder, which the events do not carry.

Each subscriber follows the sequence numbers: on the first batch it sees and on any gap it asks the replica's
replay socket for what it missed (from 0 the first time, so a router that starts after a replica still learns
its whole cache, as far as the replica's replay buffer reaches). When the buffer no longer reaches back to the
first missed batch, or no replay answers, it says so in the log and follows from the oldest batch it can get
(before, it waited for the missing one forever and learned nothing more of that replica).
"""

from __future__ import annotations

import asyncio
import logging

import msgpack

from jaxserve.scheduler import block_hash
from jaxserve.scheduler.block_hash import BlockHasher

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ReplicaCache:
    """The page hashes one replica announced, applied in order."""

    def __init__(self):
        self.hashes: set[int | bytes] = set()
        self.page_size: int | None = None
        self.next_seq = 0  # the sequence number expected next
        self.synced = False  # caught up through replay (or nothing to catch up on)

    def apply(self, payload: bytes) -> None:
        _ts, events, *_rank = msgpack.unpackb(payload, raw=False)
        for e in events:
            kind = e.get("type") if isinstance(e, dict) else None
            if kind == "BlockStored":
                self.hashes.update(e["block_hashes"])
                self.page_size = e["block_size"]
            elif kind == "BlockRemoved":
                self.hashes.difference_update(e["block_hashes"])
            elif kind == "AllBlocksCleared":
                self.hashes.clear()

    def take(self, seq: int, payload: bytes) -> None:
        """Apply batch ``seq`` if it is the next one; an older one is a duplicate (a replay overlapping the live
        stream), except 0: the replica restarted (its first batch clears everything)."""
        if seq == 0 and self.next_seq:
            self.next_seq = 0
        if seq == self.next_seq:
            self.apply(payload)
            self.next_seq = seq + 1


class PrefixIndex:
    """One ``ReplicaCache`` per replica, fed by a subscriber task per replica (``run``)."""

    def __init__(self, endpoints: dict[str, str], replay: dict[str, str | None], topic: str = "",
                 hasher: BlockHasher | None = None):
        """``endpoints``/``replay``: each replica's PUB and replay endpoints; a data-parallel server publishes each
        rank on its own sockets, given as ``tcp://a:5557+tcp://a:5558`` (rank 0 first), and its cache is what any
        of its ranks holds."""
        self.topic = topic.encode()
        self.ranks: dict[str, list[str]] = {}  # replica -> the names of its ranks' caches
        self.endpoints, self.replay = {}, {}
        for name, endpoint in endpoints.items():
            pubs = endpoint.split("+")
            replays = (replay.get(name) or "").split("+") if replay.get(name) else [None] * len(pubs)
            if len(replays) != len(pubs):
                raise ValueError(f"--kv-events-replay-url: {name} has {len(pubs)} ranks' endpoints but "
                                 f"{len(replays)} replay endpoints")
            self.ranks[name] = [name if i == 0 else f"{name}#dp{i}" for i in range(len(pubs))]
            for key, pub, rep in zip(self.ranks[name], pubs, replays):
                self.endpoints[key], self.replay[key] = pub, rep
        self.caches = {key: ReplicaCache() for key in self.endpoints}
        self.hasher = hasher if hasher is not None else BlockHasher()
        self.int_hashes = block_hash.int_hashes()

    def prompt_hashes(self, token_ids: list[int], page_size: int, cache_salt: str | None = None) -> list:
        """The event-form hashes of a prompt's full pages (only pages another request could have cached)."""
        return [block_hash.external(h, self.int_hashes)
                for h in self.hasher.chain(token_ids, page_size, cache_salt)]

    @property
    def page_size(self) -> int | None:
        return next((c.page_size for c in self.caches.values() if c.page_size), None)

    def longest_prefix(self, name: str, hashes: list[int]) -> int:
        """Leading pages of ``hashes`` the replica ``name`` holds (in any one of its data-parallel ranks)."""
        best = 0
        for key in self.ranks.get(name, ()):
            cache, n = self.caches[key], 0
            for h in hashes:
                if h not in cache.hashes:
                    break
                n += 1
            best = max(best, n)
        return best

    async def run(self) -> None:
        await asyncio.gather(*(self._follow(name) for name in self.endpoints))

    async def _follow(self, name: str) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoints[name])
        cache = self.caches[name]
        watcher = asyncio.ensure_future(self._watch_connections(sub, cache))
        try:
            while True:
                _topic, seq, payload = await sub.recv_multipart()
                seq = int.from_bytes(seq, "big")
                if not cache.synced or seq > cache.next_seq:  # joined late, or missed some: catch up first
                    if self.replay.get(name) is None:
                        if not cache.synced:  # (re)connected: what it held before is unknown
                            cache.hashes.clear()
                        cache.next_seq = seq
                    else:
                        await self._replay(name, cache, cache.next_seq if cache.synced else 0)
                    cache.synced = True
                    if seq < cache.next_seq:
                        continue  # the replay brought it
                    if seq > cache.next_seq:  # not replayed (no answer): follow from here rather than wait forever
                        logger.warning("KV events of %s: batches %d-%d could not be replayed; following from %d "
                                       "(what they announced is unknown)", name, cache.next_seq, seq - 1, seq)
                        cache.next_seq = seq
                cache.take(seq, payload)
        finally:
            watcher.cancel()
            sub.close(0)

    @staticmethod
    async def _watch_connections(sub, cache: ReplicaCache) -> None:
        """A new connection (the replica restarted, or the network broke) may have missed batches, the
        restarted replica's first one included: catch up from 0 with the next batch."""
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        try:
            while True:
                parse_monitor_message(await monitor.recv_multipart())
                cache.synced = False
        finally:
            sub.disable_monitor()
            monitor.close(0)

    async def _replay(self, name: str, cache: ReplicaCache, start: int) -> None:
        """Catch up from ``start`` through the replica's replay socket (if it has one)."""
        import zmq
        import zmq.asyncio

        endpoint = self.replay.get(name)
        if endpoint is None:
            logger.warning("KV events of %s: batches from %d were missed and it has no replay endpoint", name, start)
            return
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        try:
            if start == 0:
                cache.next_seq = 0
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(2000):
                    logger.warning("KV events of %s: no replay answer from %s", name, endpoint)
                    return
                _, seq, payload = await sock.recv_multipart()
                if seq == END_SEQ:
                    return
                seq = int.from_bytes(seq, "big")
                if seq > cache.next_seq:  # the replica's replay buffer no longer reaches back that far
                    logger.warning("KV events of %s: the replay buffer starts at batch %d, after %d; following from "
                                   "there (what batches %d-%d announced is unknown)", name, seq, cache.next_seq,
                                   cache.next_seq, seq - 1)
                    cache.next_seq = seq
                cache.take(seq, payload)
        finally:
            sock.close(0)
