"""Ragged paged attention over a paged KV cache: the reference (spec + CPU path) and its metadata contract."""

from pallas_kernels.ragged_paged_attention.metadata import check_shapes, check_values, token_layout
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention, write_kv
from pallas_kernels.ragged_paged_attention.sequence_loop import (ragged_paged_attention_auto,
                                                                 ragged_paged_attention_sequence_loop)

__all__ = ["ragged_paged_attention", "ragged_paged_attention_sequence_loop", "ragged_paged_attention_auto", "write_kv", "token_layout", "check_shapes", "check_values"]
