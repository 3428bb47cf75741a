"""BlockManager: page accounting, prefix-cache hits, divergence inside a page, LRU eviction, refcounts."""

import pytest

from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.block_hash import BlockHasher, external
from jaxserve.scheduler.block_manager import RELEASED, BlockManager
from jaxserve.scheduler.page_pool import OutOfPages
from jaxserve.scheduler.sequence import Sequence, SequenceStatus

pytestmark = pytest.mark.quick

PS = 4


def seq_of(tokens, rid="r"):
    return Sequence(rid, tokens)


def run_prefill(bm, seq):
    """Admit with whatever prefix is cached, compute the rest in one go, register the full pages."""
    prefix = bm.match_prefix(seq)
    bm.admit(seq, prefix, seq.num_tokens)
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = seq.num_tokens
    bm.register(seq)
    bm.check_invariants()
    return prefix


def test_plain_allocation_returns_every_page():
    bm = BlockManager(8, PS, enable_prefix_caching=False)
    a, b = seq_of(range(10), "a"), seq_of(range(100, 105), "b")
    run_prefill(bm, a)
    run_prefill(bm, b)
    assert len(a.page_table) == 3 and len(b.page_table) == 2
    assert bm.num_used_pages == 5 and bm.num_free_pages == 3
    bm.grow(b, 9)  # decoding past a page boundary adds a page
    assert len(b.page_table) == 3
    with pytest.raises(OutOfPages):
        bm.grow(a, 10 + 3 * PS)
    assert len(a.page_table) == 3  # a failed grow takes nothing
    bm.free(a)
    bm.free(b)
    bm.check_invariants()
    assert bm.num_free_pages == 8 and bm.pool.num_free == 8 and bm.num_cached_pages == 0


def test_repeated_system_prompt_hits_its_full_pages():
    bm = BlockManager(16, PS)
    system = list(range(50, 61))  # 11 tokens: 2 full pages + 3 tokens
    a = seq_of(system + [1, 2, 3], "a")
    assert run_prefill(bm, a) == []
    assert bm.num_cached_pages == 3  # 14 tokens: pages 0..2 full and computed
    b = seq_of(system + [7, 8, 9, 10, 11], "b")
    prefix = run_prefill(bm, b)
    assert prefix == a.page_table[:2]
    assert b.num_cached_tokens == 2 * PS
    assert bm.refcount(prefix[0]) == 2 and bm.refcount(a.page_table[2]) == 1
    assert bm.prefix_cache_queries == a.num_tokens + b.num_tokens
    assert bm.prefix_cache_hits == 2 * PS
    # The third page holds system[8:11] + a's suffix, so b recomputes it into its own page.
    assert b.page_table[2] != a.page_table[2]


def test_identical_prompt_never_fully_cached():
    bm = BlockManager(16, PS)
    tokens = list(range(3 * PS))  # exactly 3 full pages
    run_prefill(bm, seq_of(tokens, "a"))
    b = seq_of(tokens, "b")
    assert len(bm.match_prefix(b)) == 2  # the last page holds the last token, which must be recomputed
    c = seq_of(tokens + [99], "c")
    assert len(bm.match_prefix(c)) == 3


def test_divergence_in_the_middle_of_a_page_is_not_shared():
    bm = BlockManager(16, PS)
    a = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "a")
    run_prefill(bm, a)
    # Same first 6 tokens, then different: page 1 ([5, 6, 7, 8] vs [5, 6, 70, 80]) must not be shared.
    b = seq_of([1, 2, 3, 4, 5, 6, 70, 80, 90, 100], "b")
    prefix = run_prefill(bm, b)
    assert prefix == [a.page_table[0]]
    assert b.num_computed_tokens == b.num_tokens and b.num_cached_tokens == PS
    assert b.page_table[1] != a.page_table[1]
    # Same page content at the same position but a different earlier page: the chained hash must miss.
    c = seq_of([0, 2, 3, 4, 5, 6, 7, 8, 9], "c")
    assert bm.match_prefix(c) == []
    e = seq_of([0, 2, 3, 4, 50, 60, 70, 80, 9], "e")
    run_prefill(bm, e)
    # a's first page followed by e's second: e's second page was computed after a different first page.
    d = seq_of([1, 2, 3, 4, 50, 60, 70, 80, 9], "d")
    assert d.token_ids(4, 8) == e.token_ids(4, 8)
    assert bm.match_prefix(d) == [a.page_table[0]]


