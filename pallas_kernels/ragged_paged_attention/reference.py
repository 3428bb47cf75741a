"""Pure-JAX ragged paged attention: the specification every kernel (and the CPU path, `cpu.py`) is tested against.

Each query row attends, causally, to the first ``position + 1`` tokens of its own sequence, read through that
sequence's page table. Written per row (gather the row's pages, mask, softmax) so that it is obviously right;
rows are processed in chunks to bound the gathered KV in memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.metadata import AttentionMetadata, check_shapes, token_layout

_GATHER_BUDGET_BYTES = 256 * 1024 * 1024


def masked_softmax(scores: jax.Array, visible: jax.Array, soft_cap: float | None,
                   sinks: jax.Array | None = None) -> jax.Array:
    """Softmax over the last axis of f32 ``scores`` where ``visible`` (broadcastable) holds, after the optional
    soft cap; masked entries get weight 0, and a row with nothing visible gets all zeros (not NaN).

    ``sinks`` (f32, broadcastable to ``scores[..., :1]``): one more logit per row that joins the denominator
    and carries no value (gpt-oss's attention sinks): the weights then sum to less than 1."""
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(visible, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
        peak = jnp.maximum(peak, sinks)
    shift = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.where(visible, jnp.exp(scores - shift), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + jnp.exp(sinks - shift)
    return weights / jnp.maximum(total, 1e-30)


def ragged_paged_attention(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # f32[num_q_heads]
) -> jax.Array:
    """Attention of a ragged batch over a paged KV cache.

    Args:
      q: queries of every row (padding rows are ignored and come back as zeros).
      k_pages, v_pages: the page pool of one layer; must already hold this step's K/V.
      md: the ragged-batch metadata (see ``pallas_kernels.metadata``).
      sm_scale: multiplier of q·k before the softmax.
      sliding_window: if set, a row at position p sees only keys at positions > p - sliding_window.
      soft_cap: if set, scores become soft_cap * tanh(scores / soft_cap) before masking.
      sinks: if set, one learned logit per query head that joins each row's softmax denominator with no value
        (attention sinks): out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j)). A row that sees no key
        still gets 0.

    Returns:
      [T, num_q_heads, head_dim] in q's dtype.
    """
    check_shapes(q, k_pages, v_pages, md, sinks)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    kv_lens, page_indices = md.kv_lens, md.page_indices
    pages_per_seq = page_indices.shape[1]
    span = pages_per_seq * page_size
    group = num_q_heads // num_kv_heads
    seq_ids, positions, valid = token_layout(md, num_tokens)
    key_pos = jnp.arange(span, dtype=jnp.int32)

    def one_row(args):
        q_row, seq, pos, ok = args  # q_row: [num_q_heads, head_dim]
        pages = page_indices[seq]
        k = k_pages[:, pages].reshape(num_kv_heads, span, head_dim)
        v = v_pages[:, pages].reshape(num_kv_heads, span, head_dim)
        visible = ok & (key_pos <= pos) & (key_pos < kv_lens[seq])
        if sliding_window is not None:
            visible &= key_pos > pos - sliding_window
        qg = q_row.reshape(num_kv_heads, group, head_dim)
        scores = jnp.einsum("kgd,kld->kgl", qg, k, preferred_element_type=jnp.float32) * sm_scale
        row_sinks = None if sinks is None else sinks.astype(jnp.float32).reshape(num_kv_heads, group, 1)
        weights = masked_softmax(scores, visible, soft_cap, row_sinks)
        # Masked keys may hold anything (another request's data, NaN): zero them, not just their weights.
        v = jnp.where(visible[None, :, None], v, jnp.zeros((), v.dtype))
        out = jnp.einsum("kgl,kld->kgd", weights, v.astype(jnp.float32))
        return out.reshape(num_q_heads, head_dim).astype(q.dtype)

    row_bytes = 2 * num_kv_heads * span * head_dim * 4
    chunk = max(1, min(num_tokens, _GATHER_BUDGET_BYTES // row_bytes))
    return jax.lax.map(one_row, (q, seq_ids, positions, valid), batch_size=chunk)


def write_kv(
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    new_k: jax.Array,  # [T, num_kv_heads, head_dim]
    new_v: jax.Array,  # [T, num_kv_heads, head_dim]
    md: AttentionMetadata,
) -> tuple[jax.Array, jax.Array]:
    """Write each real row's K/V into its page slot; padding rows write nothing.

    Returns:
      The updated (k_pages, v_pages); donate the inputs so XLA updates them in place.
    """
    num_pages, page_size = k_pages.shape[1], k_pages.shape[2]
    seq_ids, positions, valid = token_layout(md, new_k.shape[0])
    # Padding rows point one past the pool, and mode="drop" discards them.
    page = jnp.where(valid, md.page_indices[seq_ids, positions // page_size], num_pages)
    offset = positions % page_size

    def put(pages, new):
        # Scattered straight into the 4-D pool: a reshape around the scatter makes XLA copy the whole pool.
        return pages.at[:, page, offset].set(new.swapaxes(0, 1).astype(pages.dtype), mode="drop")

    return put(k_pages, new_k), put(v_pages, new_v)
