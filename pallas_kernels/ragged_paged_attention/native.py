"""The native CPU attention rows (``cpu_native.cc``): built, loaded and registered with XLA at first use.

XLA:CPU cannot read a row's K/V pages in place: the pure-JAX walk (``cpu.py``) gathers them into a copy first,
and that copy, not the arithmetic, bounds the decode step on CPU. The C++ kernel reads the pages through the
page table directly. It is built for the machine it runs on and registered as an XLA FFI target
(``pallas_kernels.native_build``).

Where it cannot be built (no compiler, a failed build) or ``JAXSERVE_CPU_NATIVE_ATTENTION=0``, ``available()``
is False, one log line says why, and callers run the pure-JAX walk. An executable that calls the target (a
deserialized one included) needs it registered in its process first: call ``available()`` before loading one.
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
from pallas_kernels.quantized_pages import QuantizedPages

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_native.cc")
SWITCH = "JAXSERVE_CPU_NATIVE_ATTENTION"  # "0" turns the native path off
TARGET = "jaxserve_rows_attention"
_SYMBOL = "JaxserveRowsAttention"
PAGE_DTYPES = (jnp.float32, jnp.bfloat16)
QUANTIZED_DTYPES = (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)  # QuantizedPages storage the kernel widens


def cache_dir() -> Path:
    return native_build.cache_dir()


def enabled() -> bool:
    """Whether the native path is wanted (``JAXSERVE_CPU_NATIVE_ATTENTION`` is not "0")."""
    return os.environ.get(SWITCH, "1") != "0"


def build(directory: Path, compiler: str) -> Path:
    """The shared library built from ``SOURCE`` with ``compiler`` in ``directory`` (reused when its key matches).

    Raises OSError or subprocess.CalledProcessError when the compiler is missing or the build fails.
    """
    return native_build.build(SOURCE, "rows_attention", directory, compiler)


@functools.cache
def available() -> bool:
    """Build, load and register the kernel once per process; False (with one log line) where it cannot be."""
    return native_build.build_and_register(SOURCE, "rows_attention", _SYMBOL, TARGET, logger,
                                           "native CPU attention", "the pure-JAX walk")


@functools.cache
def _log_switched_off() -> None:
    logger.info("native CPU attention off (%s=0): the pure-JAX walk runs", SWITCH)


def usable(k_pages) -> bool:
    """Whether the native kernel reads these pages in the program being traced: a CPU backend, float32 or
    bfloat16 pages or an 8-bit ``QuantizedPages`` pool (int8, float8_e4m3fn, float8_e5m2: widened in the
    kernel), the switch on and the library available. Read at trace time, so the switch applies to programs
    traced after it changes."""
    if jax.default_backend() != "cpu":
        return False
    if isinstance(k_pages, QuantizedPages):
        if k_pages.storage_dtype not in QUANTIZED_DTYPES:
            return False
    elif k_pages.dtype not in PAGE_DTYPES:
        return False
    return active()


def active() -> bool:
    """Whether CPU programs traced now call the kernel where their pages allow: the switch on and the library
    available (asking builds and registers it)."""
    if not enabled():
        _log_switched_off()
        return False
    return available()


def attend(
    q: jax.Array,  # f32[R, num_q_heads, head_dim]
    k_pages: jax.Array | QuantizedPages,  # f32|bf16|int8|f8e4m3fn|f8e5m2[num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array | QuantizedPages,  # like k_pages
    tables: jax.Array,  # i32[S, P]: each sequence slot's pages
    row_seq: jax.Array,  # i32[R]: the slot whose pages each row reads
    first: jax.Array,  # i32[R]: first visible key position (inclusive)
    last: jax.Array,  # i32[R]: last visible key position (inclusive; < first: the row sees nothing)
    *,
    sm_scale: float,
    soft_cap: float | None,
    threads: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Each row over keys [first, last] of its slot's pages, read in place. 8-bit ``QuantizedPages`` are read as
    their values and per-token scales, widened to f32 in the kernel.

    ``threads``: the rows are split over at most this many threads, the calling thread and XLA's intra-op pool
    (0, the default: every thread of the pool; 1: the calling thread alone). One walk is bound by how many
    random reads it keeps in flight, not by the memory's bandwidth, so more walks at once read faster: on 2
    cores the host-bound case's decode steps run 1.2x faster with both, and the decode-only host benchmark does
    not drop (docs/benchmarks/host-overhead.md, "The native attention over both cores").

    Returns:
      (out f32[R, num_q_heads, head_dim]: the softmax-weighted values, zeros for a row that sees nothing;
       lse f32[R, num_q_heads]: the log-sum-exp of its scores, -inf for such a row).
    """
    if not available():  # registered with XLA on first use, whoever calls first
        raise RuntimeError("the native CPU attention library could not be built or loaded (logged above); callers "
                           "check usable() first")
    rows, num_q_heads, _ = q.shape
    if isinstance(k_pages, QuantizedPages) != isinstance(v_pages, QuantizedPages):
        raise ValueError("k_pages and v_pages must both be QuantizedPages or both arrays")
    fp8_bytes = 0  # uint8 pages: the fp8 format they hold (4: e4m3fn, 5: e5m2)
    if isinstance(k_pages, QuantizedPages):
        if k_pages.fp8_format is not None:
            fp8_bytes = 4 if jnp.dtype(k_pages.fp8_format) == jnp.float8_e4m3fn else 5
        k_pages, k_scales, v_pages, v_scales = k_pages.values, k_pages.scales, v_pages.values, v_pages.scales
    else:
        k_scales = v_scales = jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                     jax.ShapeDtypeStruct((rows, num_q_heads), jnp.float32)))
    return call(q.astype(jnp.float32), k_pages, v_pages, k_scales, v_scales, tables, row_seq, first, last,
                sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0), threads=np.int64(threads),
                fp8_bytes=np.int64(fp8_bytes))
