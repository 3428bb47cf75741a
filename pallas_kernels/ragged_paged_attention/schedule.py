"""Work lists that map kernel program instances onto a ragged batch, built with a few vectorised jnp ops.

Both kernels need to know, per program, which sequence(s) it serves. Computing that once per call in the
wrapper (O(num_slots + num_blocks) integer work, fused by XLA) keeps the kernels free of searches and lets a
program skip zero-length sequences without a scan. Every array here has a static size derived from the
padded shapes, so one jitted step serves any mix of lengths. They take the batch's ``AttentionMetadata`` and
read only its ``cu_q_lens`` and ``num_seqs``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.metadata import AttentionMetadata


def _live_query_ranges(md: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
    """(start i32[S], end i32[S]) query rows per slot; padding slots get an empty range at cu_q_lens[num_seqs]."""
    cu_q_lens, num_seqs = md.cu_q_lens, md.num_seqs
    num_slots = cu_q_lens.shape[0] - 1
    n = num_seqs[0]
    live = jnp.arange(num_slots, dtype=jnp.int32) < n
    end_of_live = cu_q_lens[n]
    start = jnp.where(live, cu_q_lens[:-1], end_of_live)
    end = jnp.where(live, cu_q_lens[1:], end_of_live)
    return start, jnp.maximum(end, start)


def q_block_work(
    md: AttentionMetadata,
    num_tokens: int,
    block_q: int,
) -> tuple[jax.Array, jax.Array]:
    """For fixed query blocks of ``block_q`` rows: the sequences with rows in each block (TPU kernel).

    Returns:
      (block_start i32[nb + 1], work_seq i32[nb + S]): block b serves sequences
      ``work_seq[block_start[b] : block_start[b + 1]]``, in row order, each with at least one row in the block.
    """
    num_slots = md.cu_q_lens.shape[0] - 1
    num_blocks = -(-num_tokens // block_q)
    start, end = _live_query_ranges(md)
    nonempty = end > start
    first = start // block_q
    count = jnp.where(nonempty, (end - 1) // block_q - first + 1, 0)
    cum = jnp.cumsum(count)
    # Consecutive sequences share at most their boundary block, so the pairs number at most nb + S - 1.
    max_work = num_blocks + num_slots
    k = jnp.arange(max_work, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cum, k, side="right"), num_slots - 1).astype(jnp.int32)
    block = first[seq] + k - (cum[seq] - count[seq])
    block = jnp.where(k < cum[-1], block, num_blocks)
    block_start = jnp.searchsorted(block, jnp.arange(num_blocks + 1), side="left").astype(jnp.int32)
    return block_start, seq


def q_tiles(
    md: AttentionMetadata,
    num_tokens: int,
    block_q: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Tiles of at most ``block_q`` rows that never straddle a sequence (GPU kernel).

    The padding rows ``cu_q_lens[num_seqs] .. num_tokens`` form extra tiles owned by no sequence, so that every
    output row is written by exactly one program (GPU outputs start uninitialised).

    Returns:
      (tile_seq, tile_row, tile_len), each i32[max_tiles]: the owning slot (-1 for padding), first row and row
      count; unused tiles have length 0.
    """
    cu_q_lens, num_seqs = md.cu_q_lens, md.num_seqs
    num_slots = cu_q_lens.shape[0] - 1
    start, end = _live_query_ranges(md)
    end_of_live = cu_q_lens[num_seqs[0]]
    seg_start = jnp.concatenate([start, end_of_live[None]])
    seg_end = jnp.concatenate([end, jnp.full((1,), num_tokens, jnp.int32)])
    count = -(-(seg_end - seg_start) // block_q)
    cum = jnp.cumsum(count)
    max_tiles = max(1, min(num_tokens, num_tokens // block_q + num_slots + 1))
    k = jnp.arange(max_tiles, dtype=jnp.int32)
    seg = jnp.minimum(jnp.searchsorted(cum, k, side="right"), num_slots).astype(jnp.int32)
    row = seg_start[seg] + (k - (cum[seg] - count[seg])) * block_q
    length = jnp.where(k < cum[-1], jnp.clip(seg_end[seg] - row, 0, block_q), 0)
    tile_seq = jnp.where(seg < jnp.minimum(num_seqs[0], num_slots), seg, -1)
    return tile_seq, row.astype(jnp.int32), length.astype(jnp.int32)