def test_unreferenced_pages_stay_cached_and_evict_least_recently_released_first():
    bm = BlockManager(6, PS)
    a = seq_of(list(range(0, 8)) + [0], "a")  # 2 full pages + 1
    b = seq_of(list(range(100, 108)) + [0], "b")
    run_prefill(bm, a)
    run_prefill(bm, b)
    a_pages, b_pages = a.page_table[:2], b.page_table[:2]
    bm.free(a)
    bm.free(b)
    bm.check_invariants()
    assert bm.num_cached_pages == 4 and bm.num_free_pages == 6 and bm.pool.num_free == 2
    # 2 free pages are used first; the next takes a's tail page, then a's head, then b's tail.
    c = seq_of(list(range(200, 220)), "c")
    bm.admit(c, [], 2 * PS)
    assert bm.num_evictions == 0 and bm.num_cached_pages == 4
    bm.grow(c, 3 * PS)
    assert bm.num_evictions == 1 and c.page_table[-1] == a_pages[1]
    bm.grow(c, 4 * PS)
    assert c.page_table[-1] == a_pages[0]
    bm.grow(c, 5 * PS)
    assert c.page_table[-1] == b_pages[1] and bm.num_evictions == 3
    bm.check_invariants()
    assert len(bm.match_prefix(seq_of(list(range(0, 8)) + [0]))) == 0
    assert bm.match_prefix(seq_of(list(range(100, 108)) + [0])) == [b_pages[0]]


def test_a_cache_hit_refreshes_recency():
    bm = BlockManager(4, PS)
    a = seq_of(list(range(0, 4)) + [0], "a")
    b = seq_of(list(range(10, 14)) + [0], "b")
    for s in (a, b):
        run_prefill(bm, s)
        bm.free(s)
    a2 = seq_of(list(range(0, 4)) + [5], "a2")  # hit on a's page, released after b's
    hit = run_prefill(bm, a2)
    bm.free(a2)
    d = seq_of(list(range(300, 316)), "d")
    bm.admit(d, [], 3 * PS)  # 2 free pages + 1 eviction: b's page is now the oldest
    assert bm.match_prefix(seq_of(list(range(0, 4)) + [0])) == hit
    assert bm.match_prefix(seq_of(list(range(10, 14)) + [0])) == []


def test_refcounts_follow_page_tables():
    bm = BlockManager(12, PS)
    base = list(range(2 * PS))
    a = seq_of(base + [1], "a")
    run_prefill(bm, a)
    b, c = seq_of(base + [2], "b"), seq_of(base + [3], "c")
    run_prefill(bm, b)
    run_prefill(bm, c)
    shared = a.page_table[:2]
    assert b.page_table[:2] == shared == c.page_table[:2]
    assert [bm.refcount(p) for p in shared] == [3, 3]
    bm.free(b)
    assert [bm.refcount(p) for p in shared] == [2, 2]
    bm.free(a)
    bm.free(c)
    bm.check_invariants()
    assert [bm.refcount(p) for p in shared] == [0, 0] and all(bm.is_cached(p) for p in shared)
    assert bm.num_used_pages == 0


def test_admission_counts_cached_idle_pages_it_takes():
    bm = BlockManager(3, PS)
    a = seq_of(list(range(2 * PS)) + [0], "a")
    run_prefill(bm, a)
    bm.free(a)  # 2 cached idle pages + 1 free
    b = seq_of(list(range(2 * PS)) + [1, 2, 3], "b")
    prefix = bm.match_prefix(b)
    assert len(prefix) == 2
    assert bm.num_free_pages == 3
    assert bm.can_allocate(1, prefix) and not bm.can_allocate(2, prefix)
    with pytest.raises(OutOfPages):
        bm.admit(b, prefix, 4 * PS)
    bm.check_invariants()
    bm.admit(b, prefix, b.num_tokens)
    bm.check_invariants()
    assert bm.num_free_pages == 0


