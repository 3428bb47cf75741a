"""The Pallas TPU kernels (attention and KV write) against the reference, in interpret mode on CPU."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter

from attention_cases import (CONFIGS, DECODE, MIXED, PREFILL, assert_matches_reference, assert_write_matches,
                             build_batch, device_args, new_rows, random_batch)
from pallas_kernels.kv_cache_update import write_kv_tpu
from pallas_kernels.quantized_pages import STORAGE, QuantizedPages, quantize
from pallas_kernels.ragged_paged_attention import AttentionMetadata, ragged_paged_attention, ragged_paged_attention_tpu

SMALL_BLOCKS = dict(block_q=4, block_kv=8)


@pytest.mark.parametrize("lengths,group,head_dim,dtype,window,soft_cap", CONFIGS)
def test_attention_matches_reference(lengths, group, head_dim, dtype, window, soft_cap):
    rng = np.random.default_rng(group * 1000 + head_dim)
    batch, _, _ = build_batch(rng, *lengths, group=group, head_dim=head_dim, dtype=dtype)
    out = ragged_paged_attention_tpu(**device_args(batch), sm_scale=head_dim**-0.5, sliding_window=window,
                                     soft_cap=soft_cap, block_sizes=SMALL_BLOCKS, interpret=True)
    assert out.dtype == jnp.dtype(dtype)
    assert_matches_reference(out, batch, sm_scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)


@pytest.mark.parametrize("blocks", [
    dict(block_q=1, block_kv=4),  # block_q rounded up to whole sublanes; one page per KV block
    dict(block_q=8, block_kv=12),  # KV blocks of 3 pages, so blocks and windows straddle pages
    dict(block_q=4, block_kv=8, kv_heads_per_block=2),  # one DMA moves both KV heads
    None,  # the table's default for this shape (page_size 16)
])
def test_attention_block_sizes(blocks):
    rng = np.random.default_rng(7)
    page_size = 4 if blocks else 16
    batch, _, _ = build_batch(rng, *MIXED, num_kv_heads=2, group=1, head_dim=64, page_size=page_size)
    out = ragged_paged_attention_tpu(**device_args(batch), sm_scale=0.125, sliding_window=9, block_sizes=blocks,
                                     interpret=True)
    assert_matches_reference(out, batch, sm_scale=0.125, sliding_window=9)


def test_attention_random_batches():
    """Seeded random metadata at one padded shape (one compilation): lengths, zero-length entries, page edges,
    number of live sequences; group 8 with multi-token tiles."""
    rng = np.random.default_rng(11)
    for _ in range(6):
        batch = random_batch(rng, group=8)
        out = ragged_paged_attention_tpu(**device_args(batch), sm_scale=0.2, sliding_window=13,
                                         block_sizes=dict(block_q=2, block_kv=8), interpret=True)
        assert_matches_reference(out, batch, sm_scale=0.2, sliding_window=13)


def test_attention_under_tpu_simulator_has_no_races():
    """DMAs run only when waited on and unwritten VMEM is NaN, so a missing wait or a reused slot shows up as a
    wrong answer; out-of-range page reads raise; the race detector watches both cores."""
    rng = np.random.default_rng(3)
    batch, _, _ = build_batch(rng, [1, 3, 0, 1], [6, 9, 2, 13], group=2, head_dim=64)
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2, out_of_bounds_reads="raise")
    out = ragged_paged_attention_tpu(**device_args(batch), sm_scale=0.125, sliding_window=8, block_sizes=SMALL_BLOCKS,
                                     interpret=params)
    assert_matches_reference(out, batch, sm_scale=0.125, sliding_window=8)
    assert tpu_interpreter.races is not None and not tpu_interpreter.races.races_found


def test_race_detector_reports_a_race():
    """The assertion above can fail: two cores writing one HBM block is reported as a race."""
    def kernel(o_hbm, sem):
        src = jnp.full((8, 128), 1.0, jnp.float32)

        def body(scratch):
            scratch[...] = src
            copy = pltpu.make_async_copy(scratch, o_hbm, sem)
            copy.start()
            copy.wait()

        pl.run_scoped(body, pltpu.VMEM((8, 128), jnp.float32))

    racy = pl.pallas_call(
        kernel, grid=(2,), out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        out_specs=pl.BlockSpec(memory_space=pl.ANY), scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2))
    jax.block_until_ready(racy())
    assert tpu_interpreter.races.races_found


@pytest.mark.parametrize("dtype,page_size,lengths", [
    # Runs of every length 1..page_size, odd offsets (bf16 writes whole row pairs), a run ending on a page edge.
    ("bfloat16", 4, ([3, 1, 0, 8, 7, 1], [3, 9, 4, 12, 15, 8])),
    # Runs of 8+ rows at offsets 0, 1 and 3 mod 8 (staged congruent to their slots) and full 16-row pages.
    ("bfloat16", 16, ([13, 1, 20, 9, 2, 32], [16, 5, 37, 9, 40, 48])),
    ("float32", 16, ([13, 1, 20, 0, 2], [16, 5, 37, 9, 40])),
])
def test_write_kv_matches_reference_page_by_page(dtype, page_size, lengths):
    rng = np.random.default_rng(5)
    batch, _, _ = build_batch(rng, *lengths, page_size=page_size, dtype=dtype)
    new_k, new_v = new_rows(rng, batch)
    touched = assert_write_matches(lambda *a: write_kv_tpu(*a, runs_per_block=4, interpret=True), batch, new_k, new_v)
    assert len(touched) >= 5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_kv_fewer_rows_than_a_page(dtype):
    """A step with fewer rows than a page (one decode row, page_size 16): no copy longer than what was staged is
    traced (the smallest decode bucket used to fail to trace at warm-up)."""
    rng = np.random.default_rng(8)
    batch, _, _ = build_batch(rng, [1], [9], page_size=16, dtype=dtype, pad_tokens=0, pad_slots=0)
    new_k, new_v = new_rows(rng, batch)
    assert new_k.shape[0] == 1
    assert_write_matches(lambda *a: write_kv_tpu(*a, interpret=True), batch, new_k, new_v)


def test_write_kv_under_tpu_simulator_has_no_races():
    rng = np.random.default_rng(6)
    batch, _, _ = build_batch(rng, [2, 11, 1], [6, 20, 4], page_size=16, dtype="bfloat16")
    new_k, new_v = new_rows(rng, batch)
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2, out_of_bounds_reads="raise")
    assert_write_matches(lambda *a: write_kv_tpu(*a, runs_per_block=2, interpret=params), batch, new_k, new_v)
    assert tpu_interpreter.races is not None and not tpu_interpreter.races.races_found


def test_shape_and_dtype_checks_at_trace_time():
    rng = np.random.default_rng(10)
    args = device_args(build_batch(rng, [2, 1], [6, 3])[0])
    md = dataclasses.replace(args["md"], kv_lens=args["md"].kv_lens.astype(jnp.int16))
    with pytest.raises(ValueError, match="kv_lens must be int32"):
        ragged_paged_attention_tpu(**dict(args, md=md), sm_scale=1.0)
    with pytest.raises(ValueError, match="block_kv"):
        ragged_paged_attention_tpu(**args, sm_scale=1.0, block_sizes=dict(block_kv=6))


@pytest.mark.parametrize("window,soft_cap", [(None, None), (64, 30.0)])
def test_lowers_to_mosaic_at_serving_shapes(window, soft_cap):
    """Mosaic lowering (no TPU needed) of bf16, head_dim 128, page_size 16 with the table's block sizes."""
    sds = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    for tokens, slots in ((8, 8), (256, 8)):
        md = AttentionMetadata.abstract(slots, 64)
        shapes = (sds((tokens, 32, 128), bf16), sds((8, 512, 16, 128), bf16), sds((8, 512, 16, 128), bf16), md)
        fn = jax.jit(lambda *a: ragged_paged_attention_tpu(*a, sm_scale=0.088, sliding_window=window,
                                                           soft_cap=soft_cap))
        assert "tpu_custom_call" in fn.trace(*shapes).lower(lowering_platforms=("tpu",)).as_text()
    write_shapes = (shapes[1], shapes[2], sds((256, 8, 128), bf16), sds((256, 8, 128), bf16), shapes[3])
    assert "tpu_custom_call" in jax.jit(write_kv_tpu).trace(*write_shapes).lower(
        lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize("dtype,kv_cache_dtype", [("bfloat16", "auto"), ("float32", "auto"), ("bfloat16", "int8"),
                                                  ("bfloat16", "fp8")])
def test_compiles_with_mosaic_for_v5e(dtype, kv_cache_dtype):
    """The real Mosaic compiler (libtpu, compile-only: no TPU needed) accepts both kernels, and attention over
    8-bit pages. Skipped without libtpu; scripts/compile_tpu_kernels.py covers more generations and shapes."""
    pytest.importorskip("libtpu")
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=SingleDeviceSharding(device))
    pool = sds((8, 256, 16, 128), dtype)
    if kv_cache_dtype != "auto":
        pool = QuantizedPages(sds(pool.shape, STORAGE[kv_cache_dtype]), sds((8, 256, 16, 1), jnp.float32),
                              jnp.dtype(dtype))
    for tokens, slots in ((8, 8), (256, 8)):
        md = AttentionMetadata(sds((slots + 1,), jnp.int32), sds((slots,), jnp.int32), sds((slots, 32), jnp.int32),
                               sds((1,), jnp.int32))
        attend = jax.jit(lambda *a: ragged_paged_attention_tpu(*a, sm_scale=0.088, sliding_window=128, soft_cap=30.0))
        attend.trace(sds((tokens, 32, 128), dtype), pool, pool, md).lower().compile()
        if kv_cache_dtype == "auto":  # 8-bit rows are written by the reference scatter (jaxserve.models.attention)
            new = sds((tokens, 8, 128), dtype)
            jax.jit(write_kv_tpu).trace(pool, pool, new, new, md).lower().compile()
    if kv_cache_dtype == "int8":  # Mosaic refuses 48-row int8 pages at offsets of 48: refused first, clearly
        pool = QuantizedPages(sds((8, 64, 48, 128), jnp.int8), sds((8, 64, 48, 1), jnp.float32), jnp.dtype(dtype))
        with pytest.raises(ValueError, match="page_size=48: the Pallas TPU kernel reads 8-bit KV pages whose size"):
            attend.trace(sds((8, 32, 128), dtype), pool, pool, md)


