"""Ragged paged attention on GPU (Pallas, Triton backend).

Grid ``(num_kv_heads, num_tiles, num_splits)``. The wrapper cuts the batch into query tiles of at most
``block_q`` tokens that never straddle a sequence (``schedule.q_tiles``): a decode token is a tile of its own,
a prefill chunk is a loop of tiles. Program (h, t, s) serves tile t for KV head h, with the head's query
heads folded into the matmul rows (row r = token r // group, query head r % group; rows padded to a power of
two >= 16 for the MMA), over the s-th of ``num_splits`` equal parts of the tile's key range.

The key range of a tile is causal (up to its last token's position) and, with a sliding window, starts at the
first key inside its first token's window, so whole blocks outside the window are never loaded. Keys are
gathered block by block through the page table (``block_kv`` keys per step, independent of the page size);
loads are masked to the tile's key range, so page-table entries past the sequence's length are never
dereferenced and masked V rows read as 0 (no stray NaN).

Split-KV (flash-decoding): a decode batch has few tiles, so a long context is split across ``num_splits``
programs that each write an unnormalised partial (acc, running max m, running sum l); ``_merge_splits`` combines
them with the usual rescaling ``sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s``. With one split the kernel
normalises and writes the output directly. Padding rows form tiles of their own with an empty key range, so
every output row is written (GPU outputs start uninitialised) and comes out 0.

Backend: Triton, not Mosaic GPU, because a paged KV gather is a masked pointer gather in Triton (Mosaic GPU
would need a TMA copy per page with barriers and Hopper-only wgmma), it runs on Ampere/Ada/Hopper alike, and
it runs in the CPU interpreter that the tests use. jax 0.11 deprecates the Pallas Triton backend (a warning at
each lowering); the kernel passes ``plgpu.CompilerParams`` explicitly so the backend choice does not depend on
``jax_pallas_use_mosaic_gpu``, and reports clearly if a jax release no longer ships the module.
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
from pallas_kernels.metadata import AttentionMetadata, check_shapes
from pallas_kernels.quantized_pages import QuantizedPages
from pallas_kernels.ragged_paged_attention.block_sizes import (
    GPU_MAX_ROWS,
    GPU_SHARED_MEMORY_BYTES,
    BlockSizes,
    get_block_sizes,
    gpu_shared_memory_estimate,
    mode_for,
)
from pallas_kernels.ragged_paged_attention.kernel_ops import div_by, matmul, rem_by
from pallas_kernels.ragged_paged_attention.schedule import q_tiles

# Enough programs to fill an H100 (132 SMs) a few times over before a decode batch is split further.
_TARGET_PROGRAMS = 4 * 132
_MAX_SPLITS = 32


def _kernel(
    tile_seq_ref,  # i32[NT]
    tile_row_ref,  # i32[NT]
    tile_len_ref,  # i32[NT]
    cu_q_lens_ref,  # i32[S + 1]
    kv_lens_ref,  # i32[S]
    pages_ref,  # i32[S * P]
    q_ref,  # [T * Hq, D]
    k_ref,  # [KVH * num_pages * page_size, D]
    v_ref,  # [KVH * num_pages * page_size, D]
    *out_refs,  # split: o f32[splits, T*Hq, D], m f32[splits, T*Hq], l f32[splits, T*Hq]; else o [T*Hq, D]
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    group: int,
    num_q_heads: int,
    rows: int,
    lanes_padded: int,
    block_kv: int,
    page_size: int,
    num_pages: int,
    pages_per_seq: int,
    num_splits: int,
    quantized: bool = False,
    has_sinks: bool = False,
):
    if quantized:  # 8-bit pages: their f32 scales, one per key row (pallas_kernels.quantized_pages)
        ks_ref, vs_ref, *out_refs = out_refs  # f32[KVH * num_pages * page_size] each
    if has_sinks:  # attention sinks: one logit per query head
        sinks_ref, *out_refs = out_refs  # f32[Hq]
    kv_head, tile, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq, row0, n = tile_seq_ref[tile], tile_row_ref[tile], tile_len_ref[tile]
    live = (seq >= 0) & (n > 0)
    seq = jnp.maximum(seq, 0)

    r = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    token_in_tile = div_by(r, group)
    row_ok = token_in_tile < n
    # Masked rows keep their natural (distinct, possibly out-of-range) index: a masked access never happens on
    # the GPU, and in the interpreter a masked scatter writes back what it read, which is only harmless if no
    # two rows of one store share an index.
    flat_row = (row0 + token_in_tile) * num_q_heads + kv_head * group + rem_by(r, group)

    base = kv_lens_ref[seq] - cu_q_lens_ref[seq + 1]  # position of query row t is base + t
    pos = base + row0 + token_in_tile
    hi = base + row0 + n - 1
    lo = jnp.int32(0) if sliding_window is None else jnp.maximum(base + row0 - sliding_window + 1, 0)
    first_block = div_by(lo, block_kv)
    num_blocks = jnp.where(live, div_by(jnp.maximum(hi, 0), block_kv) - first_block + 1, 0)
    per_split = div_by(num_blocks + (num_splits - 1), num_splits)
    b_begin = first_block + split * per_split
    b_end = jnp.minimum(first_block + num_blocks, b_begin + per_split)

    head_dim = q_ref.shape[1]
    # Gathers index every dimension with an array (the interpreter does not mix arrays and slices). Triton wants
    # power-of-two blocks: the lane axis is padded to ``lanes_padded`` and the lanes past head_dim are masked
    # off (loaded as 0, never stored); their column index is out of range of the 2-D ref, so it never aliases
    # a valid element of the next row.
    lanes = lax.broadcasted_iota(jnp.int32, (1, lanes_padded), 1)
    lane_ok = lanes < head_dim
    rows_2d = (flat_row[:, None], lanes)
    row_mask = row_ok[:, None] & lane_ok
    q = plgpu.load(q_ref.at[rows_2d], mask=row_mask, other=0.0)
    kv_base = kv_head * num_pages

    def body(b, carry):
        acc, m, l = carry
        key = b * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
        key_ok = (key >= lo) & (key <= hi)
        page = plgpu.load(pages_ref.at[seq * pages_per_seq + div_by(key, page_size)], mask=key_ok, other=0)
        slot = (kv_base + page) * page_size + rem_by(key, page_size)
        key_mask = key_ok[:, None] & lane_ok
        k = plgpu.load(k_ref.at[slot[:, None], lanes], mask=key_mask, other=0.0)
        v = plgpu.load(v_ref.at[slot[:, None], lanes], mask=key_mask, other=0.0)
        if quantized:  # dequantized in registers, as loaded: the pool is read in 8 bits
            ks = plgpu.load(ks_ref.at[slot], mask=key_ok, other=0.0)
            vs = plgpu.load(vs_ref.at[slot], mask=key_ok, other=0.0)
            k = (k.astype(jnp.float32) * ks[:, None]).astype(q_ref.dtype)
            v = (v.astype(jnp.float32) * vs[:, None]).astype(q_ref.dtype)
        s = matmul(q.astype(k.dtype), k, transpose_b=True) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        visible = row_ok[:, None] & key_ok[None, :] & (key[None, :] <= pos[:, None])
        if sliding_window is not None:
            visible &= key[None, :] > pos[:, None] - sliding_window
        s = jnp.where(visible, s, -jnp.inf)
        m_next = jnp.maximum(m, jnp.max(s, axis=1))
        # Rows with nothing visible yet keep m = -inf; shift by 0 so exp gives 0 instead of NaN.
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        p = jnp.exp(s - m_safe[:, None])
        alpha = jnp.exp(m - m_safe)
        pv = matmul(p.astype(v.dtype), v)
        return alpha[:, None] * acc + pv, m_next, alpha * l + jnp.sum(p, axis=1)

    init = (jnp.zeros((rows, lanes_padded), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    if has_sinks:
        # The sink is one more key with a zero value: the online softmax starts from it (m = sink, l = 1). With
        # the keys split, only split 0 starts there, so the merge counts it once.
        sink = plgpu.load(sinks_ref.at[kv_head * group + rem_by(r, group)])
        first = split == 0
        init = (init[0], jnp.where(first, sink, init[1]), jnp.where(first, 1.0, init[2]))
    acc, m, l = lax.fori_loop(b_begin, b_end, body, init)

    if num_splits == 1:
        (o_ref,) = out_refs
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        plgpu.store(o_ref.at[rows_2d], out.astype(o_ref.dtype), mask=row_mask)
    else:
        o_ref, m_ref, l_ref = out_refs
        plgpu.store(o_ref.at[(split, *rows_2d)], acc, mask=row_mask)
        plgpu.store(m_ref.at[split, flat_row], m, mask=row_ok)
        plgpu.store(l_ref.at[split, flat_row], l, mask=row_ok)


def padded_lanes(head_dim: int) -> int:
    """The lane axis as the kernel tiles it: head_dim rounded up to a power of two, at least 16 (the smallest
    MMA reduction Triton accepts)."""
    return max(16, pl.next_power_of_2(head_dim))


def _merge_splits(
    acc: jax.Array,  # f32[splits, R, D]
    m: jax.Array,  # f32[splits, R]
    l: jax.Array,  # f32[splits, R]
) -> jax.Array:  # f32[R, D]
    peak = jnp.max(m, axis=0)
    weight = jnp.exp(m - jnp.where(peak == -jnp.inf, 0.0, peak)[None])
    total = jnp.sum(weight * l, axis=0)
    out = jnp.sum(weight[..., None] * acc, axis=0)
    return jnp.where(total[:, None] > 0, out / jnp.where(total > 0, total, 1.0)[:, None], 0.0)


def kernel_rows(block_q: int, group: int) -> int:
    """MMA rows of a tile: its tokens' query heads, padded to a power of two >= 16."""
    return max(16, pl.next_power_of_2(block_q * group))


