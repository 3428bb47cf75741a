"""Ragged paged attention on TPU (Pallas Mosaic).

Grid ``(num_kv_heads // kv_heads_per_block, cdiv(T, block_q))``. Program (h, b) owns query rows
``b*block_q .. (b+1)*block_q`` of the KV heads in head block h, with each KV head's query heads folded into the
matmul rows (row r = token r // group, query head r % group), so one ``[block_q*group, D] x [D, block_kv]``
matmul serves a whole GQA group. The wrapper lays q out as ``[KVH, T*group, D]`` (one XLA transpose) so the
q/out blocks are plain 2-D tiles.

A program walks the sequences that own rows in its block (a work list built by ``schedule.q_block_work``), and
for each one the KV blocks its rows can see: from the block holding the first key inside the sliding window
(whole blocks before it are never fetched) to the block holding its last row's position (causal). The KV pages
stay in HBM (``pl.ANY``); each block's pages are copied into one of two VMEM slots with ``make_async_copy``,
one DMA per page and per K/V (all KV heads of the head block in one strided copy), and the next block, which
may belong to the next sequence, is started before the current one is waited on (double buffering). Pages
outside the rows' key range, which includes page-table entries past the sequence's length, are not copied at
all, so a decode step reads exactly the pages it needs. The softmax is online across blocks, with the running
max/sum/accumulator of every row of the block in VMEM scratch; rows of other sequences see only masked scores,
which leaves their state unchanged.

Each program finishes all the DMAs it starts, so both grid axes are "parallel" (megacore can split them).

The new tokens' K/V are written by a separate kernel (``pallas_kernels.kv_cache_update.tpu``), not fused here:
fusing would need the write of a sequence's rows to land before any program that reads them, which holds only
if every q block of a sequence runs in order on one core ("arbitrary" semantics, no megacore split), and a
chunk's rows would be written by DMA and read back by DMA in the same program anyway. The separate kernel costs
one launch and a staged copy of the new rows (about T*KVH*D elements, small next to the pages attention
reads); its DMAs move whole page runs, two per decode row and two per full page of a prefill chunk. This is an
argument from DMA counts, not a measurement: no TPU was available when this was written.

8-bit pages (``QuantizedPages``): the 8-bit values are DMA'd page by page exactly as 16-bit ones (a quarter or
half of the bytes), widened in VMEM to the model's dtype (exact for int8 and both fp8 formats), and each key's
f32 scale multiplies its column of the scores before the softmax and of the probabilities before ``p @ v`` --
``q . (s k) = s (q . k)`` and ``sum_j p_j s_j v_j`` --, which is the dequantization at ``block_kv`` multiplies
per row instead of ``block_kv * head_dim``. The scales cannot be DMA'd page by page (``sequence_scales`` says
why): the wrapper gathers each sequence's scales in key order through its page table, and one lane-aligned DMA
per K and V fetches a KV block's scales beside its pages (``block_kv`` a multiple of 128 when compiled).

Not checkable on CPU: the flattened page table lives in SMEM, so ``num_slots * pages_per_seq`` int32 must fit
there: at most ``MAX_PAGE_TABLE_ENTRIES``. The Mosaic compiler (libtpu, compile-only) accepts this kernel on v4/v5e/v5p/v6e for bf16 and fp32 and
page sizes 8-64, and with int8, float8_e4m3fn and float8_e5m2 pages under bf16 and fp32 queries on all four
(``scripts/compile_tpu_kernels.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.metadata import AttentionMetadata, check_shapes
from pallas_kernels.quantized_pages import QuantizedPages
from pallas_kernels.ragged_paged_attention.block_sizes import (
    TPU_MAX_ROWS, BlockSizes, get_block_sizes, mode_for)
from pallas_kernels.ragged_paged_attention.kernel_ops import div_by, matmul
from pallas_kernels.ragged_paged_attention.schedule import q_block_work

# The most int32 the flattened page table may hold in SMEM, whatever the step's tokens or slots. libtpu
# (compile-only, ``scripts/compile_tpu_kernels.py --max-page-table``) compiles the kernel up to 260,736 entries on
# v5e, v5p and v6e and 261,120 on v4: 1 MiB of SMEM less the other scalars. This keeps 2,688 words of margin.
MAX_PAGE_TABLE_ENTRIES = 258_048

_LANES = 128


def _kernel(
    cu_q_lens_ref,  # SMEM i32[S + 1]
    kv_lens_ref,  # SMEM i32[S]
    pages_ref,  # SMEM i32[S * P]
    num_seqs_ref,  # SMEM i32[1]
    block_start_ref,  # SMEM i32[nb + 1]
    work_seq_ref,  # SMEM i32[nb + S]
    q_ref,  # VMEM [hb, R, D], R = block_q * group
    k_hbm,  # HBM [KVH, num_pages, page_size, D] (8-bit values when quantized)
    v_hbm,  # HBM [KVH, num_pages, page_size, D]
    *refs,  # [ks_hbm, vs_hbm: HBM f32[S, KVH, 1, key_span] (``sequence_scales``) when quantized], then:
    # o_ref  VMEM [hb, R, D]
    # k_buf, v_buf  VMEM [2, hb, block_kv, D] in the pages' dtype
    # [ks_buf, vs_buf  VMEM f32[2, hb, 1, block_kv] when quantized]
    # sems  DMA semaphores [2 slots, 4 (K, V, K scales, V scales)]
    # m_ref, l_ref  VMEM f32[hb, R, 128] running max and sum, replicated across lanes
    # acc_ref  VMEM f32[hb, R, D] running numerator
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    block_q: int,
    group: int,
    pages_per_seq: int,
    quantized: bool = False,
    has_sinks: bool = False,
):
    del num_seqs_ref  # the work list already excludes padding slots
    if quantized:
        ks_hbm, vs_hbm, *refs = refs
    if has_sinks:  # VMEM f32[hb, R, 128]: each row's query-head sink logit, replicated across lanes
        sinks_ref, *refs = refs
    if quantized:
        o_ref, k_buf, v_buf, ks_buf, vs_buf, sems, m_ref, l_ref, acc_ref = refs
    else:
        o_ref, k_buf, v_buf, sems, m_ref, l_ref, acc_ref = refs
    heads_per_block, rows, _ = q_ref.shape
    block_kv = k_buf.shape[2]
    page_size = k_hbm.shape[2]
    pages_per_block = block_kv // page_size
    head0 = pl.program_id(0) * heads_per_block
    q_block = pl.program_id(1)
    first_row = q_block * block_q
    max_work = work_seq_ref.shape[0]

    def span(seq):
        """Rows [r0, r1) of seq in this block, pos(token) = base + token, and the keys [lo, hi] they can see."""
        q_end = cu_q_lens_ref[seq + 1]
        base = kv_lens_ref[seq] - q_end
        r0 = jnp.maximum(cu_q_lens_ref[seq], first_row)
        r1 = jnp.minimum(q_end, first_row + block_q)
        hi = base + r1 - 1
        lo = jnp.int32(0) if sliding_window is None else jnp.maximum(base + r0 - sliding_window + 1, 0)
        return r0, r1, base, lo, hi

    def page_copies(seq, kv_block, slot, lo, hi):
        """(needed, copies) for each page of the block: K and V (and, for 8-bit pages, their scales); unneeded
        pages are never copied nor waited on."""
        copies = []
        for j in range(pages_per_block):
            p = kv_block * pages_per_block + j
            needed = (p >= div_by(lo, page_size)) & (p <= div_by(hi, page_size))
            page = pages_ref[seq * pages_per_seq + jnp.minimum(p, pages_per_seq - 1)]
            src = (pl.ds(head0, heads_per_block), page)
            dst = (slot, slice(None), pl.ds(j * page_size, page_size))
            copies.append((needed, [pltpu.make_async_copy(k_hbm.at[src], k_buf.at[dst], sems.at[slot, 0]),
                                    pltpu.make_async_copy(v_hbm.at[src], v_buf.at[dst], sems.at[slot, 1])]))
        return copies

    def scale_copies(seq, kv_block, slot):
        """8-bit pages: the block's key scales, one lane-aligned run of the sequence's scale row per K and V."""
        if not quantized:
            return []
        src = (seq, pl.ds(head0, heads_per_block), slice(None), pl.ds(pl.multiple_of(kv_block * block_kv, block_kv),
                                                                     block_kv))
        return [pltpu.make_async_copy(ks_hbm.at[src], ks_buf.at[slot], sems.at[slot, 2]),
                pltpu.make_async_copy(vs_hbm.at[src], vs_buf.at[slot], sems.at[slot, 3])]

    def start(seq, kv_block, slot, lo, hi):
        for needed, page in page_copies(seq, kv_block, slot, lo, hi):
            @pl.when(needed)
            def _():
                for copy in page:
                    copy.start()
        for copy in scale_copies(seq, kv_block, slot):
            copy.start()

    def wait(seq, kv_block, slot, lo, hi):
        for needed, page in page_copies(seq, kv_block, slot, lo, hi):
            @pl.when(needed)
            def _():
                for copy in page:
                    copy.wait()
        for copy in scale_copies(seq, kv_block, slot):
            copy.wait()

    def attend(kv_block, slot, r0, r1, base, lo, hi):
        token = first_row + div_by(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), group)
        pos = base + token
        key = kv_block * block_kv + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        visible = (token >= r0) & (token < r1) & (key <= pos)
        if sliding_window is not None:
            visible &= key > pos - sliding_window
        key_col = kv_block * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
        # Pages outside [lo, hi] were not copied: the slot holds stale data or NaN there, and 0 * NaN is NaN.
        fetched = (key_col >= lo) & (key_col <= hi)
        if quantized:
            key_row = kv_block * block_kv + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
            fetched_row = (key_row >= lo) & (key_row <= hi)
        for i in range(heads_per_block):
            if quantized:
                # 8-bit values widen exactly to the model's dtype; each key's scale multiplies its column of the
                # scores (q . s k = s (q . k)) and of the probabilities (sum p s v): block_kv scales per row
                # instead of block_kv * head_dim multiplies. Unfetched keys' scales may be stale or NaN: zeroed.
                k = k_buf[slot, i].astype(jnp.float32).astype(q_ref.dtype)
                v = jnp.where(fetched, v_buf[slot, i].astype(jnp.float32), 0.0).astype(q_ref.dtype)
                k_scale = jnp.where(fetched_row, ks_buf[slot, i], 0.0) * sm_scale
                v_scale = jnp.where(fetched_row, vs_buf[slot, i], 0.0)
            else:
                k = k_buf[slot, i]
                # Select in fp32: not every TPU generation has bf16 VPU ops.
                v = jnp.where(fetched, v_buf[slot, i].astype(jnp.float32), 0.0).astype(v_buf.dtype)
                k_scale = sm_scale
            q = q_ref[i].astype(k.dtype)
            s = matmul(q, k, transpose_b=True) * k_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(visible, s, -jnp.inf)
            m_prev = m_ref[i][:, :1]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            # Rows with nothing visible yet keep m = -inf; shift by 0 so exp gives 0 instead of NaN.
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
            p = jnp.exp(s - m_safe)
            alpha = jnp.exp(m_prev - m_safe)
            l_next = alpha * l_ref[i][:, :1] + jnp.sum(p, axis=1, keepdims=True)
            pv = matmul((p * v_scale if quantized else p).astype(v.dtype), v)
            acc_ref[i] = alpha * acc_ref[i] + pv
            m_ref[i] = jnp.broadcast_to(m_next, (rows, _LANES))
            l_ref[i] = jnp.broadcast_to(l_next, (rows, _LANES))

    if has_sinks:  # the sink is one more key with a zero value: the online softmax starts from it
        m_ref[...] = sinks_ref[...]
        l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
    else:
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    w_begin = block_start_ref[q_block]
    w_end = block_start_ref[q_block + 1]
    first_seq = work_seq_ref[jnp.minimum(w_begin, max_work - 1)]
    _, _, _, first_lo, first_hi = span(first_seq)
    first_kv_block = div_by(first_lo, block_kv)

    @pl.when(w_begin < w_end)
    def _():
        start(first_seq, first_kv_block, 0, first_lo, first_hi)

    def step(carry):
        w, kv_block, slot = carry
        seq = work_seq_ref[w]
        r0, r1, base, lo, hi = span(seq)
        last = kv_block == div_by(hi, block_kv)
        next_w = jnp.where(last, w + 1, w)
        next_seq = work_seq_ref[jnp.minimum(next_w, max_work - 1)]
        _, _, _, next_lo, next_hi = span(next_seq)
        next_kv_block = jnp.where(last, div_by(next_lo, block_kv), kv_block + 1)

        @pl.when(next_w < w_end)
        def _():
            start(next_seq, next_kv_block, 1 - slot, next_lo, next_hi)

        wait(seq, kv_block, slot, lo, hi)
        attend(kv_block, slot, r0, r1, base, lo, hi)
        return next_w, next_kv_block, 1 - slot

    lax.while_loop(lambda c: c[0] < w_end, step, (w_begin, first_kv_block, jnp.int32(0)))

    for i in range(heads_per_block):
        l = l_ref[i][:, :1]
        # Padding rows (and rows of no sequence) never saw a key: l == 0, output 0.
        o_ref[i] = jnp.where(l > 0, acc_ref[i] / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)


def sequence_scales(
    scales: jax.Array,  # f32[KVH, num_pages, page_size, 1]
    page_indices: jax.Array,  # i32[S, P]
    key_span: int,
) -> jax.Array:  # f32[S, KVH, 1, key_span]
    """Each sequence's key scales in key order (its page table's pages, gathered), padded to ``key_span``.

    A page's scales cannot be DMA'd on their own: TPU memory tiles the two minor dims of an array, so
    ``page_size`` f32 scales are either lanes of a 128-lane tile (a DMA at a lane offset that is not a multiple
    of 128 is illegal) or a column padded to 128 lanes. Gathered per sequence, a KV block's scales are one
    lane-aligned run (``block_kv`` a multiple of 128), fetched with one DMA. The gather reads
    ``S * P * page_size`` scales per K and V, 4 bytes per key against the ``head_dim`` bytes of its 8-bit values.
    Page-table entries past a sequence's pages may be garbage: clipped here, never visible in the kernel.
    """
    num_kv_heads, num_pages, page_size, _ = scales.shape
    num_slots, pages_per_seq = page_indices.shape
    pages = jnp.clip(page_indices, 0, num_pages - 1)
    # Gathered along the page axis of the [KVH, page_size, num_pages] view, the pool's own TPU layout (pages
    # minor, so the size-1 axis is not padded). XLA may still copy the pool page-major first (docs/kernels.md).
    by_slot = scales[..., 0].transpose(0, 2, 1)
    gathered = jnp.take(by_slot, pages.reshape(-1), axis=2)  # [KVH, page_size, S * P]
    gathered = gathered.reshape(num_kv_heads, page_size, num_slots, pages_per_seq).transpose(2, 0, 3, 1)
    gathered = gathered.reshape(num_slots, num_kv_heads, pages_per_seq * page_size)
    gathered = jnp.pad(gathered, ((0, 0), (0, 0), (0, key_span - pages_per_seq * page_size)))
    return gathered[:, :, None, :]


def check_8_bit_page_size(page_size: int) -> None:
    """Compiled, 8-bit pages must be a power of two in size: each is DMA'd to offset ``j * page_size`` of the
    8-bit VMEM buffer, which Mosaic accepts only at offsets its (up to 32-row) tiling divides (page size 48 is
    refused: "Offsets along tiled dimensions must be aligned to tiles"; 8 to 128 compile)."""
    if page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size}: the Pallas TPU kernel reads 8-bit KV pages whose size is a "
                         "power of two only")


def _sublanes(dtype) -> int:
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def resolve_block_sizes(q_shape, k_pages_shape, dtype, num_slots, override=None) -> BlockSizes:
    """Table entry for this call, adapted to the TPU: block_q*group on whole sublane tiles and (unless
    block_q is overridden) at most TPU_MAX_ROWS rows; kv_heads_per_block a divisor of num_kv_heads."""
    num_tokens, num_q_heads, head_dim = q_shape
    num_kv_heads, _, page_size, _ = k_pages_shape
    group = num_q_heads // num_kv_heads
    sizes = get_block_sizes("tpu", head_dim, page_size, dtype, mode_for(num_tokens, num_slots), override)
    explicit = set(override or ()) if not isinstance(override, BlockSizes) else {"block_q", "kv_heads_per_block"}
    block_q = sizes.block_q
    if block_q < 1:
        raise ValueError(f"block_q must be >= 1, got {block_q}")
    if "block_q" not in explicit:
        block_q = min(block_q, max(1, TPU_MAX_ROWS // group))
    sub = _sublanes(dtype)
    while (block_q * group) % sub:
        block_q += 1
    heads = min(max(1, sizes.kv_heads_per_block), num_kv_heads)
    while num_kv_heads % heads:
        heads -= 1
    if sizes.block_kv % page_size or sizes.block_kv <= 0:
        raise ValueError(f"TPU block_kv={sizes.block_kv} must be a positive multiple of page_size={page_size}")
    return sizes.replace(block_q=block_q, kv_heads_per_block=heads)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "sizes", "interpret", "vmem_limit_bytes"))
def _ragged_paged_attention_tpu(q, k_pages, v_pages, md: AttentionMetadata, sinks, *, sm_scale, sliding_window,
                                soft_cap, sizes: BlockSizes, interpret, vmem_limit_bytes):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, _, _ = k_pages.shape
    num_slots, pages_per_seq = md.page_indices.shape
    group = num_q_heads // num_kv_heads
    block_q, heads = sizes.block_q, sizes.kv_heads_per_block
    num_blocks = -(-num_tokens // block_q)
    padded = num_blocks * block_q
    rows = block_q * group

    q_heads_major = jnp.pad(q, ((0, padded - num_tokens), (0, 0), (0, 0)))
    q_heads_major = q_heads_major.reshape(padded, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    q_heads_major = q_heads_major.reshape(num_kv_heads, padded * group, head_dim)
    block_start, work_seq = q_block_work(md, num_tokens, block_q)

    q_spec = pl.BlockSpec((heads, rows, head_dim), lambda h, b, *_: (h, b, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    quantized = isinstance(k_pages, QuantizedPages)
    # 8-bit pages: the values are DMA'd page by page, the scales block by block from each sequence's gathered row.
    if quantized:
        block_kv = sizes.block_kv
        key_span = -(-pages_per_seq * k_pages.shape[2] // block_kv) * block_kv
        pools = (k_pages.typed_values(), v_pages.typed_values(), *(sequence_scales(p.scales, md.page_indices, key_span)
                                                     for p in (k_pages, v_pages)))
    else:
        pools = (k_pages, v_pages)
    kv_buf = pltpu.VMEM((2, heads, sizes.block_kv, head_dim), pools[0].dtype)
    scale_buf = pltpu.VMEM((2, heads, 1, sizes.block_kv), jnp.float32)
    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, block_q=block_q,
        group=group, pages_per_seq=pages_per_seq, quantized=quantized, has_sinks=sinks is not None)
    sink_specs, sink_rows = [], []
    if sinks is not None:  # f32[KVH, R, 128]: row r of a block is query head (kv head) * group + r % group
        per_row = jnp.tile(sinks.astype(jnp.float32).reshape(num_kv_heads, 1, group), (1, block_q, 1))
        sink_rows = [jnp.broadcast_to(per_row.reshape(num_kv_heads, rows, 1), (num_kv_heads, rows, _LANES))]
        sink_specs = [pl.BlockSpec((heads, rows, _LANES), lambda h, b, *_: (h, 0, 0))]
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(num_kv_heads // heads, num_blocks),
            in_specs=[q_spec] + [any_spec] * len(pools) + sink_specs,
            out_specs=q_spec,
            scratch_shapes=[
                kv_buf, kv_buf, *([scale_buf, scale_buf] if quantized else []),
                pltpu.SemaphoreType.DMA((2, len(pools))),
                pltpu.VMEM((heads, rows, _LANES), jnp.float32),
                pltpu.VMEM((heads, rows, _LANES), jnp.float32),
                pltpu.VMEM((heads, rows, head_dim), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q_heads_major.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=vmem_limit_bytes),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(md.cu_q_lens, md.kv_lens, md.page_indices.reshape(-1), md.num_seqs, block_start, work_seq, q_heads_major,
      *pools, *sink_rows)
    out = out.reshape(num_kv_heads, padded, group, head_dim).transpose(1, 0, 2, 3)
    return out.reshape(padded, num_q_heads, head_dim)[:num_tokens]


def ragged_paged_attention_tpu(
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
    interpret: bool | pltpu.InterpretParams = False,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:
    """Ragged paged attention (mixed decode and prefill) as one Pallas Mosaic TPU kernel.

    Same contract as ``reference.ragged_paged_attention``; the pages must already hold this step's K/V
    (see ``pallas_kernels.kv_cache_update.write_kv_tpu``). ``k_pages`` / ``v_pages`` may be 8-bit
    ``QuantizedPages`` (int8, float8_e4m3fn or float8_e5m2 values with per-token f32 scales): the 8-bit values
    are DMA'd and dequantized in the kernel.

    Args:
      q, k_pages, v_pages, md: as in the reference.
      sm_scale, sliding_window, soft_cap, sinks: as in the reference (a sink starts each row's online softmax:
        m = sink, l = 1, no value).
      block_sizes: a ``BlockSizes`` or a dict of fields overriding the ``block_sizes`` table entry.
      interpret: run on CPU: True for the plain interpreter, or ``pltpu.InterpretParams`` for the TPU
        simulator (DMA timing, race detection).
      vmem_limit_bytes: passed to Mosaic.

    Returns:
      [T, num_q_heads, head_dim] in q's dtype; padding rows are zeros.
    """
    check_shapes(q, k_pages, v_pages, md, sinks)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
    # 8-bit pages are computed on in q's dtype once dequantized: they share its block-size entries.
    page_dtype = q.dtype if isinstance(k_pages, QuantizedPages) else k_pages.dtype
    sizes = resolve_block_sizes(q.shape, k_pages.shape, page_dtype, md.kv_lens.shape[0], block_sizes)
    if isinstance(k_pages, QuantizedPages) and not interpret:
        check_8_bit_page_size(k_pages.shape[2])
        if sizes.block_kv % _LANES:
            raise ValueError(f"TPU block_kv={sizes.block_kv} must be a multiple of {_LANES} for 8-bit KV pages (a "
                             "block's scales are fetched as one lane-aligned run)")
    return _ragged_paged_attention_tpu(
        q, k_pages, v_pages, md, sinks, sm_scale=float(sm_scale),
        sliding_window=sliding_window, soft_cap=None if soft_cap is None else float(soft_cap), sizes=sizes,
        interpret=interpret, vmem_limit_bytes=vmem_limit_bytes)
