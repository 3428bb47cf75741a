"""Where each new token's K/V goes: per-token page slots and, for DMA engines, runs of slots within one page."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.metadata import AttentionMetadata, token_layout


def token_slots(
    md: AttentionMetadata,
    num_tokens: int,
    page_size: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(page i32[T], offset i32[T], valid bool[T]) of each query row's K/V slot; padding rows are not valid."""
    seq_ids, positions, valid = token_layout(md, num_tokens)
    pages_per_seq = md.page_indices.shape[1]
    page_slot = jnp.clip(positions // page_size, 0, pages_per_seq - 1)
    page = jnp.where(valid, md.page_indices[seq_ids, page_slot], 0)
    return page, jnp.where(valid, positions % page_size, 0), valid


def page_runs(
    md: AttentionMetadata,
    num_tokens: int,
    page_size: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Maximal runs of consecutive rows that land in consecutive slots of one page.

    A run starts at a sequence's first row and wherever a row lands at offset 0 of a page; a prefill chunk
    of n rows becomes about n / page_size runs, a decode row one run.

    Returns:
      (row, page, offset, length), each i32[T]: run r copies rows ``row[r] : row[r] + length[r]`` into
      ``page[r]`` at ``offset[r]``; runs past the last one have length 0.
    """
    page, offset, valid = token_slots(md, num_tokens, page_size)
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_ids, _, _ = token_layout(md, num_tokens)
    is_start = valid & ((offset == 0) | (rows == md.cu_q_lens[seq_ids]))
    total = md.cu_q_lens[md.num_seqs[0]]
    starts = jnp.nonzero(is_start, size=num_tokens, fill_value=total)[0].astype(jnp.int32)
    ends = jnp.concatenate([starts[1:], total[None]])
    first = jnp.minimum(starts, num_tokens - 1)
    return starts, page[first], offset[first], (ends - starts).astype(jnp.int32)


def check_write_shapes(k_pages, v_pages, new_k, new_v) -> None:
    """Trace-time checks of the KV-write operands; raises ValueError."""
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages/v_pages must match, got {k_pages.shape} {k_pages.dtype} and "
                         f"{v_pages.shape} {v_pages.dtype}")
    want = (new_k.shape[0], k_pages.shape[0], k_pages.shape[3])
    if new_k.shape != want or new_v.shape != want:
        raise ValueError(f"new_k/new_v must be [T, num_kv_heads, head_dim] = {want}, got {new_k.shape}, "
                         f"{new_v.shape}")
