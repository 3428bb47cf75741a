"""Value checks of a ragged batch before a kernel reads pages through it.

The kernels trust the metadata: an out-of-range page index or a kv_len beyond the sequence's pages would make
them read (or, for the KV write, overwrite) another request's page. ``check_batch`` is the host-side guard the
engine calls on the batch it is about to dispatch; the kernels' ``debug_checks=True`` runs the same check,
directly when the metadata is concrete and through a host callback when it is traced inside ``jax.jit``.
"""

from __future__ import annotations

import jax
import numpy as np

from pallas_kernels.ragged_paged_attention.metadata import check_values


def check_batch(
    num_tokens: int,
    k_pages_shape: tuple[int, ...],  # (num_kv_heads, num_pages, page_size, head_dim)
    kv_lens,  # i32[S]
    page_indices,  # i32[S, P]
    cu_q_lens,  # i32[S + 1]
    num_seqs,  # i32[1]
) -> None:
    """Raise ValueError if the batch would make a kernel touch a page that is not the sequence's own.

    Args:
      num_tokens: padded query rows of the step (q.shape[0]).
      k_pages_shape: shape of one layer's page pool.
      kv_lens, page_indices, cu_q_lens, num_seqs: host (NumPy) or concrete device arrays.
    """
    _, num_pages, page_size, _ = k_pages_shape
    check_values(num_tokens, num_pages, page_size, np.asarray(kv_lens), np.asarray(page_indices),
                 np.asarray(cu_q_lens), np.asarray(num_seqs))


def maybe_check_batch(
    debug_checks: bool,
    num_tokens: int,
    k_pages_shape: tuple[int, ...],
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, P]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
) -> None:
    """``check_batch`` now if the metadata is concrete, else at run time from a host callback."""
    if not debug_checks:
        return
    arrays = (kv_lens, page_indices, cu_q_lens, num_seqs)
    if not any(isinstance(a, jax.core.Tracer) for a in arrays):
        check_batch(num_tokens, k_pages_shape, *arrays)
        return

    def host_check(*values):
        check_batch(num_tokens, k_pages_shape, *values)

    # Under jit the ValueError surfaces as a runtime error carrying the same message.
    jax.debug.callback(host_check, *arrays, ordered=True)