def quantized_args(batch, storage):
    """The batch's pools written as 8-bit pages: values and per-token scales of every slot, so pages and slots
    no sequence uses (NaN in the batch) hold NaN scales, and NaN or garbage values."""
    args = device_args(batch)
    for name in ("k_pages", "v_pages"):
        values, scales = quantize(args[name], STORAGE[storage])
        unused = jnp.isnan(args[name]).any(axis=-1, keepdims=True)
        args[name] = QuantizedPages(values, jnp.where(unused, jnp.nan, scales), args["q"].dtype)
    assert np.isnan(np.asarray(args["k_pages"].scales)).any()
    return args


# (lengths, storage, dtype, group, head_dim, window, soft_cap, block sizes): decode, prefill and mixed batches;
# int8 and both fp8 formats; fp32 and bf16 queries; windows, soft caps, a DMA of two heads' pages and scales.
QUANTIZED_CASES = [
    (DECODE, "int8", "float32", 1, 64, None, None, dict(block_q=1, block_kv=8)),
    (PREFILL, "fp8_e5m2", "float32", 2, 64, None, 2.5, SMALL_BLOCKS),
    (MIXED, "fp8", "bfloat16", 2, 64, 7, None, SMALL_BLOCKS),
    (MIXED, "int8", "bfloat16", 4, 128, 5, 3.0, dict(block_q=4, block_kv=12, kv_heads_per_block=2)),
]


