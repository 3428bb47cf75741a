"""Staging of new K/V rows so that every TPU DMA into a page is tile-aligned.

Mosaic only DMAs a slice of a tiled HBM array along its tiled (second-minor) dimension if the slice respects
the tiling. For the page pools that dimension is ``page_size``; measured with the Mosaic compiler (jax 0.10.2,
libtpu compile-only, v4/v5e/v5p/v6e), 32-bit pools accept any row offset, but 16-bit pools pack two rows per
word and accept ``s`` rows at offset ``o`` only if ``o % min(s, 8) == 0`` (s a power of two or a multiple of
8). A decode row (one row, any offset) can therefore not be copied on its own into a bf16 page.

So the wrapper stages, with plain XLA gathers, what the kernel copies:

* each page run (``layout.page_runs``) is widened to ``[a0, a1)``, whole packed words (pairs of rows for bf16);
  the widening rows are the page's current contents, gathered from the pool, so writing them is a no-op;
* runs of 8 or more rows are placed in the staging array at a row congruent to ``a0`` modulo 8, so source
  and destination offsets have the same alignment and a run of a full page moves as one DMA; shorter runs
  are packed densely (any word-aligned offset is legal for copies of 2 or 4 rows). Long runs are allocated
  from the end of the array and short ones from the start, which keeps the static size at 3 * T rows.

32-bit pools need no widening and no alignment, and the staging array is simply the new rows, head-major.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_cache_update.layout import page_runs
from pallas_kernels.metadata import AttentionMetadata

ROW_TILE = 8  # rows of a Mosaic HBM tile along the page_size dimension


def rows_per_word(dtype) -> int:
    itemsize = jnp.dtype(dtype).itemsize
    if itemsize not in (2, 4):
        raise NotImplementedError(f"TPU KV write supports 16- and 32-bit pools, not {jnp.dtype(dtype)}")
    return 4 // itemsize


def staged_runs(
    k_pages: jax.Array,  # [KVH, num_pages, page_size, D]
    v_pages: jax.Array,  # [KVH, num_pages, page_size, D]
    new_k: jax.Array,  # [T, KVH, D]
    new_v: jax.Array,  # [T, KVH, D]
    md: AttentionMetadata,
) -> tuple[tuple[jax.Array, ...], jax.Array, jax.Array]:
    """The copies the TPU write kernel makes, and the staged rows they copy from.

    Returns:
      ((src_row, page, slot, size) each i32[T]: copy staged rows ``src_row : src_row + size`` into ``page`` at
      ``slot``; unused runs have size 0), staged_k [KVH, R, D], staged_v [KVH, R, D].
    """
    num_tokens = new_k.shape[0]
    page_size = k_pages.shape[2]
    word = rows_per_word(k_pages.dtype)
    row, page, offset, length = page_runs(md, num_tokens, page_size)
    new_k = new_k.astype(k_pages.dtype)
    new_v = new_v.astype(v_pages.dtype)
    if word == 1:
        return (row, page, offset, length), new_k.swapaxes(0, 1), new_v.swapaxes(0, 1)

    live = length > 0
    a0 = offset - offset % word
    size = jnp.where(live, -(-(offset + length) // word) * word - a0, 0)
    long = live & (length >= ROW_TILE)
    # Short runs: packed from row 0. Long runs: whole 8-row blocks from the end, entered at a0 % 8.
    short_size = jnp.where(long, 0, size)
    short_end = jnp.cumsum(short_size)
    blocks = jnp.where(long, -(-(a0 % ROW_TILE + size) // ROW_TILE), 0)
    blocks_end = jnp.cumsum(blocks)
    # Every run uses at most 3x its rows (a short run widens by <= 2 rows, a long one by < 16), so 3T fits both.
    total_blocks = -(-3 * num_tokens // ROW_TILE)
    first_block = total_blocks - blocks_end
    src_row = jnp.where(long, first_block * ROW_TILE + a0 % ROW_TILE, short_end - short_size)

    # For every staged row: its run, then the slot it stands for.
    r_rows = total_blocks * ROW_TILE
    j = jnp.arange(r_rows, dtype=jnp.int32)
    in_short = j < short_end[-1]
    run_short = jnp.searchsorted(short_end, j, side="right")
    run_long = jnp.searchsorted(blocks_end, total_blocks - j // ROW_TILE, side="left")
    run = jnp.clip(jnp.where(in_short, run_short, run_long), 0, num_tokens - 1).astype(jnp.int32)
    slot = a0[run] + j - src_row[run]
    used = (slot >= a0[run]) & (slot < a0[run] + size[run]) & (in_short | (run_long < num_tokens))
    is_new = used & (slot >= offset[run]) & (slot < offset[run] + length[run])
    token = jnp.clip(row[run] + slot - offset[run], 0, num_tokens - 1)
    cache_slot = jnp.clip(slot, 0, page_size - 1)

    def stage(pages, new):
        fresh = new[token].swapaxes(0, 1)  # [KVH, R, D]
        current = pages[:, page[run], cache_slot]  # the widening rows keep the page's contents
        return jnp.where(is_new[None, :, None], fresh, jnp.where(used[None, :, None], current, 0))

    return (src_row.astype(jnp.int32), page, a0.astype(jnp.int32), size.astype(jnp.int32)), \
        stage(k_pages, new_k), stage(v_pages, new_v)