def _fit_shared_memory(sizes: BlockSizes, explicit: set[str], group: int, head_dim: int, dtype, storage_dtype,
                       budget: int) -> BlockSizes:
    """Shrink the fields not given explicitly until ``gpu_shared_memory_estimate`` fits ``budget``: block_kv down
    to 32, then the pipeline to one stage, then block_kv down to 16, then the tile's tokens (block_q)."""
    lanes = padded_lanes(head_dim)

    def estimate(s: BlockSizes) -> int:
        return gpu_shared_memory_estimate(kernel_rows(s.block_q, group), s.block_kv, lanes, s.num_stages, dtype,
                                          storage_dtype)

    steps = [("block_kv", 32), ("num_stages", 1), ("block_kv", 16), ("block_q", 1)]
    for field, floor in steps:
        if field in explicit:
            continue
        while estimate(sizes) > budget and getattr(sizes, field) > floor:
            value = getattr(sizes, field)
            sizes = sizes.replace(**{field: max(floor, value - 1 if field == "num_stages" else value // 2)})
    return sizes


def resolve_block_sizes(q_shape, k_pages_shape, dtype, num_slots, pages_per_seq, override=None, *,
                        storage_dtype=None, shared_memory_bytes: int = GPU_SHARED_MEMORY_BYTES) -> BlockSizes:
    """Table entry for this call with (unless overridden) block_q*group capped at GPU_MAX_ROWS, the fields not
    overridden shrunk until the program's shared memory fits ``shared_memory_bytes`` (estimated, for the padded
    head_dim, ``dtype`` and the 8-bit ``storage_dtype`` of quantized pages), and ``num_splits`` fixed: enough
    splits to fill the GPU when the grid is small (decode), else 1."""
    num_tokens, num_q_heads, head_dim = q_shape
    num_kv_heads, _, page_size, _ = k_pages_shape
    group = num_q_heads // num_kv_heads
    sizes = get_block_sizes("gpu", head_dim, page_size, dtype, mode_for(num_tokens, num_slots), override)
    explicit = set(override or ()) if not isinstance(override, BlockSizes) else {
        "block_q", "block_kv", "num_stages"}
    if "block_q" not in explicit:
        sizes = sizes.replace(block_q=min(sizes.block_q, max(1, GPU_MAX_ROWS // group)))
    sizes = _fit_shared_memory(sizes, explicit, group, head_dim, dtype, storage_dtype, shared_memory_bytes)
    bkv = sizes.block_kv
    if bkv < 16 or bkv & (bkv - 1):
        raise ValueError(f"GPU block_kv must be a power of two >= 16, got {bkv}")
    if sizes.block_q < 1:
        raise ValueError(f"block_q must be >= 1, got {sizes.block_q}")
    max_blocks = -(-pages_per_seq * page_size // bkv)
    splits = sizes.num_splits
    if splits <= 0:
        tiles = max(1, min(num_tokens, num_tokens // sizes.block_q + num_slots + 1))
        splits = 1
        while splits * 2 * num_kv_heads * tiles <= _TARGET_PROGRAMS and splits * 2 <= _MAX_SPLITS:
            splits *= 2
    return sizes.replace(num_splits=max(1, min(splits, max_blocks)))


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "sizes", "interpret"))
def _ragged_paged_attention_gpu(q, k_pages, v_pages, md: AttentionMetadata, sinks, *, sm_scale, sliding_window,
                                soft_cap, sizes: BlockSizes, interpret):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    pages_per_seq = md.page_indices.shape[1]
    group = num_q_heads // num_kv_heads
    quantized = isinstance(k_pages, QuantizedPages)
    scales = (k_pages.scales.reshape(-1), v_pages.scales.reshape(-1)) if quantized else ()
    if quantized:
        k_pages, v_pages = k_pages.typed_values(), v_pages.typed_values()
    rows = kernel_rows(sizes.block_q, group)
    splits = sizes.num_splits
    tile_seq, tile_row, tile_len = q_tiles(md, num_tokens, sizes.block_q)
    flat_rows = num_tokens * num_q_heads
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((flat_rows, head_dim), q.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((splits, flat_rows, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((splits, flat_rows), jnp.float32),
                     jax.ShapeDtypeStruct((splits, flat_rows), jnp.float32)]
    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, group=group,
        num_q_heads=num_q_heads, rows=rows, lanes_padded=padded_lanes(head_dim), block_kv=sizes.block_kv,
        page_size=page_size, num_pages=num_pages,
        pages_per_seq=pages_per_seq, num_splits=splits, quantized=quantized, has_sinks=sinks is not None)
    extra = (*scales, *(() if sinks is None else (sinks.astype(jnp.float32),)))
    outs = pl.pallas_call(
        kernel,
        grid=(num_kv_heads, tile_seq.shape[0], splits),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=sizes.num_warps, num_stages=sizes.num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(tile_seq, tile_row, tile_len, md.cu_q_lens, md.kv_lens, md.page_indices.reshape(-1),
      q.reshape(flat_rows, head_dim), k_pages.reshape(-1, head_dim), v_pages.reshape(-1, head_dim), *extra)
    out = outs[0] if splits == 1 else _merge_splits(*outs).astype(q.dtype)
    return out.reshape(num_tokens, num_q_heads, head_dim)


def ragged_paged_attention_gpu(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # f32[num_q_heads]
    block_sizes: BlockSizes | dict | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Ragged paged attention (mixed decode and prefill) as one Pallas GPU (Triton) kernel.

    Same contract as ``reference.ragged_paged_attention``; the pages must already hold this step's K/V
    (see ``pallas_kernels.kv_cache_update.write_kv_gpu``). ``k_pages`` / ``v_pages`` may be 8-bit
    ``QuantizedPages``: each key block's values and scales are loaded and dequantized in the kernel.

    Args:
      q, k_pages, v_pages, md: as in the reference.
      sm_scale, sliding_window, soft_cap, sinks: as in the reference (a sink starts each row's online softmax:
        m = sink, l = 1, no value).
      block_sizes: a ``BlockSizes`` or a dict of fields overriding the ``block_sizes`` table entry
        (``num_splits=0`` chooses the split count from the grid size).
      interpret: run in the CPU interpreter.

    Returns:
      [T, num_q_heads, head_dim] in q's dtype; padding rows are zeros.
    """
    if plgpu is None:  # pragma: no cover
        raise RuntimeError("this jax release has no Pallas Triton backend (jax.experimental.pallas.triton)")
    check_shapes(q, k_pages, v_pages, md, sinks)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
    quantized = isinstance(k_pages, QuantizedPages)
    page_dtype = q.dtype if quantized else k_pages.dtype
    sizes = resolve_block_sizes(q.shape, k_pages.shape, page_dtype, md.kv_lens.shape[0],
                                md.page_indices.shape[1], block_sizes,
                                storage_dtype=k_pages.storage_dtype if quantized else None)
    # 32-bit offsets (pallas_kernels.gpu_addressing): a clear error instead of reads of the wrong rows.
    storage = k_pages.storage_dtype if quantized else k_pages.dtype
    check_elements("k_pages", k_pages.shape, jnp.dtype(storage).itemsize)
    check_elements("q", q.shape, jnp.dtype(q.dtype).itemsize)
    if sizes.num_splits > 1:
        check_elements("the split partial outputs", (sizes.num_splits, *q.shape), 4)
    return _ragged_paged_attention_gpu(
        q, k_pages, v_pages, md, sinks, sm_scale=float(sm_scale),
        sliding_window=sliding_window, soft_cap=None if soft_cap is None else float(soft_cap), sizes=sizes,
        interpret=interpret)
