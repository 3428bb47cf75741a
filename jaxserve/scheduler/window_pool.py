"""Two page pools for models that interleave windowed and global layers (Gemma 2/3).

The global layers read a sequence's whole KV; the windowed layers only its last ``window`` tokens. Giving the
windowed layers their own, smaller pool (their own ``[heads, window_pages, page_size, head_dim]`` arrays and a
second page table per sequence, ``Sequence.local_page_table``) lets that pool recycle every page behind the window
while the sequence runs (``BlockManager.release_behind``), so a long sequence holds a full cache only in its global
layers. ``WindowedBlockManager`` keeps the two ``BlockManager`` s in step behind the one interface the scheduler
uses: every admission, growth, release and registration happens in both, and a prefix hit is the part of the
prefix both pools still hold. Host-only (no jax).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from jaxserve.scheduler.block_hash import BlockHasher
from jaxserve.scheduler.block_manager import BlockManager
from jaxserve.scheduler.page_pool import OutOfPages
from jaxserve.scheduler.sequence import Sequence


def window_pages_needed(window: int, page_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Windowed-pool pages that always suffice: each running sequence holds at most the pages of its window
    (``ceil((window - 1) / page_size) + 1``) plus one page its chunk starts in, and a step's chunks together span
    at most ``ceil(max_num_batched_tokens / page_size) + max_num_seqs`` new pages."""
    per_seq = -(-(window - 1) // page_size) + 2
    return max_num_seqs * per_seq + -(-max_num_batched_tokens // page_size) + max_num_seqs



def global_pool_budget(budget: float, page_bytes: float, windows: Seq[int | None], local_pages: int
                       ) -> tuple[float, float]:
    """(memory, bytes per page) left for the global pool of a model with these per-layer ``windows`` once the
    windowed layers' own pool of ``local_pages`` pages is set aside: each pool's pages hold only its own layers'
    KV (``page_bytes``: a page of every layer's). The engine (``executor.builder``) and the planner size pools with it."""
    windowed = sum(w is not None for w in windows) / len(windows)
    return budget - local_pages * page_bytes * windowed, page_bytes * (1 - windowed)

class WindowedBlockManager:
    """``full`` holds the global layers' pages (``Sequence.page_table``), ``windowed`` the windowed layers'
    (``Sequence.local_page_table``), releasing pages behind ``window``. Counts and statistics are ``full``'s."""

    def __init__(self, num_pages: int, num_window_pages: int, page_size: int, *, window: int,
                 enable_prefix_caching: bool = True, hasher: BlockHasher | None = None):
        # (one hasher for both: a sequence's page keys are computed once, in ``Sequence.page_hashes``)
        self.full = BlockManager(num_pages, page_size, enable_prefix_caching=enable_prefix_caching, hasher=hasher)
        self.windowed = BlockManager(num_window_pages, page_size, enable_prefix_caching=enable_prefix_caching,
                                     attention_window=window, table="local_page_table", hasher=self.full.hasher)
        self.page_size = page_size
        self._window_prefix: dict[int, list[int]] = {}  # seq_id -> windowed-pool pages of its last prefix match
        self._last_match = -1  # the seq_id match_prefix last answered for (can_allocate follows it)

    def __getattr__(self, name):  # counts, statistics, the pool: the global layers' (what limits admission)
        return getattr(self.full, name)

    def match_prefix(self, seq: Sequence, share_with: Sequence | None = None) -> list[int]:
        full = self.full.match_prefix(seq, share_with)
        windowed = self.windowed.match_prefix(seq, share_with)
        n = min(len(full), len(windowed))
        self._window_prefix[seq.seq_id] = windowed[:n]
        self._last_match = seq.seq_id
        return full[:n]

    def can_allocate(self, num_new_pages: int, reuse: Seq[int] = ()) -> bool:
        return (self.full.can_allocate(num_new_pages, reuse)
                and self.windowed.can_allocate(num_new_pages, self._window_prefix.get(self._last_match, ())))

    def admit(self, seq: Sequence, prefix_pages: Seq[int], num_tokens: int) -> None:
        windowed = self._window_prefix.pop(seq.seq_id, [])[: len(prefix_pages)]
        if len(windowed) != len(prefix_pages):
            raise ValueError(f"{seq}: admitted with a prefix match_prefix did not return")
        if not self.windowed.can_allocate(self.pages_for(num_tokens) - len(windowed), windowed):
            raise OutOfPages(f"cannot admit {seq} with {num_tokens} tokens of KV in the windowed pool")
        self.full.admit(seq, prefix_pages, num_tokens)
        self.windowed.admit(seq, windowed, num_tokens)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.full.can_grow(seq, num_tokens) and self.windowed.can_grow(seq, num_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        if not self.can_grow(seq, num_tokens):
            raise OutOfPages(f"{seq} cannot grow to {num_tokens} tokens")
        self.full.grow(seq, num_tokens)
        self.windowed.grow(seq, num_tokens)

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        self.full.shrink(seq, num_tokens)
        self.windowed.shrink(seq, num_tokens)

    def release_behind(self, seq: Sequence) -> int:
        return self.windowed.release_behind(seq)

    def pages_held(self, seq: Sequence) -> int:
        return self.full.pages_held(seq)

    def free(self, seq: Sequence) -> None:
        self.full.free(seq)
        self.windowed.free(seq)
        self._window_prefix.pop(seq.seq_id, None)

    def hand_over(self, seq: Sequence, holder) -> None:
        self.full.hand_over(seq, holder)
        self.windowed.hand_over(seq, holder)

    def register(self, seq: Sequence) -> None:
        self.full.register(seq)
        self.windowed.register(seq)

    def forget_prefixes(self) -> None:
        self.full.forget_prefixes()
        self.windowed.forget_prefixes()

    def reset_prefix_cache(self) -> None:
        self.full.reset_prefix_cache()
        self.windowed.reset_prefix_cache()

    def stats(self) -> dict[str, int]:
        return {**self.full.stats(), "window_pages_total": self.windowed.num_pages,
                "window_pages_used": self.windowed.num_used_pages,
                "pages_released_behind_window": self.windowed.num_released_pages}

    def check_invariants(self) -> None:
        self.full.check_invariants()
        self.windowed.check_invariants()
