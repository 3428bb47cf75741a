"""Block sizes of the ragged paged-attention kernels: a small table of data, a default, and a caller override.

The table is keyed by ``(head_dim, page_size, dtype name, mode)`` where mode is ``"decode"`` when every sequence
slot can hold at most one query row on average (``num_tokens <= num_slots``) and ``"prefill"`` otherwise; the
mode is a static property of the call's shapes, so one jitted step always uses one entry. None of the entries
have been measured on hardware yet: they follow the constraints written next to each backend's defaults and are
meant to be replaced by ``scripts/bench_attention.py --tune`` results.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Literal

import jax.numpy as jnp

Mode = Literal["decode", "prefill"]
Backend = Literal["tpu", "gpu", "mosaic_gpu"]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of one kernel call.

    Attributes:
      block_q: query tokens per block (TPU: rows of one q block; GPU: rows of one tile, per sequence).
      block_kv: keys per KV block. TPU: a multiple of page_size (whole pages are DMA'd). GPU: a power of two >= 16
        (keys are gathered one by one through the page table, so blocks need not align with pages).
      kv_heads_per_block: TPU only: KV heads whose pages one DMA moves (must divide num_kv_heads).
      num_splits: GPU only: KV splits per query tile for decode (flash-decoding); 0 picks one from the grid size.
      num_warps, num_stages: GPU only: Triton launch parameters.
    """

    block_q: int
    block_kv: int
    kv_heads_per_block: int = 1
    num_splits: int = 0
    num_warps: int = 4
    num_stages: int = 2

    def replace(self, **changes) -> BlockSizes:
        return dataclasses.replace(self, **changes)


# TPU: the matmul rows are block_q * group, rounded up by the kernel to whole sublane tiles (8 fp32 / 16 bf16
# rows) and capped at TPU_MAX_ROWS. Decode uses block_q=1, i.e. the fewest rows that tile: a decode block mixes
# sequences, and every sequence's KV blocks run the softmax over all rows of the block, so extra rows are
# wasted VPU work. Decode moves all KV heads with one DMA per page (fewer, larger DMAs and fewer grid steps,
# whose first DMA is not overlapped). block_kv >= 128 keeps the score tile lane-dense.
TPU_MAX_ROWS = 512
TPU_BLOCK_SIZES: dict[tuple[int, int, str, Mode], BlockSizes] = {
    (64, 16, "bfloat16", "decode"): BlockSizes(block_q=1, block_kv=256, kv_heads_per_block=8),
    (64, 16, "bfloat16", "prefill"): BlockSizes(block_q=64, block_kv=256, kv_heads_per_block=1),
    (128, 16, "bfloat16", "decode"): BlockSizes(block_q=1, block_kv=256, kv_heads_per_block=8),
    (128, 16, "bfloat16", "prefill"): BlockSizes(block_q=64, block_kv=256, kv_heads_per_block=1),
    (128, 32, "bfloat16", "decode"): BlockSizes(block_q=1, block_kv=512, kv_heads_per_block=8),
    (128, 32, "bfloat16", "prefill"): BlockSizes(block_q=64, block_kv=512, kv_heads_per_block=1),
    (128, 16, "float32", "decode"): BlockSizes(block_q=1, block_kv=128, kv_heads_per_block=8),
    (128, 16, "float32", "prefill"): BlockSizes(block_q=32, block_kv=128, kv_heads_per_block=1),
}
TPU_DEFAULT = {"decode": BlockSizes(block_q=1, block_kv=128, kv_heads_per_block=8),
               "prefill": BlockSizes(block_q=64, block_kv=128)}

