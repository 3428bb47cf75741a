"""The native CPU dense product (``cpu_native.cc``): built, loaded and registered with XLA at first use.

XLA:CPU runs a product of a few dozen rows, a decode step's, on one thread: on a 2-core AVX-512 machine
~100 GFLOP/s for SmolLM-135M's MLP at 48 rows, where a blocked kernel on both cores reaches ~150, and its tied
LM head (a transposed [vocab, hidden] weight) at ~65 (docs/benchmarks/cpu-offline.md). The kernel splits the product's
columns over the calling thread and XLA's intra-op pool, packs each 32-column panel of the weight (bf16 widened,
a transposed weight turned) into a buffer that stays in cache while every row goes through it, and accumulates
in f32, one fused multiply-add per term in k order: the sum a plain loop computes, whatever the threads.

It is built for the machine it runs on (``pallas_kernels.native_build``); with AVX-512 the inner block is
written with its intrinsics, elsewhere the compiler vectorizes a plain loop. Where it cannot be built or
``JAXSERVE_CPU_NATIVE_DENSE=0``, ``available()`` is False (one log line) and callers use ``jnp.dot``.
An executable that calls the target (a deserialized one included) needs it registered in its process first:
call ``available()`` before loading one.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native_build

logger = logging.getLogger(__name__)


SOURCE = Path(__file__).with_name("cpu_native.cc")
SWITCH = "JAXSERVE_CPU_NATIVE_DENSE"  # "0" turns the native path off
TARGET = "jaxserve_dense"
_SYMBOL = "JaxserveDense"
WEIGHT_DTYPES = (jnp.float32, jnp.bfloat16)


def enabled() -> bool:
    """Whether the native path is wanted (``JAXSERVE_CPU_NATIVE_DENSE`` is not "0")."""
    return os.environ.get(SWITCH, "1") != "0"


def build(directory: Path, compiler: str) -> Path:
    """The shared library built from ``SOURCE`` (see ``native_build.build``)."""
    return native_build.build(SOURCE, "dense", directory, compiler)


@functools.cache
def available() -> bool:
    """Build, load and register the kernel once per process; False (with one log line) where it cannot be."""
    return native_build.build_and_register(SOURCE, "dense", _SYMBOL, TARGET, logger,
                                           "native CPU dense products", "XLA's dot")


def active() -> bool:
    """Whether CPU programs traced now call the kernel: the switch on and the library available (asking builds
    and registers it)."""
    return enabled() and available()


def usable(x: jax.Array, w: jax.Array) -> bool:
    """Whether ``dense`` takes these operands: 2-D, f32 or bf16 rows, an f32 or bf16 weight, the kernel active."""
    return (x.ndim == 2 and w.ndim == 2 and x.dtype in WEIGHT_DTYPES and w.dtype in WEIGHT_DTYPES
            and active())


def dense_reference(x: jax.Array, w: jax.Array, *, transposed: bool = False) -> jax.Array:
    """``x @ w`` (``x @ w.T`` when ``transposed``: w is [n, k]) accumulated and returned in f32: f32[m, n]."""
    return jnp.dot(x, w.T if transposed else w, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST)


def dense(x: jax.Array, w: jax.Array, *, transposed: bool = False, threads: int = 0) -> jax.Array:
    """``x @ w`` for x dt[m, k] and w dt[k, n] (w dt[n, k] when ``transposed``, the product then ``x @ w.T``), f32
    or bf16 each, in f32: f32[m, n]. On a CPU with the kernel available it runs natively; in a program lowered
    for any other platform XLA's product runs (``jnp.dot``), and where the kernel is not available
    ``dense_reference``.

    ``threads``: the columns are split over at most this many threads, the calling one and XLA's intra-op pool
    (0, the default: every thread of the pool; 1: the calling thread alone).
    """
    if x.ndim == 2 and w.ndim == 2 and x.shape[1] != w.shape[1 if transposed else 0]:
        raise ValueError(f"x [{x.shape[0]}, {x.shape[1]}] and w {list(w.shape)} (transposed={transposed}) "
                         "disagree on k")
    if not usable(x, w):
        return dense_reference(x, w, transposed=transposed)
    n = w.shape[0] if transposed else w.shape[1]

    def native(x, w):
        call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
        return call(x.astype(jnp.float32), w, transposed=transposed, threads=np.int64(threads))

    def xla(x, w):  # XLA's own product, at the default precision
        return jnp.dot(x, w.T if transposed else w, preferred_element_type=jnp.float32)

    # The platform a program is lowered for decides, not the process's default backend: a program traced here
    # for a described TPU or GPU (ahead-of-time compiles) takes XLA's product.
    return jax.lax.platform_dependent(x, w, cpu=native, default=xla)
