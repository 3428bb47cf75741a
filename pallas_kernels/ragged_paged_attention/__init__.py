"""Ragged paged attention over a paged KV cache: the reference (the spec), the pure-JAX CPU path, and the
Pallas TPU and GPU kernels (GPU: Triton, and Mosaic GPU for Hopper). Their metadata contract is
``pallas_kernels.metadata`` (re-exported here); the KV-write kernels are in ``pallas_kernels.kv_cache_update``.

The Mosaic GPU kernel is imported from its own module, ``pallas_kernels.ragged_paged_attention.mosaic_gpu``, by
whoever runs it: its jax modules take ~0.5 s to import, which every other process (a CPU or TPU server's start
included) would pay for nothing."""

from pallas_kernels.metadata import AttentionMetadata, check_shapes, check_values, token_layout
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention, write_kv
from pallas_kernels.ragged_paged_attention.cpu import ragged_paged_attention_chunks, ragged_paged_attention_rows
from pallas_kernels.ragged_paged_attention.block_sizes import BlockSizes, get_block_sizes
from pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu
from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu

__all__ = [
    "AttentionMetadata",
    "ragged_paged_attention",
    "ragged_paged_attention_rows",
    "ragged_paged_attention_chunks",
    "write_kv",
    "token_layout",
    "check_shapes",
    "check_values",
    "BlockSizes",
    "get_block_sizes",
    "ragged_paged_attention_tpu",
    "ragged_paged_attention_gpu",
]
