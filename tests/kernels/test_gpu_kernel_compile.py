"""The Pallas GPU kernels compiled for a described H100 (and H200) with no GPU: XLA's GPU compiler and its Triton
build turn them into sm_90 code, which is where a block that is not a power of two or a program that asks for more
shared memory than the 227 KiB an SM gives one block fails. Shapes are the engine's at page_size 16 (decode and
large-batch decode, prefill, a mixed step with a window and a soft cap), for every head size the supported
families use and every pool dtype (bf16, fp32, int8 and fp8 e4m3 pages read with bf16 queries).

Each case compiles once (``_compile`` is cached); the whole file takes about three minutes on two CPU cores.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.kv_cache_update import write_kv_gpu
from pallas_kernels.quantized_pages import STORAGE, QuantizedPages
from pallas_kernels.ragged_paged_attention import AttentionMetadata, ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_attention.block_sizes import GPU_SHARED_MEMORY_BYTES, gpu_shared_memory_estimate
from pallas_kernels.ragged_paged_attention.gpu import kernel_rows, padded_lanes, resolve_block_sizes

HEAD_DIMS = (16, 24, 64, 80, 96, 112, 128, 256)
PAGE_SIZE, PAGES_PER_SEQ, NUM_PAGES, KV_HEADS, GROUP = 16, 64, 256, 2, 4
# (tokens, sequence slots, sliding window, soft cap): the engine's buckets at its defaults (32 sequences, 512
# batched tokens), and a large-batch decode.
SHAPES = {
    "decode": (8, 8, None, None),
    "large_decode": (256, 256, None, None),
    "prefill": (512, 32, None, None),
    "mixed": (256, 32, 64, 30.0),
}
# 8-bit pages are read with bf16 queries.
POOLS = {"bfloat16": ("bfloat16", None), "float32": ("float32", None), "int8": ("bfloat16", "int8"),
         "fp8": ("bfloat16", "fp8")}

# Prefill tiles have the most rows and ask for the most shared memory: every lane width the head sizes tile at
# there (bf16), and every pool at the largest head size. 80 and 112 tile as 96 does (padded to 128 lanes, the same
# block sizes and warps: test_padded_head_sizes_tile_alike), so 96 compiles for the three; every head size lowers
# to Triton in test_kernel_gpu.py. The other shapes: every pool once, at a head size that is not a power of two or
# at the largest. (fp32 compiles are the slow ones, hence the fewest.)
PADDED_ALIKE = (80, 96, 112)
ATTENTION_CASES = (
    [("prefill", d, "bfloat16") for d in HEAD_DIMS if d not in (80, 112)]
    + [("prefill", 256, p) for p in ("float32", "int8", "fp8")] + [("prefill", 24, "float32")]
    + [("decode", 96, "bfloat16"), ("decode", 256, "float32"), ("decode", 96, "int8"), ("decode", 256, "fp8")]
    + [("large_decode", 256, "bfloat16"), ("large_decode", 96, "float32"), ("large_decode", 256, "int8"),
       ("large_decode", 96, "fp8")]
    + [("mixed", 96, "bfloat16"), ("mixed", 24, "float32"), ("mixed", 256, "int8"), ("mixed", 96, "fp8")])
WRITE_CASES = [(24, "float32"), (96, "bfloat16"), (128, "bfloat16"), (256, "float32"), (256, "int8"),
               (256, "fp8")]


@pytest.fixture(scope="module", autouse=True)
def _plugin():
    from jaxserve.tools import gpu_targets

    try:
        gpu_targets.devices("h100")
    except gpu_targets.NoGpuCompiler as e:
        pytest.skip(str(e))


def _attention_args(shape: str, head_dim: int, pool: str):
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    tokens, slots, _, _ = SHAPES[shape]
    dtype, storage = POOLS[pool]
    md = AttentionMetadata(sds((slots + 1,), i32), sds((slots,), i32), sds((slots, PAGES_PER_SEQ), i32),
                           sds((1,), i32))
    q = sds((tokens, KV_HEADS * GROUP, head_dim), dtype)
    pages_shape = (KV_HEADS, NUM_PAGES, PAGE_SIZE, head_dim)
    if storage is None:
        pages = sds(pages_shape, dtype)
    else:
        pages = QuantizedPages(sds(pages_shape, STORAGE[storage]), sds(pages_shape[:-1] + (1,), jnp.float32),
                               jnp.dtype(dtype))
    return q, pages, pages, md


def _attention(shape: str):
    _, _, window, soft_cap = SHAPES[shape]
    return jax.jit(lambda *a: ragged_paged_attention_gpu(*a, sm_scale=0.1, sliding_window=window, soft_cap=soft_cap))


def _sizes(shape: str, head_dim: int, pool: str):
    q, pages, _, md = _attention_args(shape, head_dim, pool)
    storage = POOLS[pool][1]
    return resolve_block_sizes(q.shape, pages.shape, q.dtype, md.kv_lens.shape[0], PAGES_PER_SEQ,
                               storage_dtype=None if storage is None else STORAGE[storage])


@functools.cache
def _compile(target: str, kind: str, *case, shared_memory_limit: int | None = None):
    """Compile one case for a described ``target`` GPU; returns the compiled executable."""
    from jaxserve.tools import gpu_targets

    with gpu_targets.described_mesh(target, shared_memory_limit=shared_memory_limit):
        if kind == "attention":
            shape, head_dim, pool = case
            return _attention(shape).lower(*_attention_args(shape, head_dim, pool)).compile()
        head_dim, pool = case
        dtype = STORAGE.get(pool, pool)
        sds = jax.ShapeDtypeStruct
        pages = sds((KV_HEADS, NUM_PAGES, PAGE_SIZE, head_dim), dtype)
        new = sds((512, KV_HEADS, head_dim), dtype)
        md = AttentionMetadata(sds((33,), jnp.int32), sds((32,), jnp.int32), sds((32, PAGES_PER_SEQ), jnp.int32),
                               sds((1,), jnp.int32))
        return jax.jit(write_kv_gpu, donate_argnums=(0, 1)).lower(pages, pages, new, new, md).compile()


@pytest.mark.parametrize("shape,head_dim,pool", ATTENTION_CASES)
def test_attention_compiles_for_h100(shape, head_dim, pool):
    sizes = _sizes(shape, head_dim, pool)
    rows = kernel_rows(sizes.block_q, GROUP)
    storage = POOLS[pool][1]
    assert gpu_shared_memory_estimate(rows, sizes.block_kv, padded_lanes(head_dim), sizes.num_stages,
                                      POOLS[pool][0], storage and STORAGE[storage]) <= GPU_SHARED_MEMORY_BYTES
    assert _compile("h100", "attention", shape, head_dim, pool) is not None


def test_padded_head_sizes_tile_alike():
    """The prefill head sizes left to 96's compile: the same lane padding and block sizes, so the same kernel."""
    assert len({padded_lanes(d) for d in PADDED_ALIKE}) == 1
    assert len({_sizes("prefill", d, "bfloat16") for d in PADDED_ALIKE}) == 1


