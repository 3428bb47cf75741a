"""KV pages per sequence, with automatic prefix caching of full pages shared by reference count."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence as Seq

from jaxserve.scheduler import block_hash
from jaxserve.scheduler.block_hash import BlockHasher
from jaxserve.scheduler.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from jaxserve.scheduler.page_pool import OutOfPages, PagePool
from jaxserve.scheduler.sequence import Sequence, SequenceStatus


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# A page-table entry whose page was released because every layer's window has passed it (``release_behind``).
RELEASED = -1


@dataclasses.dataclass
class PageHolder:
    """Holds a sequence's pages after another engine took the sequence over (``BlockManager.hand_over``), until
    the copy of their KV has landed there and ``free(holder)`` gives them back."""

    seq_id: int
    page_table: list[int]
    local_page_table: list[int]
    table_version: int = 0  # as a Sequence's: ``free`` bumps it


class BlockManager:
    """Hands out KV pages to sequences and keeps computed full pages for reuse.

    Every page is in exactly one state:
      - free: in the ``PagePool`` free list, holding nothing worth keeping;
      - in use: referenced by ``refcount`` page tables (more than one only for full, read-only pages);
      - cached: referenced by nobody but holding a registered full page; reusable by a prefix hit until it
        is evicted (least recently released first) to make room.

    A page is registered in the cache once it is full and its KV has been computed (``register``); it is
    keyed by vLLM's block hash (``hasher``, ``jaxserve/scheduler/block_hash.py``) chained over all pages before
    it, so a hit means the whole prefix (and the salt and adapter) matches, and the keys it announces are the
    ones vLLM would.
    Sequences only ever write at or after ``num_computed_tokens``, which always lies past their shared pages,
    so shared pages are never written.

    With ``attention_window`` (every layer of the model attends to at most that many tokens back), a running
    sequence's pages that no query of it can see any more are released as it goes (``release_behind``): their
    table entries become ``RELEASED``, and the page returns to the pool, or stays cached if registered.
    """

    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_caching: bool = True,
                 attention_window: int | None = None, table: str = "page_table",
                 hasher: BlockHasher | None = None):
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1")
        if attention_window is not None and attention_window < 1:
            raise ValueError(f"attention_window={attention_window} must be >= 1")
        self.page_size = page_size
        self.attention_window = attention_window
        self.table = table  # the Sequence attribute holding this manager's page table (a second pool: its own)
        self.enable_prefix_caching = enable_prefix_caching
        self.hasher = hasher if hasher is not None else BlockHasher()
        self.int_hashes = block_hash.int_hashes()  # how events announce keys (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
        self.pool = PagePool(num_pages)
        self._refcount = [0] * num_pages
        self._hash_of: list[bytes | None] = [None] * num_pages
        self._page_of: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest release first
        self._holders: dict[int, Sequence] = {}  # seq_id -> sequence holding a page table
        self._num_registered: dict[int, int] = {}  # seq_id -> leading pages already offered to the cache
        self._num_released: dict[int, int] = {}  # seq_id -> leading pages released behind the window
        self.num_released_pages = 0  # pages released behind the window, over the manager's life
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens found cached
        self.num_evictions = 0
        # When a list (``record_events``): every page entering or leaving the cache is announced here, in order
        # (jaxserve/scheduler/kv_events.py); the engine takes them after each step (``take_events``).
        self.events: list[KVCacheEvent] | None = None

    def record_events(self) -> None:
        """From now on, announce every page entering or leaving the prefix cache (``take_events``)."""
        if self.events is None:
            self.events = []

    def take_events(self) -> list[KVCacheEvent]:
        """The events announced since the last call (``record_events``), oldest first."""
        events = self.events or []
        if events:
            self.events = []
        return events

    def _t(self, seq: Sequence) -> list[int]:
        return getattr(seq, self.table)

    # ---- counts -------------------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can get: free ones plus cached ones nobody references."""
        return self.pool.num_free + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        """Pages referenced by at least one sequence."""
        return self.num_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        """Pages registered in the prefix cache, referenced or not."""
        return len(self._page_of)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def is_cached(self, page: int) -> bool:
        return self._hash_of[page] is not None

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens of KV."""
        return cdiv(num_tokens, self.page_size)

    # ---- lookup and allocation ----------------------------------------------------------------------------
    def _extra_keys(self, seq: Sequence, page: int) -> block_hash.ExtraKeys:
        lora = None if seq.adapter is None else (seq.adapter, seq.adapter_path)
        return block_hash.extra_keys(page == 0, seq.sampling_params.cache_salt, lora)

    def _hashes(self, seq: Sequence, num_pages: int) -> list[bytes]:
        hashes, ps = seq.page_hashes, self.page_size
        while len(hashes) < num_pages:
            i = len(hashes)
            hashes.append(self.hasher.page(hashes[-1] if hashes else None, seq.token_ids(i * ps, (i + 1) * ps),
                                           self._extra_keys(seq, i)))
        return hashes

    def _external(self, key: bytes) -> int | bytes:
        return block_hash.external(key, self.int_hashes)

    def match_prefix(self, seq: Sequence, share_with: Sequence | None = None) -> list[int]:
        """Pages holding already-computed KV for a leading part of ``seq``'s tokens; changes nothing.

        Never covers all of ``seq``'s tokens: the last one must run through the model to give logits.
        ``share_with`` is a running sibling with the same prompt whose computed full prompt pages may be
        shared even when prefix caching is off.
        """
        limit = (seq.num_tokens - 1) // self.page_size
        pages: list[int] = []
        if self.enable_prefix_caching:
            for h in self._hashes(seq, limit):
                page = self._page_of.get(h)
                if page is None:
                    break
                pages.append(page)
        if share_with is not None and share_with.status is SequenceStatus.RUNNING:
            n = min(limit, seq.num_prompt_tokens // self.page_size, share_with.num_computed_tokens // self.page_size)
            if n > len(pages) and RELEASED not in self._t(share_with)[:n]:
                pages = self._t(share_with)[:n]
        return pages

    def can_allocate(self, num_new_pages: int, reuse: Seq[int] = ()) -> bool:
        """Whether ``num_new_pages`` fresh pages remain available after taking the pages in ``reuse``."""
        taken = sum(1 for p in reuse if self._refcount[p] == 0)  # a cached idle page stops being evictable
        return num_new_pages <= self.num_free_pages - taken

    def admit(self, seq: Sequence, prefix_pages: Seq[int], num_tokens: int) -> None:
        """Give a sequence without pages the shared ``prefix_pages`` and fresh pages up to ``num_tokens`` of KV.

        Sets ``num_computed_tokens`` and ``num_cached_tokens`` to the tokens the prefix covers.
        Raises OutOfPages (taking nothing) if the fresh pages are not available.
        """
        if self._t(seq) or seq.seq_id in self._holders:
            raise ValueError(f"{seq} already holds pages")
        if not self.can_allocate(self.pages_for(num_tokens) - len(prefix_pages), prefix_pages):
            raise OutOfPages(f"cannot admit {seq} with {num_tokens} tokens of KV")
        for page in prefix_pages:
            if self._refcount[page] == 0:
                del self._evictable[page]
            self._refcount[page] += 1
        setattr(seq, self.table, list(prefix_pages))
        seq.table_version += 1
        self._holders[seq.seq_id] = seq
        self._num_registered[seq.seq_id] = len(prefix_pages)
        seq.num_computed_tokens = seq.num_cached_tokens = len(prefix_pages) * self.page_size
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_cached_tokens
        self.grow(seq, num_tokens)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) - len(self._t(seq)) <= self.num_free_pages

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Add pages to ``seq``'s table until it holds ``num_tokens`` tokens of KV; raises OutOfPages."""
        if seq.seq_id not in self._holders:
            raise ValueError(f"{seq} was not admitted")
        need = self.pages_for(num_tokens) - len(self._t(seq))
        if need > self.num_free_pages:
            raise OutOfPages(f"{seq} needs {need} more pages, {self.num_free_pages} available")
        for _ in range(need):
            page = self._take_page()
            self._refcount[page] = 1
            self._t(seq).append(page)
        if need > 0:
            seq.table_version += 1

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Return the pages past the first ``num_tokens`` tokens to the pool (speculation's rollback: KV
        written for rejected draft tokens). They were never registered: registration stops at the computed
        tokens, which these pages lie past."""
        table = self._t(seq)
        keep = self.pages_for(num_tokens)
        while len(table) > keep:
            self._release(table.pop())
            seq.table_version += 1

    def _take_page(self) -> int:
        if self.pool.num_free:
            return self.pool.allocate(1)[0]
        # Reuse the least recently released cached page; its content is forgotten.
        page, _ = self._evictable.popitem(last=False)
        self._forget(page)
        self.num_evictions += 1
        return page

    def _forget(self, page: int) -> None:
        """Drop a cached page's registration (it holds nothing worth keeping from now on)."""
        key = self._hash_of[page]
        del self._page_of[key]
        self._hash_of[page] = None
        if self.events is not None:
            last = self.events[-1] if self.events else None
            if isinstance(last, BlockRemoved):
                last.block_hashes.append(self._external(key))
            else:
                self.events.append(BlockRemoved([self._external(key)]))

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; its registered pages stay cached until evicted, the rest return to the pool."""
        # Release the tail first so that, among equally old pages, eviction takes a sequence's tail before
        # its head: heads (system prompts) are the likelier future hits.
        for page in reversed(self._t(seq)):
            if page != RELEASED:
                self._release(page)
        setattr(seq, self.table, [])
        seq.table_version += 1
        self._holders.pop(seq.seq_id, None)
        self._num_registered.pop(seq.seq_id, None)
        self._num_released.pop(seq.seq_id, None)

    def hand_over(self, seq: Sequence, holder: PageHolder) -> None:
        """From now on ``holder`` holds ``seq``'s pages here (``seq`` continues in another pool); ``free(holder)``
        releases them."""
        if seq.seq_id in self._holders:
            self._holders[seq.seq_id] = holder

    def _release(self, page: int) -> None:
        self._refcount[page] -= 1
        if self._refcount[page] == 0:
            if self._hash_of[page] is not None:
                self._evictable[page] = None
            else:
                self.pool.free([page])

    def release_behind(self, seq: Sequence) -> int:
        """Release the pages of ``seq`` that lie wholly before the attention window of its next query.

        The next query is at position ``num_computed_tokens`` and sees keys after ``position - window``, so
        it and every later query skip page ``i`` once ``(i + 1) * page_size <= position - window + 1``.
        A no-op without ``attention_window``. Returns the number of pages released now.
        """
        if self.attention_window is None or seq.seq_id not in self._holders:
            return 0
        first_needed = max(seq.num_computed_tokens - self.attention_window + 1, 0) // self.page_size
        start = self._num_released.get(seq.seq_id, 0)
        end = min(first_needed, len(self._t(seq)))
        for i in range(start, end):
            self._release(self._t(seq)[i])
            self._t(seq)[i] = RELEASED
        if end > start:
            seq.table_version += 1
            self._num_released[seq.seq_id] = end
            self.num_released_pages += end - start
        return max(end - start, 0)

    def pages_held(self, seq: Sequence) -> int:
        """Pages ``seq`` references now (its table less the entries released behind the window)."""
        return sum(1 for p in self._t(seq) if p != RELEASED)

    @staticmethod
    def readable_table(page_table: list[int]) -> list[int]:
        """A page table the kernels can take: released entries point at the sequence's first held page.
        Attention never reads them (they lie before every query's window; the reference reads and masks them)
        and writes land only at positions past them."""
        if RELEASED not in page_table:
            return list(page_table)
        fill = next((p for p in page_table if p != RELEASED), 0)
        return [fill if p == RELEASED else p for p in page_table]

    def register(self, seq: Sequence) -> None:
        """Offer ``seq``'s newly full, computed pages to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        start = self._num_registered.get(seq.seq_id)
        # (no page newly full, the common case: one comparison, asked per running sequence per step)
        if start is None or seq.num_computed_tokens // self.page_size <= start:
            return
        end = min(seq.num_computed_tokens // self.page_size, len(self._t(seq)))
        if end <= start:
            return
        hashes = self._hashes(seq, end)
        run: BlockStored | None = None  # the event of the pages stored just before this one
        for i in range(start, end):
            page, h = self._t(seq)[i], hashes[i]
            if page == RELEASED:  # already behind the window (async scheduling registers a step later): not kept
                run = None
                continue
            # Another sequence may have computed the same content into its own page first; keep that one
            # and let this copy return to the pool when released.
            if h not in self._page_of:
                self._page_of[h] = page
                self._hash_of[page] = h
                if self.events is not None:
                    ps = self.page_size
                    tokens = seq.token_ids(i * ps, (i + 1) * ps)
                    keys = block_hash.event_extra_keys(self._extra_keys(seq, i))
                    if run is not None:
                        run.block_hashes.append(self._external(h))
                        run.token_ids.extend(tokens)
                        run.extra_keys.append(keys)
                    else:
                        run = BlockStored([self._external(h)], self._external(hashes[i - 1]) if i else None,
                                          list(tokens), ps, lora_id=seq.adapter_id, lora_name=seq.adapter,
                                          extra_keys=[keys])
                        self.events.append(run)
            else:
                run = None
        self._num_registered[seq.seq_id] = end

    def forget_prefixes(self) -> None:
        """New weights: no page computed before now is ever matched again. Every registered page leaves the
        cache (announced removed): those nobody references go back to the pool now, the others as their
        sequences finish; and the running sequences, whose KV mixes old and new weights, register no more. The
        keys stay vLLM's (as vLLM, which resets its prefix cache on new weights)."""
        self.reset_prefix_cache()
        for page, key in enumerate(self._hash_of):
            if key is not None:
                self._forget(page)
        self._num_registered.clear()

    def reset_prefix_cache(self) -> None:
        """Forget every cached page nobody references (e.g. after new weights are loaded)."""
        while self._evictable:
            page, _ = self._evictable.popitem(last=False)
            self._forget(page)
            self.pool.free([page])

    def stats(self) -> dict[str, int]:
        return {
            "pages_total": self.num_pages,
            "pages_used": self.num_used_pages,
            "pages_free": self.num_free_pages,
            "pages_cached": self.num_cached_pages,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "cache_evictions": self.num_evictions,
            "pages_released_behind_window": self.num_released_pages,
        }

    # ---- checking -----------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the page accounting is inconsistent (for tests and debugging)."""
        holders = self._holders.values()
        counts = [0] * self.num_pages
        for seq in holders:
            held = [p for p in self._t(seq) if p != RELEASED]
            if len(set(held)) != len(held):
                raise AssertionError(f"{seq} holds a page twice: {self._t(seq)}")
            if seq.num_computed_tokens > len(self._t(seq)) * self.page_size:
                raise AssertionError(f"{seq} has more computed tokens than page slots")
            released = self._num_released.get(seq.seq_id, 0)
            if any(p == RELEASED for p in self._t(seq)[released:]) or RELEASED in held:
                raise AssertionError(f"{seq}: released entries are not exactly its first {released}")
            if self.attention_window is None and released:
                raise AssertionError(f"{seq} released pages without an attention window")
            if released * self.page_size > max(seq.num_computed_tokens - (self.attention_window or 0) + 1, 0):
                raise AssertionError(f"{seq} released a page its next query can still see")
            for page in held:
                counts[page] += 1
        for page in range(self.num_pages):
            free, used, idle = self.pool.is_free(page), self._refcount[page] > 0, page in self._evictable
            if free + used + idle != 1:
                raise AssertionError(f"page {page}: free={free} in_use={used} cached_idle={idle}, want exactly one")
            if counts[page] != self._refcount[page]:
                raise AssertionError(f"page {page}: refcount {self._refcount[page]} but {counts[page]} page tables")
            h = self._hash_of[page]
            if (free and h is not None) or (idle and h is None):
                raise AssertionError(f"page {page}: free={free} idle={idle} hash={h!r}")
            if h is not None and self._page_of.get(h) != page:
                raise AssertionError(f"page {page}: hash not mapped back to it")
        if len(self._page_of) != sum(h is not None for h in self._hash_of):
            raise AssertionError("cache map and page hashes disagree")
        for seq in holders:
            # Only full computed pages may be shared: writes land at num_computed_tokens and beyond.
            first_writable = seq.num_computed_tokens // self.page_size
            if any(self._refcount[p] > 1 for p in self._t(seq)[first_writable:]):
                raise AssertionError(f"{seq} shares a page it may still write")
