"""The native CPU attention rows (pallas_kernels/ragged_paged_attention/cpu_native.cc) against the reference, and
its fallback to the pure-JAX walk."""

import concurrent.futures
import ctypes
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import (CONFIGS, DECODE, MIXED, PREFILL, assert_matches_reference, build_batch, device_args,
                             random_lengths, reference_attention)

from pallas_kernels.quantized_pages import STORAGE, QuantizedPages, quantize
from pallas_kernels.ragged_paged_attention import native, ragged_paged_attention_rows


def rows_program(batch, **kw):
    """The compiled rows path of ``batch`` and whether it calls the native kernel."""
    fn = jax.jit(lambda q, k_pages, v_pages, md: ragged_paged_attention_rows(q, k_pages, v_pages, md, **kw))
    args = device_args(batch)
    return fn(**args), native.TARGET in fn.lower(**args).as_text()


@pytest.mark.parametrize("lengths, group, head_dim, dtype, window, soft_cap", CONFIGS)
@pytest.mark.quick
def test_native_rows_match_reference(lengths, group, head_dim, dtype, window, soft_cap):
    """Decode, prompt and mixed batches; GQA groups 1 to 8, fp32 and bf16 pages, windows, soft caps; NaN in every
    page and slot no row may read, NaN padding rows (which must come back as zeros)."""
    batch, _, _ = build_batch(np.random.default_rng(1), *lengths, group=group, head_dim=head_dim, dtype=dtype)
    out, called = rows_program(batch, sm_scale=0.2, sliding_window=window, soft_cap=soft_cap)
    assert called
    assert_matches_reference(out, batch, sm_scale=0.2, sliding_window=window, soft_cap=soft_cap)


@pytest.mark.parametrize("lengths, storage, group, window, as_bytes", [
    (DECODE, "int8", 2, None, False), (MIXED, "fp8_e4m3", 4, 5, True), (PREFILL, "fp8_e5m2", 1, None, False)])
def test_native_rows_read_8_bit_pages(lengths, storage, group, window, as_bytes):
    """8-bit pages (values + one f32 scale per token and KV head), as the engine's int8, fp8 (e4m3) and fp8_e5m2
    KV caches store them (fp8 as its own dtype, or as bytes: the CPU pool's form): the kernel widens them itself
    and matches the reference, which dequantizes what it gathers. Every page and slot no row may read has NaN
    scales (and NaN values where the format has one)."""
    batch, _, _ = build_batch(np.random.default_rng(8), *lengths, group=group, head_dim=64)
    args = device_args(batch)
    for name in ("k_pages", "v_pages"):
        pages = args[name]
        values, scales = quantize(jnp.nan_to_num(pages, nan=0.0), STORAGE[storage])
        poisoned = jnp.isnan(pages[..., :1])
        if jnp.dtype(STORAGE[storage]) != jnp.int8:
            values = jnp.where(jnp.isnan(pages), jnp.nan, values.astype(jnp.float32)).astype(values.dtype)
        args[name] = QuantizedPages(values, jnp.where(poisoned, jnp.nan, scales))
        if as_bytes:
            args[name] = QuantizedPages(jax.lax.bitcast_convert_type(values, jnp.uint8), args[name].scales,
                                        fp8_format=values.dtype)
    kw = dict(sm_scale=0.2, sliding_window=window)
    fn = jax.jit(lambda q, k_pages, v_pages, md: ragged_paged_attention_rows(q, k_pages, v_pages, md, **kw))
    assert native.TARGET in fn.lower(**args).as_text()
    assert_matches_reference(fn(**args), batch, **kw, ref=reference_attention(**args, **kw))


