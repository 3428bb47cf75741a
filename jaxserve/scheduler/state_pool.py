"""State slots beside the KV pages, for hybrid models whose linear-attention layers keep a fixed-size recurrent
state per sequence instead of a KV cache (Qwen3-Next, Qwen3.5; ``jaxserve.models.gated_deltanet``).

Each running sequence owns one state slot (its convolution and delta-rule states in every linear layer) and its
KV pages in the full-attention layers. ``StateBlockManager`` keeps both behind the one interface the scheduler
uses: a sequence is admitted only when a slot and its pages are free, and ``free`` (finish, abort, preemption)
returns both at once. The slot rides to the device as the one entry of ``Sequence.local_page_table`` (the
executor appends it to the sequence's page-table row). Host-only (no jax).

Prefix caching is off for these models: a cached prefix holds the attention layers' KV but not the recurrent
state at its end, so a hit could not be resumed exactly. For the same reason ``n > 1`` siblings recompute the
prompt instead of sharing its pages.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from jaxserve.scheduler.block_manager import BlockManager
from jaxserve.scheduler.page_pool import OutOfPages
from jaxserve.scheduler.sequence import Sequence


class StateSlots:
    """A free list over state slots ``1 .. num_slots - 1`` (slot 0 is the device's scratch: padding writes it)."""

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"num_slots={num_slots} must be >= 2 (slot 0 is scratch)")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, 0, -1))  # a stack: pop() gives the lowest id
        self._owner: dict[int, int] = {}  # seq_id -> slot

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def slot_of(self, seq_id: int) -> int | None:
        return self._owner.get(seq_id)

    def take(self, seq_id: int) -> int:
        if seq_id in self._owner:
            raise ValueError(f"sequence {seq_id} already holds state slot {self._owner[seq_id]}")
        if not self._free:
            raise OutOfPages(f"no free state slot ({self.num_slots - 1} in use)")
        slot = self._owner[seq_id] = self._free.pop()
        return slot

    def give_back(self, seq_id: int) -> None:
        slot = self._owner.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)


class StateBlockManager:
    """``pages`` (a ``BlockManager`` without prefix caching) for the full-attention layers' KV, ``slots`` for the
    linear layers' states. Counts and statistics are the pages', plus the slots'."""

    def __init__(self, num_pages: int, num_slots: int, page_size: int):
        self.pages = BlockManager(num_pages, page_size, enable_prefix_caching=False)
        self.slots = StateSlots(num_slots)
        self.page_size = page_size

    def __getattr__(self, name):  # counts, the pool, pages_for, ...: the pages'
        return getattr(self.pages, name)

    def match_prefix(self, seq: Sequence, share_with: Sequence | None = None) -> list[int]:
        return []  # nothing is shared: the state at a prefix's end is not kept

    def can_allocate(self, num_new_pages: int, reuse: Seq[int] = ()) -> bool:
        return self.slots.num_free > 0 and self.pages.can_allocate(num_new_pages, reuse)

    def admit(self, seq: Sequence, prefix_pages: Seq[int], num_tokens: int) -> None:
        if prefix_pages:
            raise ValueError(f"{seq}: a hybrid model's sequence shares no prefix pages")
        if not self.slots.num_free:
            raise OutOfPages(f"cannot admit {seq}: no free state slot")
        self.pages.admit(seq, prefix_pages, num_tokens)
        seq.local_page_table = [self.slots.take(seq.seq_id)]

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.pages.can_grow(seq, num_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        self.pages.grow(seq, num_tokens)

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        self.pages.shrink(seq, num_tokens)

    def release_behind(self, seq: Sequence) -> int:
        return 0

    def pages_held(self, seq: Sequence) -> int:
        return self.pages.pages_held(seq)

    def free(self, seq: Sequence) -> None:
        """Return the sequence's pages and its state slot together (finish, abort, preemption)."""
        self.pages.free(seq)
        self.slots.give_back(seq.seq_id)
        if hasattr(seq, "local_page_table"):
            seq.local_page_table = []

    def hand_over(self, seq: Sequence, holder) -> None:
        raise ValueError("a hybrid model's sequences cannot be handed to another engine (disaggregation): their "
                         "recurrent state does not travel with the pages")

    def register(self, seq: Sequence) -> None:
        pass  # no prefix cache

    def forget_prefixes(self) -> None:
        self.pages.forget_prefixes()

    def reset_prefix_cache(self) -> None:
        self.pages.reset_prefix_cache()

    def stats(self) -> dict[str, int]:
        return {**self.pages.stats(), "state_slots_total": self.slots.num_slots - 1,
                "state_slots_used": self.slots.num_used}

    def check_invariants(self) -> None:
        self.pages.check_invariants()
        held = {s for s in self.pages._holders}
        owners = set(self.slots._owner)
        if held != owners:
            raise AssertionError(f"sequences holding pages {sorted(held)} and state slots {sorted(owners)} differ")