# GPU: the MMA rows are block_q * group, padded to a power of two >= 16 and capped at GPU_MAX_ROWS (the fp32
# accumulator lives in registers). Decode tiles hold one token, whose query heads fill the rows, and split the
# KV length; prefill tiles hold several tokens and need no split.
GPU_MAX_ROWS = 128
GPU_BLOCK_SIZES: dict[tuple[int, int, str, Mode], BlockSizes] = {
    (64, 16, "bfloat16", "decode"): BlockSizes(block_q=1, block_kv=64, num_warps=4, num_stages=2),
    (64, 16, "bfloat16", "prefill"): BlockSizes(block_q=64, block_kv=64, num_warps=4, num_stages=2),
    (128, 16, "bfloat16", "decode"): BlockSizes(block_q=1, block_kv=64, num_warps=4, num_stages=2),
    (128, 16, "bfloat16", "prefill"): BlockSizes(block_q=32, block_kv=64, num_warps=8, num_stages=2),
    (128, 32, "bfloat16", "decode"): BlockSizes(block_q=1, block_kv=128, num_warps=4, num_stages=2),
    (128, 32, "bfloat16", "prefill"): BlockSizes(block_q=32, block_kv=64, num_warps=8, num_stages=2),
    (128, 16, "float32", "decode"): BlockSizes(block_q=1, block_kv=32, num_warps=4, num_stages=2),
    (128, 16, "float32", "prefill"): BlockSizes(block_q=16, block_kv=32, num_warps=4, num_stages=2),
}
GPU_DEFAULT = {"decode": BlockSizes(block_q=1, block_kv=64), "prefill": BlockSizes(block_q=32, block_kv=64)}

# Shared memory one GPU program may use: 227 KiB on sm_90 (H100, H200; ``cudaDevAttrMaxSharedMemoryPerBlockOptin``).
GPU_SHARED_MEMORY_BYTES = 232_448


def gpu_shared_memory_estimate(rows: int, block_kv: int, lanes: int, num_stages: int, compute_dtype,
                               storage_dtype=None) -> int:
    """An upper bound of the shared memory (bytes) Triton gives one attention program.

    ``rows``: MMA rows (a power of two >= 16); ``lanes``: head_dim padded to a power of two; ``compute_dtype``: the
    MMA operands' (q's, and the dequantized pages'); ``storage_dtype``: the pages' when they differ (8-bit pages,
    each key row with an f32 scale). Terms: the q tile, the probabilities tile, the K and V tiles as MMA operands,
    and ``num_stages - 1`` more copies of the K and V blocks as loaded for the software pipeline. Measured on an
    H100 target (XLA's Triton, jax 0.11) over bf16 / fp32 / int8 pages, head_dim 64-256, 16 and 128 rows, block_kv
    32-128 and 1-3 stages, this is 1.07x to 3.9x the shared memory actually allocated, never below it
    (``scripts/compile_gpu_kernels.py`` measures it).
    """
    qb = jnp.dtype(compute_dtype).itemsize
    sb = qb if storage_dtype is None else jnp.dtype(storage_dtype).itemsize
    scale = 0 if storage_dtype is None or jnp.dtype(storage_dtype) == jnp.dtype(compute_dtype) else 4
    operands = rows * lanes * qb + rows * block_kv * qb + 2 * block_kv * lanes * qb
    pipeline = (max(1, num_stages) - 1) * 2 * block_kv * (lanes * sb + scale)
    return operands + pipeline + 1024  # barriers and alignment

# Mosaic GPU (Hopper): a tile is one warpgroup's 64 wgmma rows, so block_q is capped at 64 // group by the kernel
# (the table's block_q only lowers it). block_kv is a multiple of 64 (the P tile's wgmma layout) and of the page
# size (whole pages per TMA copy); num_stages is the depth of the K/V ring the memory warpgroup fills. Shared
# memory per block: (ROWS + 2 * num_stages * block_kv) * head_dim * itemsize (+ two widened tiles for 8-bit
# pages); at head_dim 256 the ring stays within 227 KiB with block_kv 64 and 3 stages. Shapes not in the table
# take MOSAIC_GPU_DEFAULT for their mode; 8-bit pages use the entry of their query dtype.
MOSAIC_GPU_BLOCK_SIZES: dict[tuple[int, int, str, Mode], BlockSizes] = {
    (64, 16, "bfloat16", "decode"): BlockSizes(block_q=64, block_kv=128, num_stages=3),
    (64, 16, "bfloat16", "prefill"): BlockSizes(block_q=64, block_kv=128, num_stages=2),
    (128, 16, "bfloat16", "decode"): BlockSizes(block_q=64, block_kv=128, num_stages=3),
    (128, 16, "bfloat16", "prefill"): BlockSizes(block_q=64, block_kv=128, num_stages=2),
    (256, 16, "bfloat16", "decode"): BlockSizes(block_q=64, block_kv=64, num_stages=3),
    (256, 16, "bfloat16", "prefill"): BlockSizes(block_q=64, block_kv=64, num_stages=2),
}
MOSAIC_GPU_DEFAULT = {"decode": BlockSizes(block_q=64, block_kv=64, num_stages=3),
                      "prefill": BlockSizes(block_q=64, block_kv=64, num_stages=2)}



