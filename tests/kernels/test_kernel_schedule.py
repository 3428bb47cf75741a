"""The kernels' work lists, page runs and block-size table against brute-force NumPy versions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import build_batch, device_args, metadata, random_batch, random_lengths
from pallas_kernels.kv_cache_update import layout
from pallas_kernels.ragged_paged_attention import AttentionMetadata, BlockSizes, check_values, get_block_sizes
from pallas_kernels.ragged_paged_attention.block_sizes import candidates
from pallas_kernels.ragged_paged_attention import schedule

pytestmark = pytest.mark.quick

# Jitted once per static configuration: eager dispatch of these small graphs is what would be slow.
q_block_work = jax.jit(schedule.q_block_work, static_argnums=(1, 2))
q_tiles = jax.jit(schedule.q_tiles, static_argnums=(1, 2))
page_runs = jax.jit(layout.page_runs, static_argnums=(1, 2))


def random_metadata(rng, slots=9, tokens=48):
    live = int(rng.integers(0, slots + 1))
    q_lens, _ = random_lengths(rng, live, page_size=4)
    while sum(q_lens) > tokens:
        q_lens[int(np.argmax(q_lens))] -= 1
    cu = np.zeros(slots + 1, np.int32)
    cu[1 : live + 1] = np.cumsum(q_lens)
    cu[live + 1 :] = cu[live]
    return cu, np.array([live], np.int32), tokens


def query_metadata(cu, num_seqs):
    """Metadata with the given query layout (all the work lists read); kv_lens and page tables are zeros."""
    slots = cu.shape[0] - 1
    return AttentionMetadata(jnp.asarray(cu), jnp.zeros(slots, jnp.int32), jnp.zeros((slots, 1), jnp.int32),
                             jnp.asarray(num_seqs))


@pytest.mark.parametrize("block_q", [1, 3, 8])
def test_q_block_work_lists_each_sequence_in_each_block_it_touches(block_q):
    rng = np.random.default_rng(block_q)
    for _ in range(20):
        cu, num_seqs, tokens = random_metadata(rng)
        start, seqs = map(np.asarray, q_block_work(query_metadata(cu, num_seqs), tokens, block_q))
        for b in range(-(-tokens // block_q)):
            lo, hi = b * block_q, (b + 1) * block_q
            want = [s for s in range(num_seqs[0]) if cu[s] < hi and cu[s + 1] > lo and cu[s + 1] > cu[s]]
            assert seqs[start[b] : start[b + 1]].tolist() == want


@pytest.mark.parametrize("block_q", [1, 2, 5])
def test_q_tiles_cover_every_row_once_without_straddling(block_q):
    rng = np.random.default_rng(10 + block_q)
    for _ in range(20):
        cu, num_seqs, tokens = random_metadata(rng)
        seq, row, length = map(np.asarray, q_tiles(query_metadata(cu, num_seqs), tokens, block_q))
        owner = np.full(tokens, -2)
        for s, r, n in zip(seq, row, length):
            assert 0 <= n <= block_q
            assert np.all(owner[r : r + n] == -2), "row in two tiles"
            owner[r : r + n] = s
        n_live = num_seqs[0]
        want = np.full(tokens, -1)
        for s in range(n_live):
            want[cu[s] : cu[s + 1]] = s
        np.testing.assert_array_equal(owner, want)


def test_page_runs_rebuild_every_slot():
    rng = np.random.default_rng(3)
    page_size = 4
    for _ in range(10):
        batch = random_batch(rng, page_size=page_size)
        live, kv_lens = int(batch["num_seqs"][0]), batch["kv_lens"]
        q_lens = np.diff(batch["cu_q_lens"])
        runs = [np.asarray(a) for a in page_runs(metadata(batch), batch["q"].shape[0], page_size)]
        got = {}
        for row, page, offset, n in zip(*runs):
            assert 0 <= n and offset + n <= page_size
            for i in range(n):
                got[int(row + i)] = (int(page), int(offset + i))
        cu = batch["cu_q_lens"]
        want = {}
        for s in range(live):
            for i in range(cu[s + 1] - cu[s]):
                pos = kv_lens[s] - q_lens[s] + i
                want[int(cu[s] + i)] = (int(batch["page_indices"][s, pos // page_size]), pos % page_size)
        assert got == want


def test_block_size_table_default_and_override():
    hit = get_block_sizes("tpu", 128, 16, jnp.bfloat16, "decode")
    assert hit == BlockSizes(block_q=1, block_kv=256, kv_heads_per_block=8)
    miss = get_block_sizes("tpu", 96, 48, jnp.float32, "prefill")
    assert miss.block_kv % 48 == 0
    assert get_block_sizes("gpu", 128, 16, jnp.bfloat16, "decode", {"num_splits": 8}).num_splits == 8
    assert get_block_sizes("gpu", 64, 16, "float32", "prefill", BlockSizes(4, 32)) == BlockSizes(4, 32)
    with pytest.raises(ValueError, match="unknown block-size fields"):
        get_block_sizes("gpu", 64, 16, "float32", "prefill", {"block_k": 4})
    for backend in ("tpu", "gpu"):
        sweep = candidates(backend, 128, 16, jnp.bfloat16, "decode")
        assert sweep[0] == get_block_sizes(backend, 128, 16, jnp.bfloat16, "decode") and len(set(sweep)) == len(sweep)


def test_check_values_accepts_a_valid_batch():
    rng = np.random.default_rng(4)
    batch, _, _ = build_batch(rng, [3, 0, 1], [7, 2, 9])
    _, num_pages, page_size, _ = batch["k_pages"].shape
    check_values(metadata(batch, np.asarray), num_tokens=batch["q"].shape[0], num_pages=num_pages,
                 page_size=page_size)


def test_kernels_adapt_table_entries_to_the_call():
    from pallas_kernels.ragged_paged_attention import gpu, tpu

    pages = (8, 1024, 16, 128)
    # TPU decode: the fewest rows that fill whole bf16 sublane tiles, all 8 KV heads per DMA.
    for group, block_q in ((1, 16), (2, 8), (4, 4), (8, 2)):
        sizes = tpu.resolve_block_sizes((64, 8 * group, 128), pages, jnp.bfloat16, num_slots=64)
        assert (sizes.block_q, sizes.kv_heads_per_block) == (block_q, 8)
    # A head block that does not divide num_kv_heads falls back to a divisor.
    sizes = tpu.resolve_block_sizes((64, 12, 128), (6, 1024, 16, 128), jnp.bfloat16, num_slots=64)
    assert sizes.kv_heads_per_block == 6
    # Prefill rows are capped unless block_q is given explicitly.
    assert tpu.resolve_block_sizes((4096, 64, 128), pages, jnp.bfloat16, num_slots=8).block_q * 8 <= 512
    assert tpu.resolve_block_sizes((4096, 64, 128), pages, jnp.bfloat16, num_slots=8, override={"block_q": 256}
                                   ).block_q == 256
    assert gpu.resolve_block_sizes((4096, 64, 128), pages, jnp.bfloat16, 8, 64).block_q * 8 <= 128


def plan_chunks(src, slot, size, page_size, word):
    """The TPU write kernel's chunking, in Python: largest power of two whose start is aligned on both sides."""
    from pallas_kernels.kv_cache_update.staging import ROW_TILE

    chunks, done = [], 0
    sizes = [word * 2**k for k in range(8) if word * 2**k <= page_size]
    while done < size:
        fits = lambda o, c: word == 1 or o % min(c, ROW_TILE) == 0
        c = max(c for c in sizes if c <= size - done and fits(src + done, c) and fits(slot + done, c))
        chunks.append(c)
        done += c
    return chunks


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_staged_runs_copy_pages_in_few_aligned_chunks(dtype):
    """Staging keeps a long run's source congruent to its slot, so a full bf16 page is one DMA, not 8 pairs."""
    from pallas_kernels.kv_cache_update.staging import rows_per_word, staged_runs

    rng = np.random.default_rng(6)
    page_size = 16
    batch, _, _ = build_batch(rng, [1, 32, 13, 1, 20], [9, 32, 16, 30, 37], page_size=page_size, dtype=dtype)
    args = device_args(batch)
    new_k, new_v = args["q"][:, :2], args["q"][:, :2]  # [T, KVH=2, D]
    runs, staged_k, _ = jax.jit(staged_runs)(args["k_pages"], args["v_pages"], new_k, new_v, args["md"])
    src, _, slot, size = map(np.asarray, runs)
    word = rows_per_word(dtype)
    assert staged_k.shape[1] <= 3 * batch["q"].shape[0] + 8
    plans = [plan_chunks(s, o, n, page_size, word) for s, o, n in zip(src, slot, size) if n]
    assert len(plans) == 7  # decode rows 2, 32 rows on 2 pages, 13 on 1, 20 on 2
    assert plans.count([16]) >= 2  # the full pages (bf16 also widens slots 1..15 to a full page)
    assert all(len(p) <= 4 for p in plans)
    assert [word] in plans  # a decode row: one word