@pytest.mark.parametrize("head_dim,pool", WRITE_CASES)
def test_write_kv_compiles_for_h100(head_dim, pool):
    assert _compile("h100", "write_kv", head_dim, pool) is not None
    if pool in STORAGE:  # an 8-bit pool's scales are pages of head_dim 1
        assert _compile("h100", "write_kv", 1, "float32") is not None


def test_a_prefill_compiles_for_h200():
    assert _compile("h200", "attention", "prefill", 256, "bfloat16") is not None


@pytest.mark.parametrize("shape,head_dim,pool", [("prefill", 256, "bfloat16"), ("mixed", 96, "fp8"),
                                                 ("decode", 24, "float32")])
def test_the_estimate_bounds_what_triton_allocates(shape, head_dim, pool):
    """A described H100 with 1 byte of shared memory refuses every kernel that uses any, saying how much it
    asked for: the block-size choice's estimate must be at least that."""
    with pytest.raises(Exception, match=r"requested \d+") as failure:
        _compile("h100", "attention", shape, head_dim, pool, shared_memory_limit=1)
    requested = int(re.search(r"requested (\d+)", str(failure.value)).group(1))
    sizes = _sizes(shape, head_dim, pool)
    storage = POOLS[pool][1]
    estimate = gpu_shared_memory_estimate(kernel_rows(sizes.block_q, GROUP), sizes.block_kv, padded_lanes(head_dim),
                                          sizes.num_stages, POOLS[pool][0], storage and STORAGE[storage])
    assert 0 < requested <= estimate <= GPU_SHARED_MEMORY_BYTES
