"""The native CPU dense product (``pallas_kernels.matmul``) against its reference, ``jnp.dot`` in f32: every
row count of its register blocks, widths that are not whole panels, bf16 and f32 operands, transposed weights,
one thread and the pool; the programs that call it (a CPU step on one device) and those that must not (another
platform, a mesh, the switch off)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.executor.batch import StepKind
from jaxserve.models import layers
from pallas_kernels.matmul import dense, dense_reference, native
from tiny import build_tiny_model, train_tokenizer

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler for the native kernel")

DTYPES = (jnp.float32, jnp.bfloat16)


@pytest.mark.parametrize("m, k, n", [(1, 5, 3), (8, 64, 32), (9, 17, 33), (13, 100, 70), (48, 576, 192), (3, 1, 40),
                                     (9, 4096, 100)])  # the last: two packing passes, one thread
@pytest.mark.parametrize("transposed", [False, True])
def test_dense_matches_the_reference(m, k, n, transposed):
    rng = np.random.default_rng(m * 1000 + k + n)
    for x_dtype in DTYPES:
        for w_dtype in DTYPES:
            x = jnp.asarray(rng.standard_normal((m, k)), x_dtype)
            w = jnp.asarray(rng.standard_normal((n, k) if transposed else (k, n)), w_dtype)
            want = np.asarray(dense_reference(x, w, transposed=transposed))
            for threads in (1, 0):
                got = jax.jit(lambda x, w, t=threads: dense(x, w, transposed=transposed, threads=t))(x, w)
                assert got.dtype == jnp.float32 and got.shape == (m, n)
                # f32 sums of k products of exactly widened operands: only the summation order differs
                np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_each_output_is_the_same_sum_whatever_the_threads():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((37, 300)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((300, 1000)), jnp.float32)
    one = jax.jit(lambda x, w: dense(x, w, threads=1))(x, w)
    pool = jax.jit(lambda x, w: dense(x, w))(x, w)
    assert np.array_equal(np.asarray(one), np.asarray(pool))
    # a transposed copy of the weight gives the same bits: the same products, in the same order
    turned = jax.jit(lambda x, w: dense(x, w, transposed=True))(x, jnp.asarray(np.asarray(w).T.copy()))
    assert np.array_equal(np.asarray(one), np.asarray(turned))


def test_programs_for_a_cpu_call_the_kernel_and_others_do_not():
    x, w = jnp.ones((4, 64)), jnp.ones((64, 32))
    traced = jax.jit(lambda x, w: dense(x, w)).trace(x, w)
    assert native.TARGET in traced.lower().as_text()
    assert native.TARGET not in traced.lower(lowering_platforms=("tpu",)).as_text()
    bad = jnp.ones((5, 63))
    with pytest.raises(ValueError, match="disagree on k"):
        dense(bad, w)


def test_matmul_f32_takes_the_kernel_only_inside_native_products(monkeypatch):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((6, 40)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((40, 24)), jnp.float32)

    def program(on, transposed=False, weight=w):
        def f(x, w):
            with layers.native_products(on):
                return layers.matmul_f32(x, w, transposed=transposed)
        return jax.jit(f).lower(x, weight).as_text()

    assert native.TARGET in program(True) and native.TARGET not in program(False)
    # a transposed weight: bf16 through the kernel, f32 through XLA's product (as fast there)
    assert native.TARGET in program(True, transposed=True, weight=w.T.astype(jnp.bfloat16))
    assert native.TARGET not in program(True, transposed=True, weight=w.T)
    wb = w.T.astype(jnp.bfloat16)
    with layers.native_products(True):
        on = layers.matmul_f32(x, wb, transposed=True)
    off = layers.matmul_f32(x, wb, transposed=True)
    np.testing.assert_allclose(np.asarray(on), np.asarray(off), rtol=1e-5, atol=1e-5)
    # 8-bit weights keep their own product
    scale = jnp.ones((24,), jnp.float32)
    with layers.native_products(True):
        text = jax.jit(lambda x: layers.matmul_f32(x, w.astype(jnp.int8), scale)).lower(x).as_text()
    assert native.TARGET not in text
    monkeypatch.setenv(native.SWITCH, "0")
    assert native.TARGET not in program(True)


def test_without_a_compiler_the_product_is_xlas(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    native.available.cache_clear()
    try:
        assert not native.available()
        x, w = jnp.ones((3, 8)), jnp.ones((8, 5))
        assert native.TARGET not in jax.jit(lambda x, w: dense(x, w)).lower(x, w).as_text()
        np.testing.assert_allclose(np.asarray(dense(x, w)), np.full((3, 5), 8.0))
    finally:
        native.available.cache_clear()  # the next caller builds (or finds) the real library again


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), tokenizer=train_tokenizer())


def test_an_engines_cpu_steps_call_the_kernel_on_one_device_only(model_dir):
    def step_text(**mesh) -> str:
        engine = Engine(EngineConfig(model=str(model_dir), page_size=4, num_pages=16, max_model_len=32, max_num_seqs=2,
                                     max_num_batched_tokens=16, warmup=False, compilation_cache_dir=None, **mesh))
        ex = engine.executor
        return ex.runner.lower(StepKind.DECODE, ex.padding_batch(True, 2, 2, ex.shapes.step_pages(True, 1))).as_text()

    assert native.TARGET in step_text()
    assert native.TARGET not in step_text(mesh="tensor=2", num_devices=2)
