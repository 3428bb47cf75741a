"""The Pallas GPU (Triton) kernels (attention and KV write) against the reference: in interpret mode on CPU,
compiled for the device on a GPU (``JAX_PLATFORMS=cuda``, as scripts/gpu_check.py runs them)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_cache_update import write_kv_gpu
from pallas_kernels.ragged_paged_attention import AttentionMetadata, ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_attention.gpu import resolve_block_sizes

from attention_cases import (
    CONFIGS,
    DECODE,
    MIXED,
    PREFILL,
    assert_matches_reference,
    assert_write_matches,
    build_batch,
    device_args,
    new_rows,
    random_batch,
)

# block_q 2 makes multi-token tiles; 3 splits divide the key blocks unevenly and leave some splits empty.
SMALL_BLOCKS = dict(block_q=2, block_kv=16, num_splits=3)
INTERPRET = jax.default_backend() != "gpu"


@pytest.fixture
def described_h100():
    """Lower and compile for a described H100 (jax's CUDA plugin, no GPU); skipped without the plugin."""
    from jaxserve.tools import gpu_targets

    try:
        gpu_targets.devices("h100")
    except gpu_targets.NoGpuCompiler as e:
        pytest.skip(str(e))
    with gpu_targets.described_mesh("h100") as mesh:
        yield mesh


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


@pytest.mark.parametrize("head_dim", [16, 24, 64, 80, 96, 112, 128, 256])
def test_lowers_to_triton_at_every_head_size(head_dim, described_h100):
    """Pallas Triton lowering (for a described H100, no GPU needed) of both kernels at page_size 16 with the
    table's block sizes: Triton blocks must be powers of two, so a head_dim that is not one is padded."""
    sds = jax.ShapeDtypeStruct
    dtype = "bfloat16" if head_dim % 32 else "float32"
    for tokens, slots, window, soft_cap in ((8, 8, None, None), (256, 8, 64, 30.0)):
        md = AttentionMetadata.abstract(slots, 64)
        pages = sds((2, 512, 16, head_dim), dtype)
        fn = jax.jit(lambda *a: ragged_paged_attention_gpu(*a, sm_scale=0.088, sliding_window=window,
                                                           soft_cap=soft_cap))
        assert "triton" in fn.lower(sds((tokens, 8, head_dim), dtype), pages, pages, md).as_text()
    new = sds((256, 2, head_dim), dtype)
    assert "triton" in jax.jit(write_kv_gpu).lower(pages, pages, new, new, md).as_text()


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


# Head sizes the engine serves that are not powers of two (80, 96, 112; the tiny families' 24), and the powers
# of two the tables above do not cover (16, 256). The kernels pad the lane axis to a power of two and mask it.
HEAD_DIMS = [(16, "float32"), (24, "float32"), (24, "bfloat16"), (80, "bfloat16"), (96, "float32"),
             (96, "bfloat16"), (112, "float32"), (256, "bfloat16")]


@pytest.mark.parametrize("head_dim,dtype", HEAD_DIMS)
def test_attention_head_sizes(head_dim, dtype):
    rng = np.random.default_rng(head_dim)
    batch, _, _ = build_batch(rng, *MIXED, group=2, head_dim=head_dim, dtype=dtype)
    out = ragged_paged_attention_gpu(**device_args(batch), sm_scale=head_dim**-0.5, sliding_window=7,
                                     block_sizes=SMALL_BLOCKS, interpret=INTERPRET)
    assert out.shape == batch["q"].shape
    assert_matches_reference(out, batch, sm_scale=head_dim**-0.5, sliding_window=7)


@pytest.mark.parametrize("head_dim,dtype", [(24, "float32"), (96, "bfloat16"), (112, "bfloat16")])
def test_write_kv_head_sizes(head_dim, dtype):
    """Consecutive tokens of a prefill land in neighbouring rows of the flattened pool: a padded lane that
    aliased the next row would overwrite its new values (or the NaN poison of a row nobody writes)."""
    rng = np.random.default_rng(head_dim + 1)
    batch, _, _ = build_batch(rng, [3, 1, 0, 8, 7, 1], [3, 9, 4, 12, 15, 8], head_dim=head_dim, page_size=4,
                              dtype=dtype)
    new_k, new_v = new_rows(rng, batch)
    write = lambda *a: write_kv_gpu(*a, block_tokens=8, interpret=INTERPRET)  # noqa: E731
    assert len(assert_write_matches(write, batch, new_k, new_v)) >= 7


@pytest.mark.parametrize("head_dim,storage,dtype", [(24, "int8", "float32"), (80, "int8", "bfloat16"),
                                                    (96, "fp8", "bfloat16")])
def test_8_bit_pages_head_sizes(head_dim, storage, dtype):
    """Write 8-bit pages with the GPU write kernel (values of head_dim lanes, scales of 1), then attend."""
    from pallas_kernels.quantized_pages import STORAGE, QuantizedPages, write_quantized
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention, write_kv

    rng = np.random.default_rng(head_dim + 2)
    batch, _, _ = build_batch(rng, *MIXED, group=4, head_dim=head_dim, dtype=dtype)
    args = device_args(batch)
    shape = args["k_pages"].shape
    pages = [QuantizedPages.zeros(shape, STORAGE[storage], jnp.dtype(dtype)) for _ in range(2)]
    new_k, new_v = (jnp.asarray(a) for a in new_rows(rng, batch))
    write = lambda *a: write_kv_gpu(*a, block_tokens=8, interpret=INTERPRET)  # noqa: E731
    k_pages, v_pages = write_quantized(write, *pages, new_k, new_v, args["md"])
    want_k, want_v = write_quantized(write_kv, *pages, new_k, new_v, args["md"])
    for got, want in ((k_pages, want_k), (v_pages, want_v)):
        np.testing.assert_array_equal(np.asarray(got.values).view(np.uint8), np.asarray(want.values).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales))
    args.update(k_pages=k_pages, v_pages=v_pages)
    out = ragged_paged_attention_gpu(**args, sm_scale=head_dim**-0.5, block_sizes=SMALL_BLOCKS, interpret=INTERPRET)
    ref = ragged_paged_attention(**args, sm_scale=head_dim**-0.5)
    assert_matches_reference(out, batch, sm_scale=head_dim**-0.5, ref=ref)