@pytest.mark.parametrize("lengths,storage,dtype,group,head_dim,window,soft_cap,blocks", QUANTIZED_CASES)
def test_attention_reads_8_bit_pages_like_the_reference(lengths, storage, dtype, group, head_dim, window, soft_cap,
                                                       blocks):
    """The kernel dequantizes the 8-bit pages it DMAs; the reference dequantizes what it gathers."""
    rng = np.random.default_rng(17)
    batch, _, _ = build_batch(rng, *lengths, group=group, head_dim=head_dim, dtype=dtype)
    args = quantized_args(batch, storage)
    kw = dict(sm_scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)
    out = ragged_paged_attention_tpu(**args, block_sizes=blocks, interpret=True, **kw)
    assert out.dtype == jnp.dtype(dtype)
    assert_matches_reference(out, batch, ref=ragged_paged_attention(**args, **kw), **kw)


def test_8_bit_pages_under_tpu_simulator_have_no_races():
    """The scale DMAs beside the page DMAs: every one waited on, none out of bounds, no race on two cores."""
    rng = np.random.default_rng(4)
    batch, _, _ = build_batch(rng, [1, 3, 0, 1], [6, 9, 2, 13], group=2, head_dim=64)
    args = quantized_args(batch, "int8")
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2, out_of_bounds_reads="raise")
    out = ragged_paged_attention_tpu(**args, sm_scale=0.125, sliding_window=8, block_sizes=SMALL_BLOCKS,
                                     interpret=params)
    ref = ragged_paged_attention(**args, sm_scale=0.125, sliding_window=8)
    assert_matches_reference(out, batch, sm_scale=0.125, sliding_window=8, ref=ref)
    assert tpu_interpreter.races is not None and not tpu_interpreter.races.races_found


def test_8_bit_pages_need_lane_aligned_kv_blocks_when_compiled():
    rng = np.random.default_rng(10)
    args = quantized_args(build_batch(rng, [2, 1], [6, 3])[0], "int8")
    with pytest.raises(ValueError, match="block_kv=8 must be a multiple of 128 for 8-bit KV pages"):
        ragged_paged_attention_tpu(**args, sm_scale=1.0, block_sizes=dict(block_kv=8))
