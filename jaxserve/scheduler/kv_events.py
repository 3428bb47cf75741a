"""What the prefix cache announces: a page stored, pages removed, everything cleared (host-only, no jax).

The ``BlockManager`` appends these to its ``events`` list (when one is set) as pages enter and leave the cache;
the engine hands them to a publisher (``jaxserve/engine/kv_events.py``), which encodes them in vLLM's KV-event
format: each event a tagged msgpack array, ``["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium]``, ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``.

Block hashes go out as vLLM's integer form: the first 8 bytes of the page's key (``hash_page``) read as an
unsigned big-endian integer. A stored page's parent is the page before it in its sequence (None for a first
page; a cache salt is already folded into the first page's key).
"""

from __future__ import annotations

import dataclasses

# vLLM's name for the accelerator-memory tier of the cache
MEDIUM = "GPU"


def external_hash(key: bytes) -> int:
    """A page key as the 64-bit unsigned integer routers index by."""
    return int.from_bytes(key[:8], "big")


@dataclasses.dataclass
class BlockStored:
    """Consecutive pages of one sequence entered the cache (``block_hashes[i]`` holds
    ``token_ids[i * block_size:(i + 1) * block_size]``)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM

    def to_wire(self) -> list:
        return ["BlockStored", self.block_hashes, self.parent_block_hash, self.token_ids, self.block_size,
                self.lora_id, self.medium]


@dataclasses.dataclass
class BlockRemoved:
    """Pages left the cache (evicted for room, or forgotten by a reset)."""

    block_hashes: list[int]
    medium: str | None = MEDIUM

    def to_wire(self) -> list:
        return ["BlockRemoved", self.block_hashes, self.medium]


@dataclasses.dataclass
class AllBlocksCleared:
    """Nothing is cached: sent first by a publisher that starts, so a router forgets what an earlier process of
    the same address held."""

    def to_wire(self) -> list:
        return ["AllBlocksCleared"]


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