@pytest.mark.parametrize("storage", [None, "int8"])
def test_pools_past_32_bit_offsets_are_refused_at_trace_time(storage):
    """An 8-bit pool of >= 2**31 elements per layer would be addressed with wrapping 32-bit offsets, and a bf16
    pool of >= 2**31 rows would overflow its int32 row index: both kernels raise a ValueError naming the sizes
    instead (abstract shapes: nothing is allocated); one page fewer is fine, and a bf16 pool may pass 2**31
    elements (its offsets are 64-bit past 4 GiB)."""
    from pallas_kernels.gpu_addressing import max_pool_pages
    from pallas_kernels.quantized_pages import QuantizedPages

    sds = jax.ShapeDtypeStruct
    heads, page_size, head_dim, slots = 8, 16, 128, 4
    md = AttentionMetadata.abstract(slots, 64)
    q = sds((slots, 4 * heads, head_dim), jnp.bfloat16)
    new = sds((slots, heads, head_dim), jnp.bfloat16)
    fits = max_pool_pages(heads, page_size, head_dim, 1 if storage else 2)
    if storage is None:
        assert heads * fits * page_size < 2**31 <= heads * (fits + 1) * page_size
        assert heads * fits * page_size * head_dim > 2**32
        refused = rf"num_pages={fits + 1} x page_size=16 x 8 KV heads = {2**31} rows.*limit {2**31 - 1} rows"
    else:
        assert heads * fits * page_size * head_dim < 2**31 <= heads * (fits + 1) * page_size * head_dim
        refused = (rf"num_pages={fits + 1} x page_size=16 x 8 KV heads x head_dim=128 = {2**31} elements.*"
                   rf"limit {2**31 - 1}")

    def pool(num_pages):
        shape = (heads, num_pages, page_size, head_dim)
        if storage is None:
            return sds(shape, jnp.bfloat16)
        return QuantizedPages(sds(shape, jnp.int8), sds(shape[:-1] + (1,), jnp.float32), jnp.bfloat16)

    attend = lambda k, v: ragged_paged_attention_gpu(q, k, v, md, sm_scale=0.1)  # noqa: E731
    write = lambda k, v: write_kv_gpu(k, v, new, new, md)  # noqa: E731
    for fn in (attend, write) if storage is None else (attend,):
        jax.eval_shape(fn, pool(fits), pool(fits))
        with pytest.raises(ValueError, match=refused):
            jax.eval_shape(fn, pool(fits + 1), pool(fits + 1))


def test_block_sizes_shrink_until_shared_memory_fits():
    """The table's entry is shrunk (block_kv, then the pipeline's stages, then block_q) until the estimate fits
    the budget; fields given explicitly are kept."""
    from pallas_kernels.ragged_paged_attention.block_sizes import GPU_SHARED_MEMORY_BYTES, gpu_shared_memory_estimate
    from pallas_kernels.ragged_paged_attention.gpu import kernel_rows, padded_lanes

    pages = (8, 4096, 16, 256)
    prefill = resolve_block_sizes((2048, 32, 256), pages, jnp.float32, num_slots=8, pages_per_seq=256)
    assert (prefill.block_q, prefill.block_kv, prefill.num_stages) == (32, 32, 1)  # from (32, 64, 2)
    assert gpu_shared_memory_estimate(kernel_rows(32, 4), 32, 256, 1, jnp.float32) <= GPU_SHARED_MEMORY_BYTES
    bf16 = resolve_block_sizes((2048, 32, 256), pages, jnp.bfloat16, num_slots=8, pages_per_seq=256)
    assert (bf16.block_kv, bf16.num_stages) == (64, 2)  # fits as the table has it
    a100 = resolve_block_sizes((2048, 32, 256), pages, jnp.float32, 8, 256, shared_memory_bytes=166_912)
    assert (a100.block_q, a100.block_kv, a100.num_stages) == (16, 16, 1)
    kept = resolve_block_sizes((2048, 32, 256), pages, jnp.float32, 8, 256, {"block_kv": 128})
    assert kept.block_kv == 128 and kept.num_stages == 1 and kept.block_q < 32
    for head_dim in (16, 24, 64, 80, 96, 112, 128, 256):
        for dtype, storage in ((jnp.bfloat16, None), (jnp.float32, None), (jnp.bfloat16, jnp.int8)):
            for tokens, slots in ((8, 8), (256, 256), (512, 32)):
                s = resolve_block_sizes((tokens, 32, head_dim), (8, 4096, 16, head_dim), dtype, slots, 64,
                                        storage_dtype=storage)
                estimate = gpu_shared_memory_estimate(kernel_rows(s.block_q, 4), s.block_kv, padded_lanes(head_dim),
                                                      s.num_stages, dtype, storage)
                assert estimate <= GPU_SHARED_MEMORY_BYTES, (head_dim, dtype, storage, tokens, s)
