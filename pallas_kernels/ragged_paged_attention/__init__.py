"""Ragged paged attention over a paged KV cache: the reference (the spec), its metadata contract, the pure-JAX
CPU path, and the Pallas TPU and GPU kernels with their KV-write companions."""

from pallas_kernels.ragged_paged_attention.metadata import check_shapes, check_values, token_layout
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention, write_kv
from pallas_kernels.ragged_paged_attention.cpu import ragged_paged_attention_chunks, ragged_paged_attention_rows
from pallas_kernels.ragged_paged_attention.block_sizes import BlockSizes, get_block_sizes
from pallas_kernels.ragged_paged_attention.validation import check_batch
from pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu
from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu

__all__ = [
    "ragged_paged_attention",
    "ragged_paged_attention_rows",
    "ragged_paged_attention_chunks",
    "write_kv",
    "token_layout",
    "check_shapes",
    "check_values",
    "check_batch",
    "BlockSizes",
    "get_block_sizes",
    "ragged_paged_attention_tpu",
    "ragged_paged_attention_gpu",
    "write_kv_tpu",
    "write_kv_gpu",
]


def __getattr__(name):
    # kv_cache_update builds on this package's metadata, so its kernels are re-exported lazily (no import cycle).
    if name in ("write_kv_tpu", "write_kv_gpu"):
        from pallas_kernels import kv_cache_update

        return getattr(kv_cache_update, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