@pytest.mark.parametrize("storage", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.quick
def test_kernel_widens_every_8_bit_code_exactly(storage):
    """One key whose value row holds all 256 codes of the format (NaN and infinity included) and a scale of 1: a
    row that sees only it returns that row widened, which must equal ml_dtypes' value of every code bit for bit."""
    dtype = STORAGE[storage]
    codes = np.arange(256, dtype=np.uint8).view(dtype).reshape(1, 1, 1, 256)
    k = QuantizedPages(jnp.zeros(codes.shape, dtype), jnp.ones((1, 1, 1, 1), jnp.float32))
    v = QuantizedPages(jnp.asarray(codes), jnp.ones((1, 1, 1, 1), jnp.float32))
    zero = np.zeros(1, np.int32)
    out, _ = jax.jit(lambda q, k, v: native.attend(q, k, v, zero.reshape(1, 1), zero, zero, zero, sm_scale=1.0,
                                                   soft_cap=None))(jnp.ones((1, 1, 256), jnp.float32), k, v)
    np.testing.assert_array_equal(np.asarray(out).ravel(), codes.ravel().astype(np.float32))


def test_native_rows_many_lengths():
    """Sixty decode rows of lengths 1 to 64 keys (page size 8), every row's pages shuffled across the pool."""
    rng = np.random.default_rng(2)
    _, kv_lens = random_lengths(rng, 60, page_size=8, max_kv=64)
    batch, _, _ = build_batch(rng, [1] * 60, kv_lens, page_size=8, head_dim=32)
    out, called = rows_program(batch, sm_scale=0.3, sliding_window=None, soft_cap=None)
    assert called
    assert_matches_reference(out, batch, sm_scale=0.3)


@pytest.mark.parametrize("page_size, head_dim, dtype, window, soft_cap", [
    (16, 64, "float32", None, None),
    (32, 128, "bfloat16", 21, None),
    (16, 64, "float32", 13, 4.0),
])
def test_prompt_rows_in_tiles_match_reference(page_size, head_dim, dtype, window, soft_cap):
    """Prompt chunks longer than a tile of rows (8), over cached context and from nothing, beside decode rows, with
    pages of 16 and 32 keys (blocks of 16 keys, a page's unused tail NaN): each row keeps its own visible range
    and softmax inside a tile (a window starts rows at different keys). Then the same rows split over two threads,
    whose boundary falls inside a tile: the same floats."""
    q_lens, kv_lens = [20, 1, 9, 0, 1, 37], [20, 45, 70, 16, 33, 50]
    batch, _, _ = build_batch(np.random.default_rng(11), q_lens, kv_lens, num_kv_heads=3, group=3, head_dim=head_dim,
                              page_size=page_size, dtype=dtype)
    out, called = rows_program(batch, sm_scale=0.2, sliding_window=window, soft_cap=soft_cap)
    assert called
    assert_matches_reference(out, batch, sm_scale=0.2, sliding_window=window, soft_cap=soft_cap)

    args = device_args(batch)
    md, rows = args["md"], sum(q_lens)
    row_seq = np.repeat(np.arange(len(q_lens), dtype=np.int32), q_lens)
    last = np.concatenate([np.arange(kv - q, kv, dtype=np.int32) for q, kv in zip(q_lens, kv_lens)])

    def run(threads):  # 68 rows in 8 chunks (two threads): chunk edges inside the 20- and 37-row chunks' tiles
        fn = jax.jit(lambda q, k, v: native.attend(q, k, v, md.page_indices, row_seq, np.zeros(rows, np.int32), last,
                                                   sm_scale=0.2, soft_cap=None, threads=threads))
        return [np.asarray(x) for x in fn(args["q"][:rows], args["k_pages"], args["v_pages"])]

    one, two = run(1), run(2)
    np.testing.assert_array_equal(one[0], two[0])
    np.testing.assert_array_equal(one[1], two[1])


def test_rows_split_over_threads_give_the_same_result():
    """The kernel's rows split over XLA's intra-op pool (``threads=2``, and 0: the whole pool, the default the
    engine uses): the same floats as one thread."""
    batch, _, _ = build_batch(np.random.default_rng(5), [1] * 24, list(range(3, 51, 2)), head_dim=32)
    args = device_args(batch)
    md = args["md"]
    rows = np.arange(24, dtype=np.int32)
    last = np.asarray(md.kv_lens[:24]) - 1

    def run(threads):
        fn = jax.jit(lambda q, k, v: native.attend(q, k, v, md.page_indices, rows, np.zeros(24, np.int32), last,
                                                   sm_scale=0.3, soft_cap=None, threads=threads))
        return [np.asarray(x) for x in fn(args["q"][:24], args["k_pages"], args["v_pages"])]

    one, two, pool = run(1), run(2), run(0)
    for other in (two, pool):
        np.testing.assert_array_equal(one[0], other[0])
        np.testing.assert_array_equal(one[1], other[1])
    assert_matches_reference(np.concatenate([one[0], np.zeros_like(args["q"][24:])]), batch, sm_scale=0.3)


@pytest.mark.quick
def test_rows_that_see_nothing_are_zero():
    """``last < first`` inside one page, at a page edge, and ``last = -1``: zeros and a log-sum-exp of -inf, and
    no read of the (NaN) pages."""
    batch, _, _ = build_batch(np.random.default_rng(6), [1, 1, 1], [9, 9, 9])
    args = device_args(batch)
    fn = jax.jit(lambda q, k, v, tables: native.attend(q, k, v, tables, np.array([0, 1, 2], np.int32),
                                                         np.array([6, 4, 0], np.int32), np.array([5, 3, -1], np.int32),
                                                         sm_scale=0.3, soft_cap=None))
    out, lse = fn(args["q"][:3], args["k_pages"], args["v_pages"], args["md"].page_indices)
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    assert np.all(np.isneginf(np.asarray(lse)))


def test_switch_off_runs_the_walk(monkeypatch):
    batch, _, _ = build_batch(np.random.default_rng(3), *CONFIGS[0][0])
    monkeypatch.setenv(native.SWITCH, "0")
    out, called = rows_program(batch, sm_scale=0.2)
    assert not called
    assert_matches_reference(out, batch, sm_scale=0.2)


@pytest.mark.parametrize("compiler, why", [("/nonexistent/c++", "no C++ compiler"), ("false", "false")])
def test_build_failure_falls_back_with_one_log_line(compiler, why, tmp_path, monkeypatch, caplog):
    """No compiler, or one that fails: the walk runs and one warning says why; nothing raises."""
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", compiler)
    native.available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native.__name__):
            assert not native.available()
            batch, _, _ = build_batch(np.random.default_rng(3), *CONFIGS[0][0])
            out, called = rows_program(batch, sm_scale=0.2)
        assert not called
        assert_matches_reference(out, batch, sm_scale=0.2)
        lines = [r.getMessage() for r in caplog.records if r.name == native.__name__]
        assert len(lines) == 1 and "native CPU attention unavailable" in lines[0] and why in lines[0]
        assert not list((tmp_path / "native").glob("*.so"))
    finally:
        native.available.cache_clear()  # the next caller builds (or finds) the real library again


def test_concurrent_builds_share_one_library(tmp_path):
    """Two builds racing into one empty cache folder: both get the same complete file, and no temporary is left."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: native.build(tmp_path, os.environ.get("CXX", "g++")), range(2)))
    assert paths[0] == paths[1] and paths[0].parent == tmp_path
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]
    ctypes.cdll.LoadLibrary(str(paths[0])).JaxserveRowsAttention  # noqa: B018 (a complete library has the symbol)


@pytest.mark.quick
def test_out_of_range_page_is_an_error_not_a_read():
    """A page index outside the pool on a row's visible keys fails the step instead of reading foreign memory."""
    batch, _, _ = build_batch(np.random.default_rng(4), [1], [6])
    batch["page_indices"][0, 1] = batch["k_pages"].shape[1] + 5
    with pytest.raises(Exception, match="page index out of range"):
        jax.block_until_ready(rows_program(batch, sm_scale=0.2)[0])
