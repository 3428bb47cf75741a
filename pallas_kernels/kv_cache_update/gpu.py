"""Write a step's new K/V rows into their pages on GPU (Pallas, Triton backend): a masked row scatter.

Grid ``(num_kv_heads, cdiv(T, block_tokens))``; a program loads ``block_tokens`` rows of one KV head and stores
each into its page slot (``layout.token_slots``), padding rows masked off. The page pools are aliased
input-to-output, so only the written slots change; donate them under jit for an in-place update. Kept apart
from the attention kernel for the same reason as on TPU: attention programs of one sequence run concurrently
and must all see the new rows, which a write inside one of them could not guarantee without a grid-wide sync.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # Deprecated from jax 0.11, to be removed later.
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - depends on the jax release
    plgpu = None

from pallas_kernels.gpu_addressing import check_elements
from pallas_kernels.kv_cache_update.layout import check_write_shapes, token_slots
from pallas_kernels.metadata import AttentionMetadata


def _kernel(
    slot_ref,  # i32[T] page * page_size + offset
    valid_ref,  # i32[T] 1 for real rows
    new_k_ref,  # [T * KVH, D]
    new_v_ref,  # [T * KVH, D]
    k_in_ref,  # [KVH * num_pages * page_size, D], aliased to k_out_ref
    v_in_ref,  # aliased to v_out_ref
    k_out_ref,  # [KVH * num_pages * page_size, D]
    v_out_ref,
    *,
    block_tokens: int,
    num_kv_heads: int,
    pool_rows_per_head: int,
):
    del k_in_ref, v_in_ref
    kv_head, block = pl.program_id(0), pl.program_id(1)
    num_tokens = slot_ref.shape[0]
    head_dim = new_k_ref.shape[1]
    token = block * block_tokens + lax.broadcasted_iota(jnp.int32, (block_tokens,), 0)
    in_range = token < num_tokens
    valid = plgpu.load(valid_ref.at[token], mask=in_range, other=0) != 0
    slot = plgpu.load(slot_ref.at[token], mask=in_range, other=0)
    # Lanes padded to a power of two (Triton's blocks); those past head_dim are masked off. Their column index
    # is out of range of the 2-D refs, so it never aliases an element of the next row.
    lanes = lax.broadcasted_iota(jnp.int32, (1, pl.next_power_of_2(head_dim)), 1)
    mask = valid[:, None] & (lanes < head_dim)
    src = ((token * num_kv_heads + kv_head)[:, None], lanes)
    # Masked-off rows point past the pool (distinct, never dereferenced on the GPU, dropped by the interpreter).
    dst_row = jnp.where(valid, kv_head * pool_rows_per_head + slot, k_out_ref.shape[0] + token)
    dst = (dst_row[:, None], lanes)
    for new_ref, out_ref in ((new_k_ref, k_out_ref), (new_v_ref, v_out_ref)):
        rows = plgpu.load(new_ref.at[src], mask=mask)  # no fill value: masked lanes are not stored either
        plgpu.store(out_ref.at[dst], rows.astype(out_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("block_tokens", "interpret"))
def _write_kv_gpu(k_pages, v_pages, new_k, new_v, md: AttentionMetadata, *, block_tokens, interpret):
    num_kv_heads, num_pages, page_size, head_dim = k_pages.shape
    num_tokens = new_k.shape[0]
    page, offset, valid = token_slots(md, num_tokens, page_size)
    pool_shape = jax.ShapeDtypeStruct((num_kv_heads * num_pages * page_size, head_dim), k_pages.dtype)
    k_out, v_out = pl.pallas_call(
        functools.partial(_kernel, block_tokens=block_tokens, num_kv_heads=num_kv_heads,
                          pool_rows_per_head=num_pages * page_size),
        grid=(num_kv_heads, -(-num_tokens // block_tokens)),
        out_shape=[pool_shape, pool_shape],
        input_output_aliases={4: 0, 5: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="write_kv_gpu",
    )(page * page_size + offset, valid.astype(jnp.int32), new_k.reshape(-1, head_dim), new_v.reshape(-1, head_dim),
      k_pages.reshape(-1, head_dim), v_pages.reshape(-1, head_dim))
    return k_out.reshape(k_pages.shape), v_out.reshape(v_pages.shape)


def write_kv_gpu(
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    new_k: jax.Array,  # [T, num_kv_heads, head_dim]
    new_v: jax.Array,  # [T, num_kv_heads, head_dim]
    md: AttentionMetadata,
    *,
    block_tokens: int = 32,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``reference.write_kv`` as a Pallas GPU (Triton) kernel.

    Args:
      k_pages, v_pages: one layer's page pool; donate them in the caller's jit for an in-place update.
      new_k, new_v: this step's K/V per query row; padding rows are not written.
      md: the ragged-batch metadata (``pallas_kernels.metadata``).
      block_tokens: rows per program (a power of two).
      interpret: run in the CPU interpreter.

    Returns:
      The updated (k_pages, v_pages).
    """
    if plgpu is None:  # pragma: no cover
        raise RuntimeError("this jax release has no Pallas Triton backend (jax.experimental.pallas.triton)")
    check_write_shapes(k_pages, v_pages, new_k, new_v)
    # 32-bit offsets (pallas_kernels.gpu_addressing): a clear error instead of writes to the wrong rows.
    check_elements("k_pages", k_pages.shape, jnp.dtype(k_pages.dtype).itemsize)
    check_elements("new_k", new_k.shape, jnp.dtype(new_k.dtype).itemsize)
    if block_tokens < 1 or block_tokens & (block_tokens - 1):
        raise ValueError(f"block_tokens must be a power of two, got {block_tokens}")
    return _write_kv_gpu(k_pages, v_pages, new_k, new_v, md, block_tokens=block_tokens, interpret=interpret)