def test_duplicate_content_computed_twice_keeps_one_cached_copy():
    bm = BlockManager(8, PS)
    a, b = seq_of(list(range(PS)) + [1], "a"), seq_of(list(range(PS)) + [2], "b")
    for s in (a, b):  # both admitted before either computed: no hit
        bm.admit(s, bm.match_prefix(s), s.num_tokens)
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        bm.register(s)
    assert bm.num_cached_pages == 1 and bm.is_cached(a.page_table[0]) and not bm.is_cached(b.page_table[0])
    b_copy = b.page_table[0]
    bm.free(b)
    bm.check_invariants()
    assert bm.pool.is_free(b_copy) and bm.num_cached_pages == 1


def test_pages_are_registered_only_once_computed():
    bm = BlockManager(8, PS)
    a = seq_of(list(range(3 * PS)), "a")
    bm.admit(a, [], 2 * PS)
    a.num_computed_tokens = PS + 2  # one full computed page, one half-computed
    bm.register(a)
    assert bm.num_cached_pages == 1
    a.num_computed_tokens = 2 * PS
    bm.register(a)
    assert bm.num_cached_pages == 2
    bm.check_invariants()


def test_caching_off_never_hits_and_frees_to_pool():
    bm = BlockManager(8, PS, enable_prefix_caching=False)
    a = seq_of(list(range(3 * PS)), "a")
    run_prefill(bm, a)
    bm.free(a)
    assert bm.num_cached_pages == 0 and bm.pool.num_free == 8
    assert bm.match_prefix(seq_of(list(range(3 * PS)), "b")) == []
    assert bm.prefix_cache_queries == 0


def test_reset_prefix_cache_returns_idle_pages_to_pool():
    bm = BlockManager(8, PS)
    a, b = seq_of(list(range(2 * PS)) + [1], "a"), seq_of(list(range(50, 50 + 2 * PS)) + [1], "b")
    run_prefill(bm, a)
    run_prefill(bm, b)
    bm.free(a)
    bm.reset_prefix_cache()
    bm.check_invariants()
    assert bm.num_cached_pages == 2  # b still holds its cached pages
    assert bm.pool.num_free == 8 - len(b.page_table)


def test_check_invariants_catches_corruption():
    bm = BlockManager(8, PS)
    a = seq_of(list(range(2 * PS)) + [1], "a")
    run_prefill(bm, a)
    bm._refcount[a.page_table[0]] += 1
    with pytest.raises(AssertionError, match="refcount"):
        bm.check_invariants()
    bm._refcount[a.page_table[0]] -= 1
    bm.check_invariants()
    a.page_table.append(a.page_table[0])
    with pytest.raises(AssertionError, match="twice"):
        bm.check_invariants()


def test_page_keys_are_vllms_block_hashes_and_events_announce_them(monkeypatch):
    """The keys are vLLM's chain (tests/scheduler/test_block_hash.py holds the vectors); an adapter's pages carry
    its name, id and (untagged) extra keys, the salt only on the first page."""
    bm = BlockManager(32, PS, hasher=BlockHasher("sha256_cbor"))
    bm.record_events()
    prompt = list(range(13))  # three full pages
    seq = Sequence("a", prompt, SamplingParams(cache_salt="t"), adapter="sql", adapter_id=3, adapter_path="/a/sql")
    run_prefill(bm, seq)
    chain = BlockHasher("sha256_cbor").chain(prompt, PS, cache_salt="t", lora=("sql", "/a/sql"))
    assert seq.page_hashes == chain and set(bm._page_of) == set(chain)
    [event] = bm.take_events()
    assert event.block_hashes == [external(h) for h in chain] and event.parent_block_hash is None
    assert (event.lora_id, event.lora_name) == (3, "sql")
    assert event.extra_keys == [("sql", "t"), ("sql",), ("sql",)]
    assert event.to_wire()["extra_keys"] == [["sql", "t"], ["sql"], ["sql"]]


def test_new_weights_forget_every_page_and_running_sequences_register_no_more():
    """After new weights no page computed before is matched: not the idle cached ones, not those a running
    sequence still holds, and not the pages that sequence fills later (their KV attends to old-weight KV)."""
    bm = BlockManager(32, PS)
    bm.record_events()
    prompt = list(range(9))
    run_prefill(bm, seq_of(prompt, "done"))
    bm.free(bm._holders[next(iter(bm._holders))])
    running = seq_of(prompt + [50, 51, 52, 53], "running")
    assert len(run_prefill(bm, running)) == 2
    bm.take_events()
    bm.forget_prefixes()
    [removed] = bm.take_events()
    assert sorted(removed.block_hashes) == sorted(external(h) for h in running.page_hashes[:3])
    assert bm.num_cached_pages == 0 and not bm._page_of
    bm.grow(running, running.num_tokens + 3)
    for token in (60, 61, 62):
        running.append_token(token)
    running.num_computed_tokens = running.num_tokens
    bm.register(running)
    assert not bm._page_of and bm.take_events() == []
    assert run_prefill(bm, seq_of(prompt, "after")) == []  # computed afresh, with the new weights
    bm.free(running)
    bm.check_invariants()


