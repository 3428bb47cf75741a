"""What the prefix cache announces: pages stored, pages removed, everything cleared (host-only, no jax).

The ``BlockManager`` appends these to its ``events`` list (when one is set) as pages enter and leave the cache;
the engine hands them to a publisher (``jaxserve/engine/kv_events.py``), which encodes them in vLLM's KV-event
format (``vllm/distributed/kv_events.py``, followed as of vLLM 0.34; 0.32 declares the same fields but
``lookahead_token_ids``): each event a msgpack map tagged by ``"type"``, fields with their default value left
out, the fields without a default always present::

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None, "token_ids": [...],
     "block_size": n, "lora_id": id | None, "medium": "GPU", "lora_name": name | None,
     "extra_keys": [keys | None, ...], "group_idx": 0}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", "group_idx": 0}
    {"type": "AllBlocksCleared"}

Block hashes are vLLM's (``jaxserve/scheduler/block_hash.py``), announced as it does: the low 64 bits as an
unsigned integer, or the whole digest as bytes with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``. A stored page's
parent is the page before it in its sequence (None for a first page). ``extra_keys`` holds one entry per block:
the adapter's name and, on a first page, the cache salt, untagged (None for a page with neither), as vLLM sends
it.
"""

from __future__ import annotations

import dataclasses

# vLLM's name for the accelerator-memory tier of the cache
MEDIUM = "GPU"
# jaxserve's pages are one KV-cache group (vLLM's group 0: every layer's pages share their hashes)
GROUP = 0


@dataclasses.dataclass
class BlockStored:
    """Consecutive pages of one sequence entered the cache (``block_hashes[i]`` holds
    ``token_ids[i * block_size:(i + 1) * block_size]``)."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM
    lora_name: str | None = None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = GROUP

    def to_wire(self) -> dict:
        wire = {"type": "BlockStored", "block_hashes": self.block_hashes,
                "parent_block_hash": self.parent_block_hash, "token_ids": self.token_ids,
                "block_size": self.block_size, "lora_id": self.lora_id, "medium": self.medium,
                "lora_name": self.lora_name}
        if self.extra_keys is not None:
            wire["extra_keys"] = [None if k is None else list(k) for k in self.extra_keys]
        if self.group_idx is not None:
            wire["group_idx"] = self.group_idx
        return wire


@dataclasses.dataclass
class BlockRemoved:
    """Pages left the cache (evicted for room, or forgotten by a reset)."""

    block_hashes: list[int | bytes]
    medium: str | None = MEDIUM
    group_idx: int | None = GROUP

    def to_wire(self) -> dict:
        wire = {"type": "BlockRemoved", "block_hashes": self.block_hashes, "medium": self.medium}
        if self.group_idx is not None:
            wire["group_idx"] = self.group_idx
        return wire


@dataclasses.dataclass
class AllBlocksCleared:
    """Nothing is cached: sent first by a publisher that starts, so a router forgets what an earlier process of
    the same address held."""

    def to_wire(self) -> dict:
        return {"type": "AllBlocksCleared"}


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
