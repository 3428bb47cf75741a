"""Write a step's new K/V rows into their pages on TPU: HBM-to-HBM DMAs of aligned page runs.

Kept separate from the attention kernel (see ``ragged_paged_attention.tpu`` for why). The pages are aliased
input-to-output, so only the written slots change; donate them under jit for an in-place update.

The wrapper groups the batch into page runs (consecutive rows of one sequence that land in one page) and
stages their rows so that every copy is tile-aligned (``staging.staged_runs``: 16-bit pools are written in
whole packed words, the neighbouring row of a half-written word being copied back unchanged). A run is then
copied in power-of-two chunks, largest first, each as large as the alignment of its source and destination
allows: one DMA for a full page, one for a decode row, about ``log2(page_size)`` for a partial page. A DMA
moves the run's rows for all KV heads at once. Chunk sizes are static (one semaphore per size), so the kernel
issues every copy of its runs, then waits for them all in the same order.

Grid ``(cdiv(T, runs_per_block),)``, "parallel": runs write disjoint page slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kv_cache_update.layout import check_write_shapes
from pallas_kernels.kv_cache_update.staging import ROW_TILE, rows_per_word, staged_runs
from pallas_kernels.metadata import AttentionMetadata


def _chunk_sizes(page_size: int, word: int, staged_rows: int) -> list[int]:
    """Power-of-two copy sizes from one packed word up to a page, none longer than the staging array: a run
    never holds more rows than were staged, and a copy longer than its source cannot even be traced."""
    sizes, size = [], word
    while size <= min(page_size, staged_rows):
        sizes.append(size)
        size *= 2
    return sizes


def _kernel(
    src_row_ref,  # SMEM i32[T]
    page_ref,  # SMEM i32[T]
    slot_ref,  # SMEM i32[T]
    size_ref,  # SMEM i32[T]
    staged_k_hbm,  # HBM [KVH, R, D]
    staged_v_hbm,  # HBM [KVH, R, D]
    k_in_hbm,  # HBM [KVH, num_pages, page_size, D], aliased to k_out_hbm
    v_in_hbm,  # HBM [KVH, num_pages, page_size, D], aliased to v_out_hbm
    k_out_hbm,  # HBM [KVH, num_pages, page_size, D]
    v_out_hbm,  # HBM [KVH, num_pages, page_size, D]
    sems,  # DMA semaphores, one per chunk size
    *,
    runs_per_block: int,
    chunk_sizes: tuple[int, ...],
    aligned: bool,
):
    del k_in_hbm, v_in_hbm  # same buffers as the outputs
    num_runs = size_ref.shape[0]
    # Read outside the loops: the plain interpreter substitutes program_id only at the kernel's top level.
    first_run = pl.program_id(0) * runs_per_block

    def fits(offset, size):
        """Whether a copy of `size` rows may start at row `offset` (see staging.py for the rule)."""
        return (offset & (min(size, ROW_TILE) - 1)) == 0 if aligned else True

    def for_each_copy(action):
        def one_run(i, carry):
            r = jnp.minimum(first_run + i, num_runs - 1)
            src, page, slot = src_row_ref[r], page_ref[r], slot_ref[r]
            # The last block may extend past T; its extra iterations copy nothing.
            size = jnp.where(first_run + i < num_runs, size_ref[r], 0)

            def one_chunk(done):
                left = size - done
                chunk = jnp.int32(0)
                for c in reversed(chunk_sizes):
                    ok = (c <= left) & fits(src + done, c) & fits(slot + done, c)
                    chunk = jnp.where((chunk == 0) & ok, c, chunk)
                for n, c in enumerate(chunk_sizes):
                    @pl.when(chunk == c)
                    def _():
                        align = min(c, ROW_TILE) if aligned else 1
                        at_src = pl.multiple_of(src + done, align)
                        at_slot = pl.multiple_of(slot + done, align)
                        src_at = (slice(None), pl.ds(at_src, c))
                        dst_at = (slice(None), page, pl.ds(at_slot, c))
                        action(pltpu.make_async_copy(staged_k_hbm.at[src_at], k_out_hbm.at[dst_at], sems.at[n]))
                        action(pltpu.make_async_copy(staged_v_hbm.at[src_at], v_out_hbm.at[dst_at], sems.at[n]))

                return done + chunk

            lax.while_loop(lambda done: done < size, one_chunk, jnp.int32(0))
            return carry

        lax.fori_loop(0, runs_per_block, one_run, 0)

    for_each_copy(lambda c: c.start())
    for_each_copy(lambda c: c.wait())


@functools.partial(jax.jit, static_argnames=("runs_per_block", "interpret"))
def _write_kv_tpu(k_pages, v_pages, new_k, new_v, md: AttentionMetadata, *, runs_per_block, interpret):
    num_tokens = new_k.shape[0]
    page_size = k_pages.shape[2]
    word = rows_per_word(k_pages.dtype)
    runs, staged_k, staged_v = staged_runs(k_pages, v_pages, new_k, new_v, md)
    chunk_sizes = tuple(_chunk_sizes(page_size, word, staged_k.shape[1]))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_kernel, runs_per_block=runs_per_block, chunk_sizes=chunk_sizes, aligned=word > 1),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(-(-num_tokens // runs_per_block),),
            in_specs=[any_spec] * 4,
            out_specs=[any_spec] * 2,
            scratch_shapes=[pltpu.SemaphoreType.DMA((len(chunk_sizes),))],
        ),
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype)] * 2,
        # Flattened inputs: 4 scalar-prefetch arrays, the staged K/V, then the pages.
        input_output_aliases={6: 0, 7: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="write_kv_tpu",
    )(*runs, staged_k, staged_v, k_pages, v_pages)


def write_kv_tpu(
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    new_k: jax.Array,  # [T, num_kv_heads, head_dim]
    new_v: jax.Array,  # [T, num_kv_heads, head_dim]
    md: AttentionMetadata,
    *,
    runs_per_block: int = 64,
    interpret: bool | pltpu.InterpretParams = False,
) -> tuple[jax.Array, jax.Array]:
    """``reference.write_kv`` as a Pallas Mosaic TPU kernel.

    Args:
      k_pages, v_pages: one layer's page pool; donate them in the caller's jit for an in-place update.
      new_k, new_v: this step's K/V per query row; padding rows are not written.
      md: the ragged-batch metadata (``pallas_kernels.metadata``).
      runs_per_block: page runs issued per grid step.
      interpret: True or ``pltpu.InterpretParams`` to run on CPU.

    Returns:
      The updated (k_pages, v_pages).
    """
    check_write_shapes(k_pages, v_pages, new_k, new_v)
    return _write_kv_tpu(k_pages, v_pages, new_k, new_v, md, runs_per_block=runs_per_block, interpret=interpret)

