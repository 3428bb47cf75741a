"""Ragged paged attention computed one sequence at a time: the fast pure-JAX path for prefill batches.

The reference gathers every query row's whole page table, so a prefill of T rows moves T times the context
through memory. Here each live sequence's pages are gathered once, and its rows (a window of the batch that
starts at ``cu_q_lens[s]``) attend to them in one matmul. Cost: ``num_seqs`` windows of ``T`` rows, so it
wins when a batch holds few sequences; ``ragged_paged_attention_auto`` picks per batch at run time.
Same contract and results as ``reference.ragged_paged_attention``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.metadata import check_shapes
from pallas_kernels.ragged_paged_attention.reference import masked_softmax, ragged_paged_attention

# Above this many live sequences, the per-row reference moves less data than per-sequence windows.
SEQUENCE_LOOP_MAX_SEQS = 8


def ragged_paged_attention_sequence_loop(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, P]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Same arguments and result as the reference (padding rows come back as zeros)."""
    check_shapes(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    t, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    span = page_indices.shape[1] * page_size
    group = num_q_heads // num_kv_heads
    rows = jnp.arange(t, dtype=jnp.int32)
    keys = jnp.arange(span, dtype=jnp.int32)
    # Windows start anywhere in [0, T); padding the rows by T keeps every window in bounds.
    q_padded = jnp.concatenate([q, jnp.zeros_like(q)]).reshape(2 * t, num_kv_heads, group, head_dim)

    def one_sequence(s, out):
        start, q_len, kv_len = cu_q_lens[s], cu_q_lens[s + 1] - cu_q_lens[s], kv_lens[s]
        qw = jax.lax.dynamic_slice_in_dim(q_padded, start, t)  # [T, KVH, G, D]
        pages = page_indices[s]
        k = k_pages[:, pages].reshape(num_kv_heads, span, head_dim)
        v = v_pages[:, pages].reshape(num_kv_heads, span, head_dim)
        mine = rows < q_len
        pos = kv_len - q_len + rows
        visible = mine[:, None] & (keys[None, :] <= pos[:, None])  # [T, L]
        if sliding_window is not None:
            visible &= keys[None, :] > pos[:, None] - sliding_window
        scores = jnp.einsum("tkgd,kld->tkgl", qw, k, preferred_element_type=jnp.float32) * sm_scale
        weights = masked_softmax(scores, visible[:, None, None, :], soft_cap)
        # Keys past kv_len may hold anything (NaN included): zero them, not just their weights.
        v = jnp.where((keys < kv_len)[None, :, None], v, jnp.zeros((), v.dtype))
        o = jnp.einsum("tkgl,kld->tkgd", weights, v.astype(jnp.float32)).reshape(t, num_q_heads, head_dim)
        current = jax.lax.dynamic_slice_in_dim(out, start, t)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine[:, None, None], o, current), start, 0)

    out = jax.lax.fori_loop(0, num_seqs[0], one_sequence, jnp.zeros((2 * t, num_q_heads, head_dim), jnp.float32))
    return out[:t].astype(q.dtype)


def ragged_paged_attention_auto(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                                sliding_window=None, soft_cap=None) -> jax.Array:
    """Per-sequence windows for batches of few sequences, the per-row reference otherwise (chosen on device)."""
    args = (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    return jax.lax.cond(num_seqs[0] <= SEQUENCE_LOOP_MAX_SEQS,
                        lambda: ragged_paged_attention_sequence_loop(*args, **kw),
                        lambda: ragged_paged_attention(*args, **kw))
