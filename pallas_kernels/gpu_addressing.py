"""The GPU (Triton) kernels' addressing limit: every array they index holds fewer than 2**31 elements.

The kernels gather rows of the page pools flattened to ``[num_kv_heads * num_pages * page_size, head_dim]``
with int32 row indices, and Pallas' Triton lowering turns ``(row, lane)`` into an element offset whose type it
picks from the array's size in bytes: 32-bit unless the array is larger than 4 GiB. An 8-bit pool of 2**31 to
2**32 elements therefore gets a 32-bit offset that wraps, and any pool past 2**31 rows overflows the row index
itself: both would read (or write) the wrong rows without an error. The one limit that holds for every dtype is
2**31 elements per array, i.e. per layer's K (or V) pool on each device. The kernels' wrappers check it at trace
time (``check_elements``); the engine checks and caps the pool it allocates with ``max_pool_pages``.
"""

from __future__ import annotations

import math

MAX_ELEMENTS = 2**31  # exclusive: the largest int32 offset is 2**31 - 1


def max_pool_pages(num_kv_heads: int, page_size: int, head_dim: int) -> int:
    """The most pages a ``[num_kv_heads, num_pages, page_size, head_dim]`` pool may have for the GPU kernels."""
    return (MAX_ELEMENTS - 1) // (num_kv_heads * page_size * head_dim)


def pool_limit_message(num_kv_heads: int, num_pages: int, page_size: int, head_dim: int) -> str | None:
    """Why a pool of this shape is too large for the GPU kernels (None when it is not)."""
    elements = num_kv_heads * num_pages * page_size * head_dim
    if elements < MAX_ELEMENTS:
        return None
    return (f"a KV pool of num_pages={num_pages} x page_size={page_size} x {num_kv_heads} KV heads x "
            f"head_dim={head_dim} = {elements} elements per layer is too large for the GPU kernels, which "
            f"address each pool with 32-bit offsets (limit {MAX_ELEMENTS - 1} elements, i.e. at most "
            f"{max_pool_pages(num_kv_heads, page_size, head_dim)} pages)")


def check_elements(name: str, shape) -> None:
    """Raise ValueError if the array ``name`` of ``shape`` is too large for 32-bit addressing."""
    shape = tuple(int(d) for d in shape)
    if len(shape) == 4 and name.endswith("pages"):
        message = pool_limit_message(*shape)
        if message:
            raise ValueError(f"{name}: {message}")
    elements = math.prod(shape)
    if elements >= MAX_ELEMENTS:
        raise ValueError(f"{name} of shape {shape} has {elements} elements; the GPU kernels address it with 32-bit "
                         f"offsets (limit {MAX_ELEMENTS - 1} elements)")
