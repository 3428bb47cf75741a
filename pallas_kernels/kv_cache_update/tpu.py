"""Write a step's new K/V rows into their pages on TPU: HBM-to-HBM DMAs, one per page run.

Kept separate from the attention kernel (see ``ragged_paged_attention.tpu`` for why). The pages are aliased
input-to-output, so only the written slots change; donate them under jit for an in-place update.

The wrapper turns the batch into page runs (``layout.page_runs``): consecutive rows of one sequence that land
in one page. A DMA's shape is static, so a run of n rows is copied as one DMA per set bit of n (at most
``page_size.bit_length()`` DMAs, one when the run fills a page); a decode row is one DMA per K/V. Each size
class has its own semaphore so every wait matches the size of the copies it counts. Rows are read from a
``[KVH, T, D]`` transpose of the new K/V so a run is one strided copy across all KV heads.

Grid ``(cdiv(T, runs_per_block),)``, "parallel": runs write disjoint slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kv_cache_update.layout import check_write_shapes, page_runs
from pallas_kernels.ragged_paged_attention.validation import maybe_check_batch


def _kernel(
    run_row_ref,  # SMEM i32[T]
    run_page_ref,  # SMEM i32[T]
    run_offset_ref,  # SMEM i32[T]
    run_len_ref,  # SMEM i32[T]
    new_k_hbm,  # HBM [KVH, T, D]
    new_v_hbm,  # HBM [KVH, T, D]
    k_in_hbm,  # HBM [KVH, num_pages, page_size, D], aliased to k_out_hbm
    v_in_hbm,  # HBM [KVH, num_pages, page_size, D], aliased to v_out_hbm
    k_out_hbm,  # HBM [KVH, num_pages, page_size, D]
    v_out_hbm,  # HBM [KVH, num_pages, page_size, D]
    sems,  # DMA semaphores [page_size.bit_length()], one per copy size
    *,
    runs_per_block: int,
):
    del k_in_hbm, v_in_hbm  # same buffers as the outputs
    num_runs = run_len_ref.shape[0]
    size_classes = sems.shape[0]
    # Read outside the loop: the plain interpreter substitutes program_id only at the kernel's top level.
    first_run = pl.program_id(0) * runs_per_block

    def for_each_copy(action):
        def one_run(i, carry):
            r = first_run + i
            # The last block may extend past T; its extra iterations do nothing.
            r_safe = jnp.minimum(r, num_runs - 1)
            row, page = run_row_ref[r_safe], run_page_ref[r_safe]
            offset, length = run_offset_ref[r_safe], jnp.where(r < num_runs, run_len_ref[r_safe], 0)
            done = jnp.int32(0)
            for bit in reversed(range(size_classes)):
                size = 1 << bit
                src_at, dst_at = (slice(None), pl.ds(row + done, size)), (slice(None), page, pl.ds(offset + done, size))
                copies = (pltpu.make_async_copy(new_k_hbm.at[src_at], k_out_hbm.at[dst_at], sems.at[bit]),
                          pltpu.make_async_copy(new_v_hbm.at[src_at], v_out_hbm.at[dst_at], sems.at[bit]))

                @pl.when((length & size) != 0)
                def _():
                    for copy in copies:
                        action(copy)

                done = done + (length & size)
            return carry

        lax.fori_loop(0, runs_per_block, one_run, 0)

    for_each_copy(lambda c: c.start())
    for_each_copy(lambda c: c.wait())


@functools.partial(jax.jit, static_argnames=("runs_per_block", "interpret"))
def _write_kv_tpu(k_pages, v_pages, new_k, new_v, kv_lens, page_indices, cu_q_lens, num_seqs, *, runs_per_block,
                  interpret):
    num_tokens = new_k.shape[0]
    page_size = k_pages.shape[2]
    runs = page_runs(kv_lens, page_indices, cu_q_lens, num_seqs, num_tokens, page_size)
    new_k_t = new_k.astype(k_pages.dtype).swapaxes(0, 1)
    new_v_t = new_v.astype(v_pages.dtype).swapaxes(0, 1)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_kernel, runs_per_block=runs_per_block),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(-(-num_tokens // runs_per_block),),
            in_specs=[any_spec] * 4,
            out_specs=[any_spec] * 2,
            scratch_shapes=[pltpu.SemaphoreType.DMA((page_size.bit_length(),))],
        ),
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype)] * 2,
        # Flattened inputs: 4 scalar-prefetch arrays, new_k_t, new_v_t, then the pages.
        input_output_aliases={6: 0, 7: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="write_kv_tpu",
    )(*runs, new_k_t, new_v_t, k_pages, v_pages)


def write_kv_tpu(
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    new_k: jax.Array,  # [T, num_kv_heads, head_dim]
    new_v: jax.Array,  # [T, num_kv_heads, head_dim]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, P]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    runs_per_block: int = 64,
    interpret: bool | pltpu.InterpretParams = False,
    debug_checks: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``reference.write_kv`` as a Pallas Mosaic TPU kernel.

    Args:
      k_pages, v_pages: one layer's page pool; donate them in the caller's jit for an in-place update.
      new_k, new_v: this step's K/V per query row; padding rows are not written.
      kv_lens, page_indices, cu_q_lens, num_seqs: the ragged-batch metadata.
      runs_per_block: page runs issued per grid step.
      interpret: True or ``pltpu.InterpretParams`` to run on CPU.
      debug_checks: validate the metadata values first (``validation.check_batch``).

    Returns:
      The updated (k_pages, v_pages).
    """
    check_write_shapes(k_pages, v_pages, new_k, new_v)
    maybe_check_batch(debug_checks, new_k.shape[0], k_pages.shape, kv_lens, page_indices, cu_q_lens, num_seqs)
    return _write_kv_tpu(k_pages, v_pages, new_k, new_v, kv_lens, page_indices, cu_q_lens, num_seqs,
                         runs_per_block=runs_per_block, interpret=interpret)

