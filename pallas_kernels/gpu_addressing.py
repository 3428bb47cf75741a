"""The GPU (Triton) kernels' addressing limit: what they index must fit 32-bit offsets where Pallas uses them.

The kernels gather rows of the page pools flattened to ``[num_kv_heads * num_pages * page_size, head_dim]``
with int32 row indices, and Pallas' Triton lowering turns ``(row, lane)`` into an element offset whose type it
picks from the array's size in bytes: 32-bit up to 4 GiB, 64-bit past it. So:

- a pool of 2-byte or wider elements is addressed correctly at any size whose row index fits an int32: up to
  4 GiB its element offsets stay under 2**31 (2-byte) or 2**30 (4-byte), past 4 GiB they are 64-bit; the limit is
  2**31 rows (``num_kv_heads * num_pages * page_size``);
- an 8-bit pool of 2**31 to 2**32 elements still gets 32-bit offsets, which wrap: the limit there is 2**31
  elements.

Past either, a kernel would read (or write) the wrong rows without an error. The kernels' wrappers check it at
trace time (``check_elements``); the engine checks and caps the pool it allocates with ``max_pool_pages``. A GPU
run of a bf16 pool past 2**31 elements against the reference is ``scripts/check_gpu_large_pool.py``.
"""

from __future__ import annotations

import math

MAX_INDEX = 2**31  # exclusive: the largest int32 index (or 32-bit element offset) is 2**31 - 1
MAX_ELEMENTS = MAX_INDEX  # of an 8-bit array (32-bit offsets up to 4 GiB)


def max_pool_pages(num_kv_heads: int, page_size: int, head_dim: int, itemsize: int = 1) -> int:
    """The most pages a ``[num_kv_heads, num_pages, page_size, head_dim]`` pool of ``itemsize``-byte elements may
    have for the GPU kernels (``itemsize`` 1, the default, is the strictest)."""
    if itemsize >= 2:
        return (MAX_INDEX - 1) // (num_kv_heads * page_size)
    return (MAX_ELEMENTS - 1) // (num_kv_heads * page_size * head_dim)


def pool_limit_message(num_kv_heads: int, num_pages: int, page_size: int, head_dim: int,
                       itemsize: int = 1) -> str | None:
    """Why a pool of this shape is too large for the GPU kernels (None when it is not)."""
    if num_pages <= max_pool_pages(num_kv_heads, page_size, head_dim, itemsize):
        return None
    cap = max_pool_pages(num_kv_heads, page_size, head_dim, itemsize)
    if itemsize >= 2:
        rows = num_kv_heads * num_pages * page_size
        return (f"a KV pool of num_pages={num_pages} x page_size={page_size} x {num_kv_heads} KV heads = {rows} "
                f"rows per layer is too large for the GPU kernels, which index its rows with 32-bit integers "
                f"(limit {MAX_INDEX - 1} rows, i.e. at most {cap} pages)")
    elements = num_kv_heads * num_pages * page_size * head_dim
    return (f"a KV pool of num_pages={num_pages} x page_size={page_size} x {num_kv_heads} KV heads x "
            f"head_dim={head_dim} = {elements} elements per layer is too large for the GPU kernels, which "
            f"address an 8-bit pool under 4 GiB with 32-bit offsets (limit {MAX_ELEMENTS - 1} elements, i.e. at "
            f"most {cap} pages)")


def check_elements(name: str, shape, itemsize: int = 1) -> None:
    """Raise ValueError if the array ``name`` of ``shape`` and ``itemsize``-byte elements is too large for the
    kernels' addressing."""
    shape = tuple(int(d) for d in shape)
    if len(shape) == 4 and name.endswith("pages"):
        message = pool_limit_message(*shape, itemsize=itemsize)
        if message:
            raise ValueError(f"{name}: {message}")
        return
    elements = math.prod(shape)
    if itemsize >= 2:
        rows = math.prod(shape[:-1])
        if rows >= MAX_INDEX:
            raise ValueError(f"{name} of shape {shape} has {rows} rows; the GPU kernels index them with 32-bit "
                             f"integers (limit {MAX_INDEX - 1} rows)")
    elif elements >= MAX_ELEMENTS:
        raise ValueError(f"{name} of shape {shape} has {elements} elements; the GPU kernels address an 8-bit array "
                         f"under 4 GiB with 32-bit offsets (limit {MAX_ELEMENTS - 1} elements)")