def test_cache_salt_keeps_prefix_pages_private_to_its_tenant():
    bm = BlockManager(32, PS)
    prompt = list(range(13))  # three full pages

    def salted(rid, salt):
        return Sequence(rid, prompt, SamplingParams(cache_salt=salt))

    assert run_prefill(bm, salted("a1", "tenant-a")) == []
    assert len(run_prefill(bm, salted("a2", "tenant-a"))) == 3  # the same tenant hits its own pages
    assert run_prefill(bm, salted("b1", "tenant-b")) == []  # another salt: no hit, no timing difference
    assert run_prefill(bm, seq_of(prompt, "unsalted")) == []  # nor for requests without a salt
    assert len(run_prefill(bm, salted("b2", "tenant-b"))) == 3
    assert len(run_prefill(bm, seq_of(prompt, "unsalted2"))) == 3


# ---- pages behind the attention window ------------------------------------------------------------------
def test_pages_behind_the_window_are_released_as_the_sequence_runs():
    bm = BlockManager(16, PS, enable_prefix_caching=False, attention_window=6)
    a = seq_of(range(3, 13), "a")  # 10 tokens: pages 0..2
    run_prefill(bm, a)
    # The next query is at position 10 and sees keys 5..10: page 0 (0..3) is behind, page 1 (4..7) is not.
    assert bm.release_behind(a) == 1
    assert a.page_table[0] == RELEASED and bm.pages_held(a) == 2 and bm.num_free_pages == 14
    assert bm.release_behind(a) == 0  # idempotent
    for _ in range(6):  # decode six tokens: the query moves to 16 and sees 11..16, so page 1 goes too
        a.append_token(5)
        bm.grow(a, a.num_tokens)
        a.num_computed_tokens = a.num_tokens
        bm.release_behind(a)
        bm.check_invariants()
    assert a.page_table[:2] == [RELEASED, RELEASED] and RELEASED not in a.page_table[2:]
    assert bm.pages_held(a) == 2
    table = BlockManager.readable_table(a.page_table)
    assert RELEASED not in table and table[:2] == [a.page_table[2]] * 2  # the kernels get a page id it holds
    bm.free(a)
    bm.check_invariants()
    assert bm.num_free_pages == 16 and bm.pool.num_free == 16


def test_released_pages_stay_cached_and_a_sibling_never_shares_a_released_entry():
    bm = BlockManager(16, PS, attention_window=3)
    a = seq_of(list(range(3, 15)), "a")  # 12 tokens, three full pages, registered
    run_prefill(bm, a)
    assert bm.release_behind(a) == 2  # query at 12 sees 10..12: pages 0 and 1 are behind
    assert bm.num_cached_pages == 3 and bm.refcount(a.page_table[2]) == 1
    b = seq_of(list(range(3, 15)) + [9], "b")  # the same prefix: released pages are still cache hits
    prefix = bm.match_prefix(b)
    assert len(prefix) == 3 and bm.refcount(prefix[0]) == 0
    sibling = seq_of(list(range(3, 15)) + [1], "a")
    sibling.status = SequenceStatus.WAITING
    a.status = SequenceStatus.RUNNING
    bm.enable_prefix_caching = False  # sharing with the running leader only: its released pages are gone
    assert bm.match_prefix(sibling, share_with=a) == []
    bm.free(a)
    bm.check_invariants()


def test_no_window_releases_nothing():
    bm = BlockManager(16, PS)
    a = seq_of(range(3, 40), "a")
    run_prefill(bm, a)
    assert bm.release_behind(a) == 0 and RELEASED not in a.page_table
    with pytest.raises(ValueError, match="attention_window=0"):
        BlockManager(16, PS, attention_window=0)
