"""Limits the scheduler works within, validated on construction (ValueError names the field)."""

from __future__ import annotations

import dataclasses


def pages_per_seq(max_model_len: int, page_size: int) -> int:
    """Page-table width that holds a ``max_model_len`` sequence."""
    return -(-max_model_len // page_size)


# vLLM's --prefix-caching-hash-algo choices (jaxserve/scheduler/block_hash.py); the first is its default
PREFIX_CACHING_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Batch and KV-cache limits of continuous batching.

    ``max_model_len`` bounds prompt + output tokens of one sequence. ``max_num_batched_tokens`` bounds the
    new tokens of one step (decodes count 1 each). ``long_prefill_token_threshold`` (0 = off) caps one
    sequence's prefill chunk per step so a long prompt leaves room for other prompts as well.
    """

    num_pages: int
    page_size: int = 16
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"  # the page keys: vLLM's block hash (jaxserve/scheduler/block_hash.py)
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    # Every layer attends to at most this many tokens back (a model whose layers are all windowed): pages
    # behind it are released while a sequence runs. None: some layer sees the whole sequence.
    attention_window: int | None = None
    # A model interleaving windowed and global layers: the windowed layers' own pool of `local_pages` pages,
    # recycled behind `local_window` (jaxserve/scheduler/window_pool.py). 0 pages: one pool for every layer.
    local_window: int | None = None
    local_pages: int = 0
    # A hybrid model (linear-attention layers): a state slot per running sequence beside its pages, from a pool of
    # `state_slots` (jaxserve/scheduler/state_pool.py). 0: no state pool.
    state_slots: int = 0
    # LoRA: the most distinct adapters running at once (0: no adapters); a sequence whose adapter would exceed it
    # waits
    max_loras: int = 0

    def __post_init__(self):
        positive = ("num_pages", "page_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens")
        for field in positive:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SchedulerConfig.{field}={value!r} must be an integer >= 1")
        for field in ("enable_prefix_caching", "enable_chunked_prefill"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"SchedulerConfig.{field}={getattr(self, field)!r} must be a bool")
        if self.prefix_caching_hash_algo not in PREFIX_CACHING_HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo={self.prefix_caching_hash_algo!r} must be one of "
                             f"{', '.join(PREFIX_CACHING_HASH_ALGOS)}")
        t = self.long_prefill_token_threshold
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"SchedulerConfig.long_prefill_token_threshold={t!r} must be an integer >= 0")
        w = self.attention_window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(f"SchedulerConfig.attention_window={w!r} must be None or an integer >= 1")
        if (self.local_window is None) != (self.local_pages == 0) or self.local_pages < 0:
            raise ValueError(f"SchedulerConfig.local_window={self.local_window!r} and local_pages={self.local_pages!r} "
                             "must be set together")
        if not isinstance(self.state_slots, int) or self.state_slots < 0 or 0 < self.state_slots < self.max_num_seqs:
            raise ValueError(f"SchedulerConfig.state_slots={self.state_slots!r} must be 0 or at least "
                             f"max_num_seqs={self.max_num_seqs}")
        if self.max_model_len < 2:
            raise ValueError(f"SchedulerConfig.max_model_len={self.max_model_len} must be >= 2 (prompt and output)")
        # One sequence of max_model_len tokens must fit alone, or it could never finish.
        if self.num_pages * self.page_size < self.max_model_len:
            raise ValueError(
                f"SchedulerConfig.num_pages={self.num_pages} holds {self.num_pages * self.page_size} tokens, "
                f"fewer than max_model_len={self.max_model_len}"
            )
        # Each running sequence can get at least its decode token every step.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"SchedulerConfig.max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_num_seqs={self.max_num_seqs}"
            )
        # Without chunking a whole prompt (or recomputation) must fit one step.
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"SchedulerConfig.max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_model_len={self.max_model_len} when enable_chunked_prefill is off"
            )

    @property
    def pages_per_seq(self) -> int:
        """Page-table width that holds a max_model_len sequence."""
        return pages_per_seq(self.max_model_len, self.page_size)
