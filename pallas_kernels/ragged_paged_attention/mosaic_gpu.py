"""Ragged paged attention on Hopper (Pallas, Mosaic GPU backend): TMA page gathers, wgmma, warp specialisation.

Same contract as ``reference.ragged_paged_attention`` (mixed decode rows and prompt chunks in one call, GQA,
sliding window, soft cap, attention sinks, 8-bit pages with per-token scales). The pages must already hold this
step's K/V: the KV write is the existing path (``pallas_kernels.kv_cache_update``), not this kernel.

Work split. The wrapper cuts the batch into query tiles that never straddle a sequence (``schedule.q_tiles``)
of ``block_q = 64 // group`` tokens, so that one tile's tokens times the KV head's query heads fill the 64 rows
of one warpgroup's wgmma (row r = token r // group, query head r % group): a decode token is a tile of its own
whose ``group`` query heads share the K/V reads, a prompt chunk is a run of tiles. The grid is
``(num_kv_heads, num_tiles)``; each block runs two warpgroups:

- warpgroup 1 (memory): walks the tile's key blocks (``block_kv`` keys = ``block_kv / page_size`` whole pages,
  from the first key inside the first token's window to the last token's position) and, per block, issues one
  TMA copy per page of K and of V (and of their scales for 8-bit pages), page ids read from the page table, into
  ``num_stages`` shared-memory slots; it refills a slot when the compute warpgroup releases it.
- warpgroup 0 (compute): TMA-loads the tile's queries once, then per block: waits for K, ``S = Q K^T`` (wgmma,
  fp32 accumulator), releases K, masks (causal, window, row validity), soft cap, online softmax in fp32; waits
  for V, ``acc += P V`` (wgmma, P from registers), releases V. Its output goes back through shared memory by TMA
  into a per-tile output block that the wrapper scatters back to token order.

8-bit pages: the 8-bit tile is widened to the query dtype in shared memory (exact for int8 and fp8) and the
per-token scales are applied to the score columns (K) and to P's columns (V), which is the same as
dequantizing each row: ``q . (s_k k) = s_k (q . k)`` and ``sum_j p_j s_vj v_j``.

Interpreted (``interpret=True``, Pallas's Mosaic GPU interpreter on CPU), ``P`` goes to the ``P V`` wgmma through a
shared-memory tile, since the interpreter takes wgmma operands from shared memory only; that is the one
difference from the compiled kernel (``tests/kernels/test_kernel_mosaic_gpu.py``).

Stray reads. Page-table entries past a sequence are clamped into the pool before their TMA copy, and score
entries outside the visible range are masked with ``where`` (a NaN in K never reaches the softmax). V rows past
the last query's position are zeroed in shared memory before the last block's ``P V`` (``0 * NaN`` is NaN).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - depends on the jax release
    plgpu = None

from pallas_kernels.metadata import AttentionMetadata, check_shapes
from pallas_kernels.quantized_pages import QuantizedPages
from pallas_kernels.ragged_paged_attention.block_sizes import (
    GPU_SHARED_MEMORY_BYTES,
    BlockSizes,
    get_block_sizes,
    mode_for,
    mosaic_gpu_shared_memory,
)
from pallas_kernels.ragged_paged_attention.schedule import q_tiles

ROWS = 64  # wgmma M of one warpgroup
# The widest head: ``P V`` is one wgmma whose N is head_dim (Hopper's wgmma takes N <= 256), accumulated in the
# compute warpgroup's registers (64 x head_dim fp32 is head_dim / 2 registers per thread, of the 232 it holds).
# Multi-head latent attention's 576-wide entries (DeepSeek: kv_lora_rank 512 + rope 64) are past it.
MAX_HEAD_DIM = 256
# A TMA copy's destination in shared memory starts on a 128-byte boundary (an 8-bit pool's scale rows).
TMA_SMEM_ALIGNMENT = 128
_COMPUTE_DTYPES = ("bfloat16", "float16")


def _smem_transforms(minor: int, dtype):
    """Tiling and swizzle of a [rows, minor] shared-memory operand: the widest swizzle that divides a row."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    if swizzle < 32:  # Mosaic GPU swizzles 32, 64 or 128 bytes; only 8-bit pages (never wgmma operands) get here
        return ()
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _tile_bounds(tile, tile_seq_ref, tile_row_ref, tile_len_ref, cu_q_lens_ref, kv_lens_ref, *, block_kv,
                 sliding_window):
    """Scalars of one tile: (seq, first token, tokens, position of the first token, first key block, blocks)."""
    seq, row0, n = tile_seq_ref[tile], tile_row_ref[tile], tile_len_ref[tile]
    live = (seq >= 0) & (n > 0)
    seq = jnp.maximum(seq, 0)
    pos0 = kv_lens_ref[seq] - cu_q_lens_ref[seq + 1] + row0  # position of the tile's first token
    hi = pos0 + n - 1
    lo = jnp.int32(0) if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    first_block = lax.div(lo, jnp.int32(block_kv))
    num_blocks = jnp.where(live, lax.div(jnp.maximum(hi, 0), jnp.int32(block_kv)) - first_block + 1, 0)
    return seq, row0, n, pos0, first_block, num_blocks


