"""The ragged-batch contract shared by every ragged paged-attention implementation and KV-write kernel.

A step processes ``T`` (padded) query tokens that belong to up to ``S`` sequences, described by one
``AttentionMetadata``:

- ``cu_q_lens: i32[S + 1]``  sequence ``s`` owns query rows ``cu_q_lens[s] : cu_q_lens[s + 1]``; rows at or
  beyond ``cu_q_lens[num_seqs]`` are padding.
- ``kv_lens: i32[S]``  tokens of sequence ``s`` in the cache *after* this step's tokens are written, so its
  query rows sit at positions ``kv_lens[s] - q_len[s] .. kv_lens[s] - 1``.
- ``page_indices: i32[S, P]``  the pages that hold sequence ``s``'s tokens, in order; entries past
  ``ceil(kv_lens[s] / page_size)`` are ignored.
- ``num_seqs: i32[1]``  live sequences; slots ``num_seqs .. S - 1`` are padding.

KV pages live in ``k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim]`` (one pair per layer);
the leading KV-head axis is the one tensor parallelism shards.

This module imports nothing from the kernels, so the attention package and ``kv_cache_update`` both build on it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """The ragged-batch description every attention implementation and KV write reads (see the module doc).

    A pytree of its four arrays, in this field order everywhere: device arrays inside a step, NumPy arrays on
    the host (``check_values``), or with a leading replica axis on a mesh (every field stacked).
    """

    cu_q_lens: jax.Array  # i32[S + 1]
    kv_lens: jax.Array  # i32[S]
    page_indices: jax.Array  # i32[S, P]
    num_seqs: jax.Array  # i32[1]

    @classmethod
    def abstract(cls, slots: int, pages_per_seq: int) -> "AttentionMetadata":
        """Shapes alone (``jax.ShapeDtypeStruct``) for ``slots`` sequence slots of ``pages_per_seq`` pages: what
        a kernel is traced, lowered or compiled with when nothing is allocated."""
        sds, i32 = jax.ShapeDtypeStruct, jnp.int32
        return cls(sds((slots + 1,), i32), sds((slots,), i32), sds((slots, pages_per_seq), i32), sds((1,), i32))


def token_layout(md: AttentionMetadata, num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per query row: its sequence slot, its absolute position, and whether it is a real token.

    Returns:
      (seq_ids i32[T], positions i32[T], valid bool[T]); padding rows get seq 0, position 0, valid False.
    """
    cu_q_lens, kv_lens = md.cu_q_lens, md.kv_lens
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    valid = rows < cu_q_lens[md.num_seqs[0]]
    # The sequence that owns row t is the number of sequence ends at or before t.
    seq_ids = jnp.searchsorted(cu_q_lens[1:], rows, side="right").astype(jnp.int32)
    seq_ids = jnp.where(valid, jnp.minimum(seq_ids, kv_lens.shape[0] - 1), 0)
    q_lens = cu_q_lens[seq_ids + 1] - cu_q_lens[seq_ids]
    positions = kv_lens[seq_ids] - q_lens + (rows - cu_q_lens[seq_ids])
    return seq_ids, jnp.where(valid, positions, 0), valid


def check_shapes(q, k_pages, v_pages, md: AttentionMetadata, sinks=None) -> None:
    """Trace-time checks of shapes and dtypes; raises ValueError naming the argument."""
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"sinks must be [num_q_heads] = ({q.shape[1]},), got shape {tuple(sinks.shape)}")
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            "k_pages and v_pages must both be [num_kv_heads, num_pages, page_size, head_dim], "
            f"got {k_pages.shape} and {v_pages.shape}"
        )
    num_kv_heads, _, _, head_dim = k_pages.shape
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != k_pages head_dim {head_dim}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"num_q_heads {q.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages dtype {k_pages.dtype} != v_pages dtype {v_pages.dtype}")
    kv_lens, page_indices = md.kv_lens, md.page_indices
    num_slots = kv_lens.shape[0] if kv_lens.ndim == 1 else -1
    expected = {
        "cu_q_lens": (md.cu_q_lens, (num_slots + 1,)),
        "kv_lens": (kv_lens, (num_slots,)),
        "page_indices": (page_indices, (num_slots, page_indices.shape[-1] if page_indices.ndim == 2 else -1)),
        "num_seqs": (md.num_seqs, (1,)),
    }
    for name, (arr, shape) in expected.items():
        if tuple(arr.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(arr.shape)}")
        if arr.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {arr.dtype}")


def check_values(md: AttentionMetadata, *, num_tokens: int, num_pages: int, page_size: int) -> None:
    """Host-side value checks of a batch before a kernel reads pages through it (the engine's ``debug_checks``).

    The kernels trust the metadata: an out-of-range page index or a kv_len beyond the sequence's pages would
    make them read (or, for the KV write, overwrite) another request's page. Raises ValueError instead.

    Args:
      md: the batch's metadata, as NumPy (or concrete device) arrays.
      num_tokens: padded query rows of the step (q.shape[0]).
      num_pages, page_size: of one layer's page pool (``k_pages.shape[1:3]``).
    """
    kv_lens, page_indices = np.asarray(md.kv_lens), np.asarray(md.page_indices)
    cu_q_lens, n = np.asarray(md.cu_q_lens), int(np.asarray(md.num_seqs)[0])
    if not 0 <= n <= kv_lens.shape[0]:
        raise ValueError(f"num_seqs={n} outside [0, {kv_lens.shape[0]}]")
    if cu_q_lens[0] != 0 or np.any(np.diff(cu_q_lens[: n + 1]) < 0):
        raise ValueError(f"cu_q_lens must start at 0 and be non-decreasing, got {cu_q_lens[: n + 1].tolist()}")
    if cu_q_lens[n] > num_tokens:
        raise ValueError(f"cu_q_lens[num_seqs]={cu_q_lens[n]} exceeds the {num_tokens} query rows")
    q_lens = np.diff(cu_q_lens[: n + 1])
    max_len = page_indices.shape[1] * page_size
    for s in range(n):
        if not q_lens[s] <= kv_lens[s] <= max_len:
            raise ValueError(
                f"sequence {s}: kv_len={kv_lens[s]} must be at least its q_len={q_lens[s]} and at most "
                f"pages_per_seq * page_size = {max_len}"
            )
        used = page_indices[s, : -(-int(kv_lens[s]) // page_size)]
        bad = used[(used < 0) | (used >= num_pages)]
        if bad.size:
            raise ValueError(f"sequence {s}: page index {int(bad[0])} outside [0, {num_pages})")