def mosaic_gpu_shared_memory(head_dim: int, block_kv: int, num_stages: int, dtype, storage_dtype=None) -> int:
    """Shared memory (bytes) of one Mosaic GPU attention block: the query/output tile, the K/V ring, and for
    8-bit pages the two widened tiles and the ring's scales (the kernel's scratch, as allocated)."""
    qb = jnp.dtype(dtype).itemsize
    sb = qb if storage_dtype is None else jnp.dtype(storage_dtype).itemsize
    ring = 2 * num_stages * block_kv * head_dim * sb
    widened = 0 if storage_dtype is None else 2 * block_kv * head_dim * qb + 2 * num_stages * block_kv * 4
    return 64 * head_dim * qb + ring + widened + 1024  # barriers and alignment


_TABLES = {"tpu": (TPU_BLOCK_SIZES, TPU_DEFAULT), "gpu": (GPU_BLOCK_SIZES, GPU_DEFAULT),
           "mosaic_gpu": (MOSAIC_GPU_BLOCK_SIZES, MOSAIC_GPU_DEFAULT)}


def mode_for(num_tokens: int, num_slots: int) -> Mode:
    """Decode when the padded batch has no more query rows than sequence slots (a static property)."""
    return "decode" if num_tokens <= num_slots else "prefill"


def get_block_sizes(
    backend: Backend,
    head_dim: int,
    page_size: int,
    dtype,
    mode: Mode,
    override: BlockSizes | Mapping[str, int] | None = None,
) -> BlockSizes:
    """The table entry (or the backend default), with any fields of ``override`` replacing it.

    The kernels then adapt the entry to the call (sublane rounding, row caps, divisors of num_kv_heads); fields
    given in ``override`` are only rounded where the hardware requires it.
    """
    table, default = _TABLES[backend]
    sizes = table.get((head_dim, page_size, jnp.dtype(dtype).name, mode), default[mode])
    if backend == "tpu" and sizes.block_kv % page_size:
        # A default sized for another page size: round up to whole pages, which is what the DMA moves.
        sizes = sizes.replace(block_kv=-(-sizes.block_kv // page_size) * page_size)
    if isinstance(override, BlockSizes):
        return override
    if override:
        unknown = set(override) - {f.name for f in dataclasses.fields(BlockSizes)}
        if unknown:
            raise ValueError(f"unknown block-size fields {sorted(unknown)}")
        sizes = sizes.replace(**override)
    return sizes


def candidates(backend: Backend, head_dim: int, page_size: int, dtype, mode: Mode) -> list[BlockSizes]:
    """The block sizes a tuning sweep tries for one table key (the current entry first)."""
    base = get_block_sizes(backend, head_dim, page_size, dtype, mode)
    if backend == "mosaic_gpu":
        # A tile is 64 wgmma rows whatever block_q says; the knobs are the KV block and the depth of the K/V ring.
        grid = [BlockSizes(64, kv, num_stages=st) for kv in (64, 128, 256) if kv % page_size == 0
                for st in (2, 3, 4)]
    elif backend == "tpu":
        qs = [1, 2, 4, 8] if mode == "decode" else [16, 32, 64, 128]
        kvs = sorted({page_size * n for n in (4, 8, 16, 32) if page_size * n >= 64})
        heads = [1, 2, 4, 8]
        grid = [BlockSizes(q, kv, h) for q, kv, h in itertools.product(qs, kvs, heads)]
    else:
        # A decode tile is one token whatever block_q says; its knobs are the split count and the KV block.
        qs = [1] if mode == "decode" else [16, 32, 64]
        kvs = [32, 64, 128]
        splits = [0, 2, 4, 8, 16] if mode == "decode" else [0, 1]
        warps = [4, 8]
        grid = [BlockSizes(q, kv, num_splits=s, num_warps=w)
                for q, kv, s, w in itertools.product(qs, kvs, splits, warps)]
    return [base] + [c for c in grid if c != base]
