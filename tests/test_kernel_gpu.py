"""The Pallas GPU (Triton) kernels (attention and KV write) against the reference: in interpret mode on CPU,
compiled for the device on a GPU (``JAX_PLATFORMS=cuda``, as scripts/gpu_check.py runs them)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import (CONFIGS, DECODE, MIXED, PREFILL, assert_matches_reference, assert_write_matches,
                             build_batch, device_args, new_rows, random_batch)
from pallas_kernels.kv_cache_update import write_kv_gpu
from pallas_kernels.ragged_paged_attention import AttentionMetadata, ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_attention.gpu import resolve_block_sizes

# block_q 2 makes multi-token tiles; 3 splits divide the key blocks unevenly and leave some splits empty.
SMALL_BLOCKS = dict(block_q=2, block_kv=16, num_splits=3)
INTERPRET = jax.default_backend() != "gpu"


@pytest.mark.parametrize("lengths,group,head_dim,dtype,window,soft_cap", CONFIGS)
def test_attention_matches_reference(lengths, group, head_dim, dtype, window, soft_cap):
    rng = np.random.default_rng(group * 1000 + head_dim)
    batch, _, _ = build_batch(rng, *lengths, group=group, head_dim=head_dim, dtype=dtype)
    out = ragged_paged_attention_gpu(**device_args(batch), sm_scale=head_dim**-0.5, sliding_window=window,
                                     soft_cap=soft_cap, block_sizes=SMALL_BLOCKS, interpret=INTERPRET)
    assert out.dtype == jnp.dtype(dtype)
    assert_matches_reference(out, batch, sm_scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)


@pytest.mark.parametrize("blocks", [
    dict(block_q=1, block_kv=16, num_splits=1),  # no split: the kernel normalises and writes the output itself
    dict(block_q=3, block_kv=32, num_splits=2),  # tile rows not a power of two; blocks of 8 pages
    dict(block_q=8, block_kv=16, num_splits=8),  # more splits than most sequences have blocks
    None,  # the table's default for this shape (page_size 16)
])
def test_attention_block_sizes(blocks):
    rng = np.random.default_rng(7)
    page_size = 4 if blocks else 16
    batch, _, _ = build_batch(rng, *MIXED, num_kv_heads=2, group=1, head_dim=64, page_size=page_size)
    out = ragged_paged_attention_gpu(**device_args(batch), sm_scale=0.125, sliding_window=9, block_sizes=blocks,
                                     interpret=INTERPRET)
    assert_matches_reference(out, batch, sm_scale=0.125, sliding_window=9)


def test_attention_random_batches():
    """Seeded random metadata at one padded shape (one compilation): lengths, zero-length entries, page edges,
    number of live sequences; group 8 with multi-token tiles and split KV."""
    rng = np.random.default_rng(11)
    for _ in range(6):
        batch = random_batch(rng, group=8)
        out = ragged_paged_attention_gpu(**device_args(batch), sm_scale=0.2, sliding_window=13,
                                         block_sizes=dict(block_q=2, block_kv=16, num_splits=2), interpret=INTERPRET)
        assert_matches_reference(out, batch, sm_scale=0.2, sliding_window=13)


def test_decode_splits_long_contexts_and_prefill_does_not():
    q = (8, 32, 128)
    pages = (8, 4096, 16, 128)
    decode = resolve_block_sizes(q, pages, jnp.bfloat16, num_slots=8, pages_per_seq=256)
    assert decode.block_q == 1 and decode.num_splits >= 4
    prefill = resolve_block_sizes((2048, 32, 128), pages, jnp.bfloat16, num_slots=8, pages_per_seq=256)
    assert prefill.num_splits == 1
    big_batch = resolve_block_sizes((512, 32, 128), pages, jnp.bfloat16, num_slots=512, pages_per_seq=256)
    assert big_batch.num_splits == 1


def test_write_kv_matches_reference_page_by_page():
    rng = np.random.default_rng(5)
    batch, _, _ = build_batch(rng, [3, 1, 0, 8, 7, 1], [3, 9, 4, 12, 15, 8], page_size=4, dtype="bfloat16")
    new_k, new_v = new_rows(rng, batch)
    write = lambda *a: write_kv_gpu(*a, block_tokens=8, interpret=INTERPRET)  # noqa: E731
    touched = assert_write_matches(write, batch, new_k, new_v)
    assert len(touched) >= 7


def test_write_then_attend_decode_step():
    """One decode step as the engine runs it: write the new rows, then attend over the updated pages."""
    rng = np.random.default_rng(12)
    batch, _, _ = build_batch(rng, *DECODE, group=4, head_dim=64)
    new_k, new_v = new_rows(rng, batch)
    args = device_args(batch)
    k_pages, v_pages = write_kv_gpu(args["k_pages"], args["v_pages"], new_k, new_v, args["md"], interpret=INTERPRET)
    stepped = dict(batch, k_pages=np.asarray(k_pages), v_pages=np.asarray(v_pages))
    out = ragged_paged_attention_gpu(**device_args(stepped), sm_scale=0.125, interpret=INTERPRET)
    assert_matches_reference(out, stepped, sm_scale=0.125)


def test_shape_and_block_checks_at_trace_time():
    rng = np.random.default_rng(10)
    args = device_args(build_batch(rng, [2, 1], [6, 3])[0])
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        ragged_paged_attention_gpu(**dict(args, q=args["q"][:, :3]), sm_scale=1.0)
    with pytest.raises(ValueError, match="power of two"):
        ragged_paged_attention_gpu(**args, sm_scale=1.0, block_sizes=dict(block_kv=24))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_lowers_to_triton_at_serving_shapes(dtype):
    """Pallas Triton lowering (no GPU needed) of head_dim 128, page_size 16 with the table's block sizes."""
    sds = jax.ShapeDtypeStruct
    i32 = jnp.int32
    for tokens, slots, window, soft_cap in ((8, 8, None, None), (256, 8, 64, 30.0)):
        md = AttentionMetadata(sds((slots + 1,), i32), sds((slots,), i32), sds((slots, 64), i32), sds((1,), i32))
        shapes = (sds((tokens, 32, 128), dtype), sds((8, 512, 16, 128), dtype), sds((8, 512, 16, 128), dtype), md)
        fn = jax.jit(lambda *a: ragged_paged_attention_gpu(*a, sm_scale=0.088, sliding_window=window,
                                                           soft_cap=soft_cap))
        assert "triton" in fn.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    write_shapes = (shapes[1], shapes[2], sds((256, 8, 128), dtype), sds((256, 8, 128), dtype), shapes[3])
    assert "triton" in jax.jit(write_kv_gpu).trace(*write_shapes).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("lengths,storage,dtype", [(DECODE, "int8", "float32"), (MIXED, "fp8", "bfloat16"),
                                                    (PREFILL, "fp8_e5m2", "float32")])
def test_attention_reads_8_bit_pages_like_the_reference(lengths, storage, dtype):
    """8-bit pages (values + per-token scales, NaN in every page and slot no sequence uses): the kernel
    dequantizes what it loads; the reference dequantizes what it gathers."""
    from pallas_kernels.quantized_pages import STORAGE, QuantizedPages, quantize

    rng = np.random.default_rng(7)
    batch, _, _ = build_batch(rng, *lengths, group=2, head_dim=64, dtype=dtype)
    args = device_args(batch)
    for name in ("k_pages", "v_pages"):
        values, scales = quantize(args[name], STORAGE[storage])
        args[name] = QuantizedPages(values, scales, jnp.dtype(dtype))
    out = ragged_paged_attention_gpu(**args, sm_scale=0.125, sliding_window=7, block_sizes=SMALL_BLOCKS,
                                     interpret=INTERPRET)
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    ref = ragged_paged_attention(**args, sm_scale=0.125, sliding_window=7)
    assert_matches_reference(out, batch, sm_scale=0.125, sliding_window=7, ref=ref)
