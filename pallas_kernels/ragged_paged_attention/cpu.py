"""Pure-JAX ragged paged attention shaped for XLA:CPU: what the reference backend runs in the engine's steps.

Same contract and results as ``reference.ragged_paged_attention`` (which stays the specification); only the
shape of the computation differs, chosen from measurements of XLA:CPU (2-core x86, fp32, jax 0.10):

- **Decode** (``ragged_paged_attention_rows``): every query row gathers its sequence's pages, as in the
  reference, but the scores are computed with the keys as the matmul's left operand (``"ktld,ktgd->ktlg"``)
  and the softmax runs over that middle axis. XLA:CPU runs this orientation as one batched matmul about 4x
  faster than the reference's per-row ``"kgd,kld->kgl"``, which it lowers to many tiny dots.
- **Prefill** (``ragged_paged_attention_chunks``): a chunk's rows attend to two key sets whose softmax parts
  are merged by their log-sum-exp:
  (a) the rows of this very step, whose K/V the caller passes in: dense causal attention over the whole batch
      with a same-sequence mask, no page gather at all; query rows go in blocks that see only keys up to the
      block's last row (rows of one sequence are contiguous and in position order), which skips the upper
      triangle;
  (b) each sequence's cached context (the ``kv_len - q_len`` tokens before its chunk), read from its pages
      once per sequence that has any, in a loop that runs only over those sequences.
  The sequence-loop path this replaces computed one full ``T x span`` window per sequence, context or not:
  about 28 ms against 5 ms per layer for 512 rows of four prompts on the machine above.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.metadata import check_shapes, token_layout

_ROW_BLOCK = 128  # query rows per span of the in-chunk part while there are few spans
_MAX_ROW_SPANS = 8  # spans of the in-chunk part written out (more rows: longer spans, blocked)
_GATHER_BUDGET_BYTES = 256 * 1024 * 1024  # bound on one block's scores in the in-chunk part
_ROW_KEYS = 64  # keys per step of the decode walk


def _cap(scores: jax.Array, soft_cap: float | None) -> jax.Array:
    return scores if soft_cap is None else soft_cap * jnp.tanh(scores / soft_cap)


def _materialize(x: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """``x``, computed once into a buffer of its own.

    XLA:CPU fuses small producers (a mask built from the metadata) into every consumer and recomputes them per
    element of the much larger scores, several times slower than reading a stored array; an optimisation
    barrier does not stop it (XLA drops barriers before fusion), a conditional's operand does.
    """
    return jax.lax.cond(num_seqs[0] >= 0, lambda x: x, jnp.zeros_like, x)


def _bias(visible: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """0 where visible, -inf elsewhere, stored (see ``_materialize``)."""
    return _materialize(jnp.where(visible, 0.0, -jnp.inf).astype(jnp.float32), num_seqs)


def _partial_softmax(scores: jax.Array, bias: jax.Array):
    """Unnormalised softmax over the last axis of finite ``scores``: (row max, exp(scores + bias - max), sum).
    A row with nothing visible gets max -inf, weights 0 and sum 0."""
    scores = scores + bias
    peak = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0))
    return peak[..., 0], weights, jnp.sum(weights, axis=-1)


def _zero_unless(mask: jax.Array, x: jax.Array) -> jax.Array:
    """``x`` where ``mask`` holds, else 0: rows and slots nobody may read can hold anything, NaN included."""
    return jnp.where(mask, x, jnp.zeros((), x.dtype))


def ragged_paged_attention_rows(
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
    """Every row over its own sequence's pages (the decode path). Same arguments and result as the reference.

    The keys are walked a few pages at a time (``_ROW_KEYS`` per step, online softmax), so each step's gathered
    K/V stays in cache instead of a [rows, whole page table] copy going out to memory and back, and the walk
    stops at the batch's longest row instead of running to the end of the page-table bucket.
    """
    check_shapes(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    pages_per_step = max(1, min(page_indices.shape[1], _ROW_KEYS // page_size))
    step_keys = pages_per_step * page_size
    seq_ids, positions, valid = token_layout(cu_q_lens, kv_lens, num_seqs, num_tokens)
    # Keys a row may see: [first, last], both inclusive (last = its own position, within its kv_len).
    last = jnp.where(valid, jnp.minimum(positions, kv_lens[seq_ids] - 1), -1)
    first = jnp.zeros_like(last) if sliding_window is None else jnp.maximum(positions - sliding_window + 1, 0)
    first = jnp.where(valid, first, jnp.iinfo(jnp.int32).max)
    lo = jnp.min(first, initial=jnp.iinfo(jnp.int32).max) // step_keys
    hi = (jnp.max(last, initial=-1) + step_keys) // step_keys  # one past the last step with a visible key
    lo = jnp.minimum(lo, hi)
    # Every row's page table, padded by one walk step so the last step's slice stays in bounds.
    tables = _materialize(jnp.pad(page_indices[seq_ids], ((0, 0), (0, pages_per_step))), num_seqs)
    first, last = _materialize(first, num_seqs), _materialize(last, num_seqs)
    qh = _zero_unless(valid[:, None, None], q).reshape(num_tokens, num_kv_heads, group, head_dim)
    qh = (qh.swapaxes(0, 1) * sm_scale).astype(jnp.float32)  # [KVH, T, G, D]
    offsets = jnp.arange(step_keys, dtype=jnp.int32)

    def walk(i, carry):
        peak, total, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(tables, i * pages_per_step, pages_per_step, axis=1)  # [T, C]
        key_pos = i * step_keys + offsets
        visible = (key_pos[None, :] >= first[:, None]) & (key_pos[None, :] <= last[:, None])  # [T, keys]
        keep = _materialize(visible, num_seqs)[None, :, :, None]
        k = _zero_unless(keep, k_pages[:, pages].reshape(num_kv_heads, num_tokens, step_keys, head_dim))
        v = _zero_unless(keep, v_pages[:, pages].reshape(num_kv_heads, num_tokens, step_keys, head_dim))
        scores = jnp.einsum("ktgd,ktld->ktgl", qh, k.astype(jnp.float32))
        scores = _cap(scores, soft_cap) + _bias(visible, num_seqs)[None, :, None, :]
        new_peak = jnp.maximum(peak, jnp.max(scores, axis=-1))
        safe = jnp.where(jnp.isfinite(new_peak), new_peak, 0.0)
        weights = jnp.exp(scores - safe[..., None])
        rescale = jnp.exp(peak - safe)  # 0 while nothing was visible yet (peak -inf)
        total = total * rescale + jnp.sum(weights, axis=-1)
        acc = acc * rescale[..., None] + jnp.einsum("ktgl,ktld->ktgd", weights, v.astype(jnp.float32))
        return new_peak, total, acc

    shape = (num_kv_heads, num_tokens, group)
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (head_dim,), jnp.float32))
    _, total, acc = jax.lax.fori_loop(lo, hi, walk, init)
    out = acc / jnp.maximum(total, 1e-30)[..., None]
    return out.swapaxes(0, 1).reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def ragged_paged_attention_chunks(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k: jax.Array,  # [T, num_kv_heads, head_dim]: this step's keys, row for row with q
    v: jax.Array,  # [T, num_kv_heads, head_dim]
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
    """Prompt chunks (the prefill path): the reference's arguments plus this step's own K/V, ``k`` and ``v``,
    one row per query row. The pages must hold every sequence's context before its chunk (the chunk's own
    rows are read from ``k``/``v``, so whether they are written yet does not matter). Result as the reference.
    """
    check_shapes(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k and v must be [{num_tokens}, {num_kv_heads}, {head_dim}] like q's rows, got "
                         f"{k.shape} and {v.shape}")
    group = num_q_heads // num_kv_heads
    seq_ids, positions, valid = token_layout(cu_q_lens, kv_lens, num_seqs, num_tokens)
    # Head-major operands: every score block is [KVH, rows * G, keys] with the keys innermost, the orientation
    # XLA:CPU multiplies fastest and whose softmax vectorises along the keys.
    real = valid[:, None, None]
    qh = _zero_unless(real, q).reshape(num_tokens, num_kv_heads, group, head_dim)
    qh = qh.swapaxes(0, 1).astype(jnp.float32)  # [KVH, T, G, D]
    kh = _zero_unless(real, k).swapaxes(0, 1).astype(jnp.float32)  # [KVH, T, D]
    vh = _zero_unless(real, v).swapaxes(0, 1).astype(jnp.float32)

    # (a) Keys of this step: query rows [r0, r1) see key rows [0, r1) of their own sequence, causally. At most
    # _MAX_ROW_SPANS such spans are written out (each its own static key count); inside a span, blocks of rows
    # go one after another so the scores stay within the gather budget however many rows the step has.
    spans = min(_MAX_ROW_SPANS, -(-num_tokens // _ROW_BLOCK))
    span_rows = -(-num_tokens // spans)
    parts = []
    for r0 in range(0, num_tokens, span_rows):
        r1 = min(num_tokens, r0 + span_rows)
        block = max(1, min(r1 - r0, _GATHER_BUDGET_BYTES // (3 * 4 * num_kv_heads * group * r1)))
        blocks = -(-(r1 - r0) // block)

        def own_rows(start, r1=r1, block=block):
            """Query rows [start, start + block) (``start`` static, or traced within padded arrays)."""
            take = lambda a, axis=0: jax.lax.dynamic_slice_in_dim(a, start, block, axis)  # noqa: E731
            ids, pos, ok = take(seq_ids_p), take(positions_p), take(valid_p)
            visible = ((ids[:, None] == seq_ids[None, :r1]) & ok[:, None] & valid[None, :r1]
                       & (positions[None, :r1] <= pos[:, None]))  # [block, keys]
            if sliding_window is not None:
                visible &= positions[None, :r1] > pos[:, None] - sliding_window
            qb = take(qh_p, 1).reshape(num_kv_heads, block * group, head_dim)
            scores = jnp.einsum("kmd,kld->kml", qb, kh[:, :r1]).reshape(num_kv_heads, block, group, r1)
            peak, weights, total = _partial_softmax(_cap(scores * sm_scale, soft_cap),
                                                    _bias(visible, num_seqs)[None, :, None, :])
            out = jnp.einsum("kml,kld->kmd", weights.reshape(num_kv_heads, block * group, r1), vh[:, :r1])
            return peak, out.reshape(num_kv_heads, block, group, head_dim), total

        if blocks == 1:
            seq_ids_p, positions_p, valid_p, qh_p = seq_ids, positions, valid, qh
            parts.append(own_rows(r0))
        else:  # rows padded so every block's slice is in bounds; [blocks, KVH, block, ...] -> [KVH, rows, ...]
            pad = lambda a, axis=0: jnp.pad(a, [(0, block if i == axis else 0) for i in range(a.ndim)])  # noqa: E731
            seq_ids_p, positions_p, valid_p, qh_p = pad(seq_ids), pad(positions), pad(valid), pad(qh, 1)
            done = jax.lax.map(own_rows, r0 + block * jnp.arange(blocks))
            parts.append(tuple(jnp.moveaxis(x, 0, 1).reshape(num_kv_heads, blocks * block, *x.shape[3:])[:, : r1 - r0]
                               for x in done))
    peak_a, out_a, total_a = (jnp.concatenate(x, axis=1) for x in zip(*parts))  # [KVH, T, G(, D)]

    # (b) Cached context, sequence by sequence, only for sequences that have any.
    peak_b, out_b, total_b = _context_part(qh, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                           sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)

    peak = jnp.maximum(peak_a, peak_b)
    safe = jnp.where(jnp.isfinite(peak), peak, 0.0)
    scale_a, scale_b = jnp.exp(peak_a - safe), jnp.exp(peak_b - safe)  # exp(-inf) = 0 for an empty part
    total = total_a * scale_a + total_b * scale_b
    out = (out_a * scale_a[..., None] + out_b * scale_b[..., None]) / jnp.maximum(total, 1e-30)[..., None]
    return out.swapaxes(0, 1).reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def _context_part(qh, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window,
                  soft_cap):
    """Each row over its sequence's context before the chunk: (peak, unnormalised out, sum), [KVH, T, G(, D)].

    A sequence with context gathers its pages once and its rows (a window of T rows starting at its first
    row, padded so every window is in bounds) attend to them; sequences without context cost nothing.
    """
    num_kv_heads, t, group, head_dim = qh.shape
    page_size = k_pages.shape[2]
    span = page_indices.shape[1] * page_size
    slot = jnp.arange(kv_lens.shape[0], dtype=jnp.int32)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    context = jnp.where(slot < num_seqs[0], kv_lens - q_lens, 0)
    has_context = (context > 0) & (q_lens > 0)
    order = jnp.argsort(~has_context, stable=True).astype(jnp.int32)  # sequences with context first
    count = jnp.sum(has_context.astype(jnp.int32))
    key_pos = jnp.arange(span, dtype=jnp.int32)
    rows = jnp.arange(t, dtype=jnp.int32)

    def one_sequence(i, carry, q_padded):
        s = order[i]
        start, q_len, ctx = cu_q_lens[s], q_lens[s], context[s]
        qw = jax.lax.dynamic_slice_in_dim(q_padded, start, t, axis=1).reshape(num_kv_heads, t * group, head_dim)
        stored = (key_pos < ctx)[None, :, None]
        k = _zero_unless(stored, k_pages[:, page_indices[s]].reshape(num_kv_heads, span, head_dim))
        v = _zero_unless(stored, v_pages[:, page_indices[s]].reshape(num_kv_heads, span, head_dim))
        mine = rows < q_len
        visible = mine[:, None] & (key_pos[None, :] < ctx)  # [t, span]
        if sliding_window is not None:
            visible &= key_pos[None, :] > (ctx + rows)[:, None] - sliding_window
        scores = jnp.einsum("kmd,kld->kml", qw, k.astype(jnp.float32)).reshape(num_kv_heads, t, group, span)
        peak, weights, total = _partial_softmax(_cap(scores * sm_scale, soft_cap), _bias(visible, num_seqs)[None, :, None, :])
        out = jnp.einsum("kml,kld->kmd", weights.reshape(num_kv_heads, t * group, span), v.astype(jnp.float32))
        new = (peak, out.reshape(num_kv_heads, t, group, head_dim), total)

        def put(whole, part):
            current = jax.lax.dynamic_slice_in_dim(whole, start, t, axis=1)
            keep = mine.reshape((1, t) + (1,) * (part.ndim - 2))
            return jax.lax.dynamic_update_slice_in_dim(whole, jnp.where(keep, part, current), start, axis=1)

        return tuple(put(w, p) for w, p in zip(carry, new))

    def walk():
        q_padded = jnp.concatenate([qh, jnp.zeros_like(qh)], axis=1)  # windows start anywhere in [0, T)
        init = (jnp.full((num_kv_heads, 2 * t, group), -jnp.inf, jnp.float32),
                jnp.zeros((num_kv_heads, 2 * t, group, head_dim), jnp.float32),
                jnp.zeros((num_kv_heads, 2 * t, group), jnp.float32))
        peak, out, total = jax.lax.fori_loop(0, count, lambda i, c: one_sequence(i, c, q_padded), init)
        return peak[:, :t], out[:, :t], total[:, :t]

    def nothing():  # no sequence has context: skip even the padded copy of q
        return (jnp.full((num_kv_heads, t, group), -jnp.inf, jnp.float32),
                jnp.zeros((num_kv_heads, t, group, head_dim), jnp.float32),
                jnp.zeros((num_kv_heads, t, group), jnp.float32))

    return jax.lax.cond(count > 0, walk, nothing)
