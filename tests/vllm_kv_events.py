"""vLLM's KV-event batch, written here from the field list vLLM publishes in ``vllm/distributed/kv_events.py``
(vLLM 0.34.0, the current release; 0.32.0 declares the same fields but ``lookahead_token_ids``), as msgspec
structs declared the way vLLM declares them: the batch an array, each event a map tagged by ``"type"`` with the
class name, defaults left out. Decoding with ``KVEventBatch`` is what llm-d's and Dynamo's subscribers do; a
message that does not fit raises ``msgspec.ValidationError``."""

from __future__ import annotations

from typing import Any

import msgspec

VLLM_VERSION = "0.34.0"

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