def _kernel(
    tile_seq_ref,  # i32[NT]
    tile_row_ref,  # i32[NT]
    tile_len_ref,  # i32[NT]
    cu_q_lens_ref,  # i32[S + 1]
    kv_lens_ref,  # i32[S]
    pages_ref,  # i32[S * P]
    q_ref,  # dt[KVH, NT, ROWS, D]: queries in tile order
    k_ref,  # kv[KVH, num_pages, page_size, D]
    v_ref,  # kv[KVH, num_pages, page_size, D]
    *refs,  # 8-bit: k/v scales f32[KVH, num_pages, page_size]; sinks: f32[KVH, ROWS]; out dt[KVH, NT, ROWS, D];
    # then the scratch
    sm_scale, sliding_window, soft_cap, group, block_kv, page_size, num_pages, pages_per_seq, num_stages, quantized,
    has_sinks, p_in_smem,
):
    p_smem = sinks_ref = sink_smem = None
    if p_in_smem:
        *refs, p_smem = refs
    if has_sinks:  # each tile row's query head's sink logit, and its shared-memory copy
        *refs, sink_smem = refs
    if quantized:
        ks_ref, vs_ref, *refs = refs  # f32[KVH, num_pages, page_size] each
    if has_sinks:
        sinks_ref, *refs = refs
    if quantized:
        o_ref, q_smem, k_smem, v_smem, kc_smem, vc_smem, ks_smem, vs_smem, q_bar, k_bar, v_bar, k_free, v_free = refs
    else:
        o_ref, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_free, v_free = refs
    head, tile, wg = lax.axis_index("heads"), lax.axis_index("tiles"), lax.axis_index("wg")
    seq, row0, n, pos0, first_block, num_blocks = _tile_bounds(
        tile, tile_seq_ref, tile_row_ref, tile_len_ref, cu_q_lens_ref, kv_lens_ref, block_kv=block_kv,
        sliding_window=sliding_window)
    pages_per_block = block_kv // page_size
    dtype = q_ref.dtype

    @pl.when(wg == 1)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def issue(step, slot, ref, smem, scales_ref, scales_smem, bar):
            b = first_block + step
            for j in range(pages_per_block):
                entry = jnp.minimum(b * pages_per_block + j, pages_per_seq - 1)
                # Entries past the sequence are never used but may hold anything: keep the copy inside the pool.
                page = jnp.clip(pages_ref[seq * pages_per_seq + entry], 0, num_pages - 1)
                rows = pl.ds(j * page_size, page_size)
                plgpu.copy_gmem_to_smem(ref.at[head, page], smem.at[slot, rows], bar.at[slot])
                if quantized:
                    plgpu.copy_gmem_to_smem(scales_ref.at[head, page], scales_smem.at[slot, rows], bar.at[slot])

        ks = (ks_ref, ks_smem) if quantized else (None, None)
        vs = (vs_ref, vs_smem) if quantized else (None, None)
        for s in range(num_stages):
            @pl.when(s < num_blocks)
            def _prefetch():
                issue(s, s, k_ref, k_smem, *ks, k_bar)
                issue(s, s, v_ref, v_smem, *vs, v_bar)

        @pl.loop(num_stages, jnp.maximum(num_blocks, num_stages))
        def _refill(step):
            slot = lax.rem(step, num_stages)
            plgpu.barrier_wait(k_free.at[slot])
            issue(step, slot, k_ref, k_smem, *ks, k_bar)
            plgpu.barrier_wait(v_free.at[slot])
            issue(step, slot, v_ref, v_smem, *vs, v_bar)

    @pl.when(wg == 0)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        plgpu.copy_gmem_to_smem(q_ref.at[head, tile], q_smem, q_bar.at[0])
        if has_sinks:
            plgpu.copy_gmem_to_smem(sinks_ref.at[head], sink_smem, q_bar.at[0])
        plgpu.barrier_wait(q_bar.at[0])
        shape = (ROWS, block_kv)
        row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
        col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
        token = lax.div(row, jnp.int32(group))
        pos = pos0 + token  # of each score row
        row_ok = token < n
        hi = pos0 + n - 1
        v_row = plgpu.broadcasted_iota(jnp.int32, (block_kv, q_ref.shape[-1]), 0, layout=plgpu.Layout.WGMMA)

        def widen(src, dst, keep):
            """8-bit slot -> query dtype in ``dst`` (rows where ``keep`` is False become 0)."""
            x = plgpu.load(src, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
            if keep is not None:
                x = jnp.where(keep, x, 0.0)
            dst[...] = x.astype(dtype)
            plgpu.commit_smem()

        def body(step, carry):
            acc, m, denom = carry
            slot = lax.rem(step, num_stages)
            b = first_block + step
            key = b * block_kv + col
            plgpu.barrier_wait(k_bar.at[slot])
            if quantized:
                widen(k_smem.at[slot], kc_smem, None)
                k_op = kc_smem
            else:
                k_op = k_smem.at[slot]

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_op.T)
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32))
            if quantized:
                k_scale = plgpu.load(ks_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                s = s * lax.broadcast_in_dim(k_scale, shape, [1])
            plgpu.barrier_arrive(k_free.at[slot])
            s = s * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            visible = row_ok & (key <= pos)
            if sliding_window is not None:
                visible &= key > pos - sliding_window
            s = jnp.where(visible, s, -jnp.inf)
            m_next = jnp.maximum(m, s.max(axis=1))
            # Rows with nothing visible yet keep m = -inf; shift by 0 so exp gives 0 instead of NaN.
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
            p = jnp.exp(s - lax.broadcast_in_dim(m_safe, shape, [0]))
            alpha = jnp.exp(m - m_safe)
            l_next = alpha * denom + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_bar.at[slot])
            keep = (b * block_kv + v_row) <= hi  # V rows past the last query's position may be NaN
            if quantized:
                widen(v_smem.at[slot], vc_smem, keep)
                v_op = vc_smem
                v_scale = plgpu.load(vs_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                p = p * lax.broadcast_in_dim(v_scale, shape, [1])
            else:
                v_op = v_smem.at[slot]

                @pl.when(step == num_blocks - 1)
                def _zero_tail():
                    v = plgpu.load(v_op, layout=plgpu.Layout.WGMMA)
                    v_op[...] = jnp.where(keep, v, jnp.zeros((), v.dtype))
                    plgpu.commit_smem()

            p_op = p.astype(dtype)
            if p_smem is not None:  # the interpreter's wgmma takes its A operand from shared memory only
                p_smem[...] = p_op
                plgpu.commit_smem()
                p_op = p_smem

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_op, v_op)
                return acc_ref[...]

            # A fresh accumulator added to the rescaled one, rather than ``pl.run_state(pv)(plgpu.ACC.init(acc))``
            # (which accumulates in place): the Mosaic GPU interpreter has no rule for ``run_state``.
            acc = acc + pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_next, l_next

        head_dim = q_ref.shape[-1]
        acc = plgpu.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA)
        if has_sinks:
            # The sink is one more key with a zero value: the online softmax starts from it (m = sink, l = 1).
            m = plgpu.load(sink_smem, layout=plgpu.Layout.WGMMA.reduce(1))
            denom = plgpu.layout_cast(jnp.ones((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        else:
            m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            denom = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc, m, denom = lax.fori_loop(0, num_blocks, body, (acc, m, denom))
        out = acc / lax.broadcast_in_dim(jnp.where(denom > 0, denom, 1.0), acc.shape, [0])
        q_smem[...] = out.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[head, tile])
        plgpu.wait_smem_to_gmem(0)


def resolve_block_sizes(q_shape, k_pages_shape, dtype, num_slots, override=None, *, storage_dtype=None,
                        shared_memory_bytes: int = GPU_SHARED_MEMORY_BYTES) -> BlockSizes:
    """Table entry (``block_sizes.MOSAIC_GPU_BLOCK_SIZES``, or the mode's default) for this call: ``block_kv``
    rounded up to a multiple of 64 and of the page size, then (fields not overridden) the ring shrunk until the
    block's shared memory fits: stages down to 2, then block_kv down to 64 (or one page), then one stage."""
    num_tokens, num_q_heads, head_dim = q_shape
    num_kv_heads, _, page_size, _ = k_pages_shape
    sizes = get_block_sizes("mosaic_gpu", head_dim, page_size, dtype, mode_for(num_tokens, num_slots), override)
    explicit = set(override or ()) if not isinstance(override, BlockSizes) else {"block_kv", "num_stages"}
    unit = math.lcm(64, page_size)
    if "block_kv" not in explicit:
        sizes = sizes.replace(block_kv=-(-sizes.block_kv // unit) * unit)

    def fits(s: BlockSizes) -> bool:
        return mosaic_gpu_shared_memory(head_dim, s.block_kv, s.num_stages, dtype,
                                        storage_dtype) <= shared_memory_bytes

    for field, floor in (("num_stages", 2), ("block_kv", unit), ("num_stages", 1)):
        while field not in explicit and not fits(sizes) and getattr(sizes, field) > floor:
            value = getattr(sizes, field)
            sizes = sizes.replace(**{field: max(floor, value - 1 if field == "num_stages" else value // 2)})
    if sizes.block_kv % 64 or sizes.block_kv % page_size:
        raise ValueError(f"Mosaic GPU block_kv must be a multiple of 64 and of page_size={page_size}, got "
                         f"{sizes.block_kv}")
    if sizes.num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {sizes.num_stages}")
    if not fits(sizes):
        raise ValueError(f"block_kv={sizes.block_kv}, num_stages={sizes.num_stages} need "
                         f"{mosaic_gpu_shared_memory(head_dim, sizes.block_kv, sizes.num_stages, dtype, storage_dtype)}"
                         f" bytes of shared memory, more than the {shared_memory_bytes} a block may use")
    return sizes


def check_supported(q_dtype, head_dim: int, page_size: int, group: int, *, quantized: bool = False) -> None:
    """The kernel's hardware limits, as ValueErrors naming the value; ``quantized``: an 8-bit pool."""
    if jnp.dtype(q_dtype).name not in _COMPUTE_DTYPES:
        raise ValueError(f"the Mosaic GPU kernel computes in bfloat16 or float16 (wgmma), got q dtype "
                         f"{jnp.dtype(q_dtype).name}")
    if head_dim % 16:
        raise ValueError(f"the Mosaic GPU kernel needs head_dim a multiple of 16 (rows of whole 32-byte swizzle "
                         f"blocks for wgmma), got {head_dim}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"the Mosaic GPU kernel needs head_dim at most {MAX_HEAD_DIM} (P V is one wgmma, N <= 256, "
                         f"into one warpgroup's fp32 accumulator of head_dim / 2 registers per thread), got "
                         f"{head_dim}")
    if page_size % 8:
        raise ValueError(f"the Mosaic GPU kernel needs page_size a multiple of 8 (one TMA copy per page into "
                         f"8-row shared-memory tiles), got {page_size}")
    if quantized and (page_size * 4) % TMA_SMEM_ALIGNMENT:
        # Each page's f32 scales are one TMA copy into the slot's scale row at page * page_size * 4 bytes; a TMA
        # destination in shared memory must start on a 128-byte boundary, and at page_size 8 or 16 every other
        # page's would not (on an H200 the copy faulted: CUDA_ERROR_MISALIGNED_ADDRESS).
        raise ValueError(f"the Mosaic GPU kernel reads an 8-bit pool's per-token f32 scales with one TMA copy per "
                         f"page, which must start on a {TMA_SMEM_ALIGNMENT}-byte boundary of shared memory: it needs "
                         f"page_size a multiple of {TMA_SMEM_ALIGNMENT // 4} with an 8-bit KV cache, got {page_size}")
    if group > ROWS:
        raise ValueError(f"the Mosaic GPU kernel holds one token's query heads in {ROWS} rows, got a GQA group of "
                         f"{group}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "sizes", "interpret"))
def _ragged_paged_attention_mosaic(q, k_pages, v_pages, md: AttentionMetadata, sinks, *, sm_scale, sliding_window,
                                   soft_cap, sizes: BlockSizes, interpret):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    pages_per_seq = md.page_indices.shape[1]
    group = num_q_heads // num_kv_heads
    block_q = max(1, min(sizes.block_q, ROWS // group))
    quantized = isinstance(k_pages, QuantizedPages)
    scales = ()
    if quantized:
        scales = (k_pages.scales.reshape(num_kv_heads, num_pages, page_size),
                  v_pages.scales.reshape(num_kv_heads, num_pages, page_size))
        k_pages, v_pages = k_pages.typed_values(), v_pages.typed_values()
    page_dtype = k_pages.dtype
    tile_seq, tile_row, tile_len = q_tiles(md, num_tokens, block_q)
    num_tiles = tile_seq.shape[0]
    # Queries in tile order, [KVH, num_tiles, ROWS, D] (row r of a tile: token r // group, head r % group; rows
    # past the tile's tokens are zeros), so each tile's TMA copy starts on a whole shared-memory tile.
    flat_q = q.reshape(num_tokens, num_kv_heads, group, head_dim).swapaxes(0, 1).reshape(num_kv_heads, -1, head_dim)
    flat_q = jnp.pad(flat_q, ((0, 0), (0, 1), (0, 0)))  # a zero row for the unused tile rows
    r = jnp.arange(ROWS, dtype=jnp.int32)
    row_ok = (r[None] // group < tile_len[:, None]) & (r[None] < block_q * group)
    src = jnp.where(row_ok, tile_row[:, None] * group + r[None], num_tokens * group)  # [num_tiles, ROWS]
    qt = flat_q[:, src]
    stages = sizes.num_stages
    block_kv = sizes.block_kv
    q_tf = _smem_transforms(head_dim, q.dtype)
    kv_tf = _smem_transforms(head_dim, page_dtype)
    pages_per_block = block_kv // page_size
    copies = pages_per_block * (2 if quantized else 1)
    scratch = [plgpu.SMEM((ROWS, head_dim), q.dtype, transforms=q_tf),
               plgpu.SMEM((stages, block_kv, head_dim), page_dtype, transforms=kv_tf),
               plgpu.SMEM((stages, block_kv, head_dim), page_dtype, transforms=kv_tf)]
    if quantized:
        scratch += [plgpu.SMEM((block_kv, head_dim), q.dtype, transforms=q_tf),
                    plgpu.SMEM((block_kv, head_dim), q.dtype, transforms=q_tf),
                    plgpu.SMEM((stages, block_kv), jnp.float32),
                    plgpu.SMEM((stages, block_kv), jnp.float32)]
    has_sinks = sinks is not None
    extra = ()
    if has_sinks:  # row r of a tile is query head r % group of its KV head: f32[KVH, ROWS]
        extra = (sinks.astype(jnp.float32).reshape(num_kv_heads, group)[:, r % group],)
    scratch += [plgpu.Barrier(num_arrivals=1 + has_sinks, num_barriers=1),  # the queries (and the sinks)
                plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
                plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
                plgpu.Barrier(num_arrivals=1, num_barriers=stages),
                plgpu.Barrier(num_arrivals=1, num_barriers=stages)]
    p_in_smem = bool(interpret)
    if has_sinks:
        scratch.append(plgpu.SMEM((ROWS,), jnp.float32))
    if p_in_smem:
        scratch.append(plgpu.SMEM((ROWS, block_kv), q.dtype, transforms=_smem_transforms(block_kv, q.dtype)))
    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, group=group,
        block_kv=block_kv, page_size=page_size, num_pages=num_pages, pages_per_seq=pages_per_seq,
        num_stages=stages, quantized=quantized, has_sinks=has_sinks, p_in_smem=p_in_smem)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((num_kv_heads, num_tiles, ROWS, head_dim), q.dtype),
        scratch_types=scratch,
        grid=(num_kv_heads, num_tiles),
        grid_names=("heads", "tiles"),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
        kernel_name="ragged_paged_attention_mosaic_gpu",
    )(tile_seq, tile_row, tile_len, md.cu_q_lens, md.kv_lens, md.page_indices.reshape(-1), qt, k_pages, v_pages,
      *scales, *extra)
    # Back to token order: token t sits in the tile whose row range holds it.
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    slot = tile_row[:, None] + jnp.arange(block_q, dtype=jnp.int32)[None]
    owner = jnp.where(jnp.arange(block_q)[None] < tile_len[:, None], slot, num_tokens)
    token_tile = jnp.zeros((num_tokens,), jnp.int32).at[owner.reshape(-1)].set(
        jnp.repeat(jnp.arange(num_tiles, dtype=jnp.int32), block_q), mode="drop")
    rows = (tokens - tile_row[token_tile])[:, None] * group + jnp.arange(group)[None]  # [T, group]
    flat = out.reshape(num_kv_heads, num_tiles * ROWS, head_dim)
    picked = flat[:, (token_tile[:, None] * ROWS + rows)]  # [KVH, T, group, D]
    return picked.swapaxes(0, 1).reshape(num_tokens, num_q_heads, head_dim)


def ragged_paged_attention_mosaic_gpu(
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
    interpret=False,
) -> jax.Array:
    """Ragged paged attention (mixed decode and prefill) as one Mosaic GPU kernel for Hopper (sm_90a).

    Same contract as ``reference.ragged_paged_attention``; the pages must already hold this step's K/V (see
    ``pallas_kernels.kv_cache_update``). ``k_pages`` / ``v_pages`` may be 8-bit ``QuantizedPages``.

    Args:
      q, k_pages, v_pages, md: as in the reference; q in bfloat16 or float16.
      sm_scale, sliding_window, soft_cap, sinks: as in the reference (a sink starts each row's online softmax:
        m = sink, l = 1, no value).
      block_sizes: a ``BlockSizes`` or a dict of fields overriding the ``block_sizes`` table entry (``block_kv``,
        ``num_stages``; ``block_q`` is capped at ``64 // group``).
      interpret: run in Pallas's Mosaic GPU interpreter on CPU (True, or a ``plgpu.InterpretGPUParams``).

    Returns:
      [T, num_q_heads, head_dim] in q's dtype; padding rows are zeros.
    """
    if plgpu is None:  # pragma: no cover
        raise RuntimeError("this jax release has no Pallas Mosaic GPU backend (jax.experimental.pallas.mosaic_gpu)")
    check_shapes(q, k_pages, v_pages, md, sinks)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
    num_kv_heads, _, page_size, head_dim = k_pages.shape
    quantized = isinstance(k_pages, QuantizedPages)
    check_supported(q.dtype, head_dim, page_size, q.shape[1] // num_kv_heads, quantized=quantized)
    sizes = resolve_block_sizes(q.shape, k_pages.shape, q.dtype if quantized else k_pages.dtype,
                                md.kv_lens.shape[0], block_sizes,
                                storage_dtype=k_pages.storage_dtype if quantized else None)
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    return _ragged_paged_attention_mosaic(
        q, k_pages, v_pages, md, sinks, sm_scale=float(sm_scale), sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap), sizes=sizes, interpret=interpret or None)
