"""Pure-JAX ragged paged attention shaped for XLA:CPU: what the reference backend runs in the engine's steps.

Same contract and results as ``reference.ragged_paged_attention`` (which stays the specification); only the
shape of the computation differs, chosen from measurements of XLA:CPU (2-core x86, fp32, jax 0.10):

- **Decode** (``ragged_paged_attention_rows``): each row walks its own pages with an online softmax, from the
  batch's first visible key to its last, 64 keys at a time while the keys fill a step and then a page at a
  time, so each step's gathered K/V stays in cache instead of a [rows, whole page table] copy going out to
  memory and back (48 rows of ~300 keys, 8 layers: 41 -> 26 ms per step), and no step gathers more than a
  page of keys nobody sees (256 rows of ~80 keys: the decode step 4.0 -> 2.6 ms).
- **Prefill** (``ragged_paged_attention_chunks``): a chunk's rows attend to two key sets whose softmax parts
  are merged by their log-sum-exp:
  (a) the rows of this very step, whose K/V the caller passes in: dense causal attention over the whole batch
      with a same-sequence mask, no page gather at all; query rows go in blocks that see only keys up to the
      block's last row (rows of one sequence are contiguous and in position order), which skips the upper
      triangle;
  (b) each sequence's cached context (the ``kv_len - q_len`` tokens before its chunk): a chunk of several rows
      walks its pages 256 keys at a time up to its context's end (online softmax, so a wide page table costs
      nothing past it), 64 of its rows at a time (a 25-row chunk in a 512-row step once took all 512), in a loop over only the sequences that have context; sequences with a single row
      (decodes carried in a prompt step) walk their pages together, as in the decode path. Decodes therefore
      ride in the prompt step instead of a call of their own (their matmuls join the chunk's: a step of 478
      prompt rows and 34 decodes took ~250 ms against ~275 ms as two calls, ~100M model).
  The per-sequence path this replaced computed one full ``T x span`` window per sequence, context or not:
  about 28 ms against 5 ms per layer for 512 rows of four prompts on the machine above.

Masks are stored once per call (``_materialize``) rather than left to fusion; see there.

Where the native kernel is available (``native.py``: C++ through XLA's FFI, fp32 and bf16 pages, and 8-bit
``QuantizedPages`` widened in the kernel: int8, float8_e4m3fn, float8_e5m2), the rows that
walk their pages (every decode row, and the single-row sequences of a prompt step) run it instead of the walk:
it reads the pages in place where the walk must gather them into a copy first. The walk is its fallback.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.metadata import AttentionMetadata, check_shapes, token_layout
from pallas_kernels.ragged_paged_attention import native

_ROW_BLOCK = 128  # query rows per span of the in-chunk part while there are few spans
_MAX_ROW_SPANS = 8  # spans of the in-chunk part written out (more rows: longer spans, blocked)
_SCORE_BUDGET_BYTES = 256 * 1024 * 1024  # bound on one block's scores in the in-chunk part
_ROW_KEYS = 64  # keys per step of the decode walk
_LONG_WALK = 4  # whole steps from which the decode walk takes its last partial step whole (see _walk)
_CONTEXT_KEYS = 256  # keys per step of a prompt chunk's walk over its cached context
_CONTEXT_ROWS = 64  # query rows per block of that walk: a short chunk pays for this many rows, not the step's
# Relative costs of a prompt step's two paths where the native kernel runs, in nanoseconds for SmolLM-135M's
# heads (9 query, 3 KV, head_dim 64), fp32, measured on a 2-core Intel Xeon (AVX-512) with
# scripts/bench_cpu_prompt_attention.py --bucket 512: the native rows path ~55 per (row, visible key) pair (its
# tiles of consecutive rows read each block of keys once; 50-58 for prompts of 256-512 rows and for a 512-row
# chunk over 1,536 cached keys); the chunk path ~31 per square of the step's rows (its dense in-chunk spans), ~40
# per pair of a chunk row (rounded up to a block of _CONTEXT_ROWS) and a key of its cached context, and single
# rows over their context at the rows path's rate (they go through the native kernel there too). Only the ratios
# matter: all scale alike with the heads. In the engine's steps (the deep narrow benchmark's 13 prompt steps,
# replayed) the chunk path also paid ~2 ms more whenever some sequence had context (its context part: the single
# rows' walk, the padded parts, the merge), which the last constant adds.
_ROWS_NS_PER_PAIR, _CHUNK_NS_PER_ROW_SQUARED, _CHUNK_NS_PER_CONTEXT_PAIR = 55.0, 31.0, 40.0
_CHUNK_NS_WITH_CONTEXT = 2.0e6


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


def _dense_block(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, num_seqs: jax.Array, *,
                 sm_scale: float, soft_cap: float | None):
    """Query rows ``q`` [KVH, rows, G, D] over keys ``k``/``v`` [KVH, keys, D] where ``visible`` [rows, keys]:
    (peak, unnormalised out, sum) as [KVH, rows, G(, D)]. Scores are [KVH, rows * G, keys], keys innermost:
    the orientation XLA:CPU multiplies fastest and whose softmax vectorises along the keys."""
    num_kv_heads, rows, group, head_dim = q.shape
    scores = jnp.einsum("kmd,kld->kml", q.reshape(num_kv_heads, rows * group, head_dim), k)
    scores = _cap(scores.reshape(num_kv_heads, rows, group, -1) * sm_scale, soft_cap)
    peak, weights, total = _partial_softmax(scores, _bias(visible, num_seqs)[None, :, None, :])
    out = jnp.einsum("kml,kld->kmd", weights.reshape(num_kv_heads, rows * group, -1), v)
    return peak, out.reshape(num_kv_heads, rows, group, head_dim), total


def _merge(a, b):
    """Two (peak, unnormalised out, sum) parts of the same rows' softmax over disjoint keys, as one."""
    (peak_a, out_a, total_a), (peak_b, out_b, total_b) = a, b
    peak = jnp.maximum(peak_a, peak_b)
    safe = jnp.where(jnp.isfinite(peak), peak, 0.0)
    scale_a, scale_b = jnp.exp(peak_a - safe), jnp.exp(peak_b - safe)  # exp(-inf) = 0 for an empty part
    return peak, out_a * scale_a[..., None] + out_b * scale_b[..., None], total_a * scale_a + total_b * scale_b


def _with_sinks(parts, sinks: jax.Array | None):
    """(peak, unnormalised out, sum) [KVH, R, G(, D)] with each query head's sink logit (f32[KVH * G]) merged in
    as one more key whose value is zero: it joins the denominator only. Unchanged without sinks."""
    if sinks is None:
        return parts
    peak, out, total = parts
    num_kv_heads, _, group = peak.shape
    sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(num_kv_heads, 1, group), peak.shape)
    return _merge(parts, (sink, jnp.zeros_like(out), jnp.ones_like(total)))


def _normalise(parts) -> jax.Array:
    """The softmax-weighted values of (peak, unnormalised out, sum): 0 for rows that saw no key."""
    _, out, total = parts
    return out / jnp.maximum(total, 1e-30)[..., None]


def _empty_parts(num_kv_heads: int, rows: int, group: int, head_dim: int):
    """(peak, out, sum) of rows that have seen no key yet."""
    return (jnp.full((num_kv_heads, rows, group), -jnp.inf, jnp.float32),
            jnp.zeros((num_kv_heads, rows, group, head_dim), jnp.float32),
            jnp.zeros((num_kv_heads, rows, group), jnp.float32))


def ragged_paged_attention_rows(
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
    """Every row over its own sequence's pages (the decode path). Same arguments and result as the reference.

    The native kernel reads the pages in place where it can (see the module doc). Otherwise the keys are walked
    a few pages at a time (``_ROW_KEYS`` per step, online softmax), so each step's gathered K/V stays in cache
    instead of a [rows, whole page table] copy going out to memory and back, and the walk stops at the batch's
    longest row instead of running to the end of the page-table bucket.
    """
    check_shapes(q, k_pages, v_pages, md, sinks)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    group = num_q_heads // num_kv_heads
    seq_ids, positions, valid = token_layout(md, num_tokens)
    # Keys a row may see: [first, last], both inclusive (last = its own position, within its kv_len).
    last = jnp.where(valid, jnp.minimum(positions, md.kv_lens[seq_ids] - 1), -1)
    first = jnp.zeros_like(last) if sliding_window is None else jnp.maximum(positions - sliding_window + 1, 0)
    if native.usable(k_pages):  # the pages read in place (native.py); padding rows see nothing
        out, lse = native.attend(q, k_pages, v_pages, md.page_indices, seq_ids, first, last, sm_scale=sm_scale,
                                 soft_cap=soft_cap)
        if sinks is not None:  # the sink's share of the denominator, from the log-sum-exp: L / (L + e^sink)
            out = out * jax.nn.sigmoid(lse - sinks.astype(jnp.float32)[None, :])[..., None]
        return out.astype(q.dtype)
    qh = _zero_unless(valid[:, None, None], q).reshape(num_tokens, num_kv_heads, group, head_dim)
    qh = (qh.swapaxes(0, 1) * sm_scale).astype(jnp.float32)  # [KVH, T, G, D]
    parts = _walk(qh, k_pages, v_pages, md.page_indices[seq_ids], first, last, valid, md.num_seqs,
                  soft_cap=soft_cap)
    parts = _with_sinks(parts, sinks)
    return _normalise(parts).swapaxes(0, 1).reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def _walk(qh, k_pages, v_pages, tables, first, last, live, num_seqs, *, soft_cap):
    """Rows ``qh`` [KVH, R, G, D] (already scaled) over keys [first, last] (inclusive, per row) of their own
    page tables ``tables`` [R, P]; rows that are not ``live`` see nothing. Returns (peak, unnormalised out, sum).

    An online softmax from the rows' first visible key to their last, in two loops: whole ``_ROW_KEYS`` steps
    while the keys fill them, then the rest one page at a time. A walk in whole steps only would gather up to a
    step less one page of keys nobody sees (at 256 rows of ~80 keys, a third of what it gathered), a walk in
    single pages only would pay a loop step per page (at 48 rows of ~300 keys, ~15% more than whole steps).
    """
    num_kv_heads, rows, group, head_dim = qh.shape
    page_size = k_pages.shape[2]
    pages_per_step = max(1, min(tables.shape[1], _ROW_KEYS // page_size))
    step_keys = pages_per_step * page_size
    last = jnp.where(live, last, -1)
    first = jnp.where(live, first, jnp.iinfo(jnp.int32).max)
    first_key = jnp.min(first, initial=jnp.iinfo(jnp.int32).max)
    end_key = jnp.max(last, initial=-1) + 1  # one past the last visible key
    # Whole steps [lo, hi): those that end at or before end_key; then pages [tail, end_page) one at a time. A
    # walk of _LONG_WALK whole steps or more takes its rest as one more whole step: there the keys it gathers in
    # vain are a small share, and a loop step per page costs more than they do.
    hi = end_key // step_keys
    lo = jnp.minimum(first_key // step_keys, hi)
    end_page = (end_key + page_size - 1) // page_size
    hi = jnp.where((hi - lo >= _LONG_WALK) & (hi * step_keys < end_key), hi + 1, hi)
    tail = jnp.minimum(jnp.maximum(hi * pages_per_step, first_key // page_size), end_page)
    # Every row's page table, padded by one walk step so the last step's slice stays in bounds.
    tables = _materialize(jnp.pad(tables, ((0, 0), (0, pages_per_step))), num_seqs)
    first, last = _materialize(first, num_seqs), _materialize(last, num_seqs)

    def keys_from(page, count):
        """One step over ``count`` pages (static) from page ``page`` of every row's table."""
        offsets = jnp.arange(count * page_size, dtype=jnp.int32)

        def step(i, parts):
            start = page + i * count
            pages = jax.lax.dynamic_slice_in_dim(tables, start, count, axis=1)  # [R, C]
            key_pos = start * page_size + offsets
            visible = (key_pos[None, :] >= first[:, None]) & (key_pos[None, :] <= last[:, None])  # [R, keys]
            bias = _bias(visible, num_seqs)
            keep = (bias == 0.0)[None, :, :, None]
            shape = (num_kv_heads, rows, count * page_size, head_dim)
            k = _zero_unless(keep, k_pages[:, pages].reshape(shape))
            v = _zero_unless(keep, v_pages[:, pages].reshape(shape))
            scores = _cap(jnp.einsum("ktgd,ktld->ktgl", qh, k.astype(jnp.float32)), soft_cap)
            peak, weights, total = _partial_softmax(scores, bias[None, :, None, :])
            out = jnp.einsum("ktgl,ktld->ktgd", weights, v.astype(jnp.float32))
            return _merge(parts, (peak, out, total))

        return step

    parts = _empty_parts(num_kv_heads, rows, group, head_dim)
    parts = jax.lax.fori_loop(0, hi - lo, keys_from(lo * pages_per_step, pages_per_step), parts)
    return jax.lax.fori_loop(0, end_page - tail, keys_from(tail, 1), parts)


def _native_parts(qh, k_pages, v_pages, tables, first, last, *, sm_scale, soft_cap):
    """Rows ``qh`` [KVH, R, G, D] (not scaled) over keys [first, last] of their own page tables ``tables`` [R, P]
    (last < first: none) by the native kernel, as (peak, unnormalised out, sum) parts: its normalised output with
    the log-sum-exp as the peak and a sum of 1 (0 for a row that saw nothing) merge like the walk's."""
    num_kv_heads, rows, group, head_dim = qh.shape
    q = qh.swapaxes(0, 1).reshape(rows, num_kv_heads * group, head_dim)
    out, lse = native.attend(q, k_pages, v_pages, tables, jnp.arange(rows, dtype=jnp.int32), first, last,
                             sm_scale=sm_scale, soft_cap=soft_cap)
    lse = lse.reshape(rows, num_kv_heads, group).swapaxes(0, 1)
    out = out.reshape(rows, num_kv_heads, group, head_dim).swapaxes(0, 1)
    return lse, out, jnp.isfinite(lse).astype(jnp.float32)


def ragged_paged_attention_chunks(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k: jax.Array,  # [T, num_kv_heads, head_dim]: this step's keys, row for row with q
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # f32[num_q_heads]
    pages_hold_rows: bool = False,
) -> jax.Array:
    """Prompt chunks (the prefill path): the reference's arguments plus this step's own K/V, ``k`` and ``v``,
    one row per query row. The pages must hold every sequence's context before its chunk (the chunk's own
    rows are read from ``k``/``v``, so whether they are written yet does not matter). Result as the reference.

    Where the native kernel runs and the step's own rows are written to the pages already (``pages_hold_rows``,
    as the engine's backend does), a step whose rows see few keys in all (many short prompts) is cheaper row by
    row through the kernel than densely (``rows_are_cheaper``): the choice is made per step, at run time.
    """
    check_shapes(q, k_pages, v_pages, md, sinks)
    if pages_hold_rows and native.usable(k_pages):
        kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
        return jax.lax.cond(
            rows_are_cheaper(md, q.shape[0], sliding_window),
            lambda: ragged_paged_attention_rows(q, k_pages, v_pages, md, **kw),
            lambda: ragged_paged_attention_chunks(q, k, v, k_pages, v_pages, md, **kw))
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k and v must be [{num_tokens}, {num_kv_heads}, {head_dim}] like q's rows, got "
                         f"{k.shape} and {v.shape}")
    group = num_q_heads // num_kv_heads
    num_seqs = md.num_seqs
    seq_ids, positions, valid = token_layout(md, num_tokens)
    # Head-major operands (see _dense_block).
    real = valid[:, None, None]
    qh = _zero_unless(real, q).reshape(num_tokens, num_kv_heads, group, head_dim)
    qh = qh.swapaxes(0, 1).astype(jnp.float32)  # [KVH, T, G, D]
    kh = _zero_unless(real, k).swapaxes(0, 1).astype(jnp.float32)  # [KVH, T, D]
    vh = _zero_unless(real, v).swapaxes(0, 1).astype(jnp.float32)
    kw = dict(sm_scale=sm_scale, soft_cap=soft_cap)

    def own_rows(start, block, keys, rows_ids, rows_pos, rows_ok, rows_q):
        """Query rows [start, start + block) of the ``rows_*`` arrays (``start`` static, or traced within
        arrays padded past the last block) over key rows [0, keys) of this step."""
        take = lambda a, axis=0: jax.lax.dynamic_slice_in_dim(a, start, block, axis)  # noqa: E731
        ids, pos, ok = take(rows_ids), take(rows_pos), take(rows_ok)
        visible = ((ids[:, None] == seq_ids[None, :keys]) & ok[:, None] & valid[None, :keys]
                   & (positions[None, :keys] <= pos[:, None]))  # [block, keys]
        if sliding_window is not None:
            visible &= positions[None, :keys] > pos[:, None] - sliding_window
        return _dense_block(take(rows_q, 1), kh[:, :keys], vh[:, :keys], visible, num_seqs, **kw)

    # (a) Keys of this step: query rows [r0, r1) see key rows [0, r1) of their own sequence, causally. At most
    # _MAX_ROW_SPANS such spans are written out (each its own static key count); inside a span, blocks of rows
    # go one after another so the scores stay within the score budget however many rows the step has.
    spans = min(_MAX_ROW_SPANS, -(-num_tokens // _ROW_BLOCK))
    span_rows = -(-num_tokens // spans)
    parts = []
    for r0 in range(0, num_tokens, span_rows):
        r1 = min(num_tokens, r0 + span_rows)
        block = max(1, min(r1 - r0, _SCORE_BUDGET_BYTES // (3 * 4 * num_kv_heads * group * r1)))
        blocks = -(-(r1 - r0) // block)
        if blocks == 1:
            parts.append(own_rows(r0, block, r1, seq_ids, positions, valid, qh))
            continue
        # [blocks, KVH, block, ...] -> [KVH, rows, ...]
        pad = lambda a, axis=0: jnp.pad(a, [(0, block if i == axis else 0) for i in range(a.ndim)])  # noqa: E731
        padded = (pad(seq_ids), pad(positions), pad(valid), pad(qh, 1))
        done = jax.lax.map(lambda start: own_rows(start, block, r1, *padded), r0 + block * jnp.arange(blocks))
        parts.append(tuple(jnp.moveaxis(x, 0, 1).reshape(num_kv_heads, blocks * block, *x.shape[3:])[:, : r1 - r0]
                           for x in done))
    own = tuple(jnp.concatenate(x, axis=1) for x in zip(*parts))  # [KVH, T, G(, D)]

    # (b) Cached context, sequence by sequence, only for sequences that have any.
    context = _context_part(qh, k_pages, v_pages, md, sm_scale=sm_scale, sliding_window=sliding_window,
                            soft_cap=soft_cap)

    out = _normalise(_with_sinks(_merge(own, context), sinks))
    return out.swapaxes(0, 1).reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def rows_are_cheaper(md: AttentionMetadata, num_tokens: int, sliding_window: int | None = None) -> jax.Array:
    """Whether a prompt step of ``num_tokens`` rows (its bucket) costs less row by row through the native kernel
    than through the chunk path (bool[]), by the measured costs above: the rows path pays for every (row,
    visible key) pair; the chunk path for the square of its rows, whatever they see, and for its rows' cached
    context."""
    slot = jnp.arange(md.kv_lens.shape[0], dtype=jnp.int32)
    live = slot < md.num_seqs[0]
    q_lens = jnp.where(live, md.cu_q_lens[1:] - md.cu_q_lens[:-1], 0).astype(jnp.float32)
    context = jnp.where(live, md.kv_lens, 0).astype(jnp.float32) - q_lens
    own = q_lens * (q_lens + 1) / 2  # each row sees its chunk's rows up to itself
    seen = q_lens * context + own
    if sliding_window is not None:  # at most the window per row
        seen = jnp.minimum(seen, q_lens * sliding_window)
        context = jnp.minimum(context, sliding_window)
    rows_cost = _ROWS_NS_PER_PAIR * jnp.sum(seen)
    single = q_lens == 1
    blocked = jnp.ceil(q_lens / _CONTEXT_ROWS) * _CONTEXT_ROWS  # a chunk's context walk goes a block at a time
    chunk_cost = (_CHUNK_NS_PER_ROW_SQUARED * float(num_tokens) ** 2
                  + _ROWS_NS_PER_PAIR * jnp.sum(jnp.where(single, context, 0.0))
                  + _CHUNK_NS_PER_CONTEXT_PAIR * jnp.sum(jnp.where(single, 0.0, blocked * context))
                  + jnp.where(jnp.any(context > 0), _CHUNK_NS_WITH_CONTEXT, 0.0))
    return rows_cost < chunk_cost


def _context_part(qh, k_pages, v_pages, md: AttentionMetadata, *, sm_scale, sliding_window, soft_cap):
    """Each row over its sequence's context before the chunk: (peak, unnormalised out, sum), [KVH, T, G(, D)].

    Sequences with one row in the step (decode rows riding with prompt chunks) walk their pages together, as
    in the decode path. A longer chunk with context walks its pages ``_CONTEXT_KEYS`` keys at a time, only as
    far as its context goes (online softmax), so the work follows the context, not the page table's width; its
    rows attend ``block`` rows at a time (all T at once unless their scores would pass the score budget; the
    arrays are padded so every block is in bounds). Sequences without context cost nothing.
    """
    num_kv_heads, t, group, head_dim = qh.shape
    cu_q_lens, kv_lens, page_indices, num_seqs = md.cu_q_lens, md.kv_lens, md.page_indices, md.num_seqs
    page_size = k_pages.shape[2]
    tile_pages = max(1, min(page_indices.shape[1], _CONTEXT_KEYS // page_size))
    tile = tile_pages * page_size
    block = max(1, min(t, _CONTEXT_ROWS, _SCORE_BUDGET_BYTES // (3 * 4 * num_kv_heads * group * tile)))
    slot = jnp.arange(kv_lens.shape[0], dtype=jnp.int32)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    context = jnp.where(slot < num_seqs[0], kv_lens - q_lens, 0)
    has_context = (context > 0) & (q_lens > 0)
    single = has_context & (q_lens == 1)
    chunked = has_context & (q_lens > 1)
    order = jnp.argsort(~chunked, stable=True).astype(jnp.int32)  # chunks with context first
    count = jnp.sum(chunked.astype(jnp.int32))
    key_pos = jnp.arange(tile, dtype=jnp.int32)
    offsets = jnp.arange(block, dtype=jnp.int32)
    tables = jnp.pad(page_indices, ((0, 0), (0, tile_pages)))  # the last tile's slice stays in bounds

    def one_sequence(i, carry, q_padded):
        s = order[i]
        start, q_len, ctx = cu_q_lens[s], q_lens[s], context[s]

        def one_block(b, carry):
            first = start + b * block
            rows = b * block + offsets  # within the sequence's chunk
            mine = rows < q_len
            qb = jax.lax.dynamic_slice_in_dim(q_padded, first, block, axis=1)  # [KVH, block, G, D]

            def one_tile(j, parts):
                pages = jax.lax.dynamic_slice_in_dim(tables[s], j * tile_pages, tile_pages)
                pos = j * tile + key_pos
                stored = (pos < ctx)[None, :, None]
                k = _zero_unless(stored, k_pages[:, pages].reshape(num_kv_heads, tile, head_dim))
                v = _zero_unless(stored, v_pages[:, pages].reshape(num_kv_heads, tile, head_dim))
                visible = mine[:, None] & (pos[None, :] < ctx)  # [block, tile]
                if sliding_window is not None:
                    visible &= pos[None, :] > (ctx + rows)[:, None] - sliding_window
                return _merge(parts, _dense_block(qb, k.astype(jnp.float32), v.astype(jnp.float32), visible,
                                                  num_seqs, sm_scale=sm_scale, soft_cap=soft_cap))

            # Tiles holding a key some row of the block may see: from the block's first row's window start.
            lo = 0 if sliding_window is None else jnp.maximum(ctx + b * block - sliding_window + 1, 0) // tile
            new = jax.lax.fori_loop(lo, (ctx + tile - 1) // tile, one_tile,
                                    _empty_parts(num_kv_heads, block, group, head_dim))

            def put(whole, part):
                current = jax.lax.dynamic_slice_in_dim(whole, first, block, axis=1)
                keep = mine.reshape((1, block) + (1,) * (part.ndim - 2))
                return jax.lax.dynamic_update_slice_in_dim(whole, jnp.where(keep, part, current), first, axis=1)

            return tuple(put(w, p) for w, p in zip(carry, new))

        return jax.lax.fori_loop(0, (q_len + block - 1) // block, one_block, carry)

    # Single rows: one walk over the sequence slots, each slot's row being its chunk's first (and only) row; the
    # results land on those rows of the padded parts the chunk loop then fills in.
    starts = cu_q_lens[:-1]
    q_single = qh[:, jnp.minimum(starts, t - 1)]  # [KVH, S, G, D]
    first = jnp.zeros_like(context) if sliding_window is None else jnp.maximum(context - sliding_window + 1, 0)
    if native.usable(k_pages):
        walked = _native_parts(q_single, k_pages, v_pages, page_indices, first, jnp.where(single, context - 1, -1),
                               sm_scale=sm_scale, soft_cap=soft_cap)
    else:
        walked = _walk(q_single * sm_scale, k_pages, v_pages, page_indices, first, context - 1, single, num_seqs,
                       soft_cap=soft_cap)
    rows = jnp.where(single, starts, t + block)  # the others are dropped
    parts = tuple(empty.at[:, rows].set(part, mode="drop")
                  for empty, part in zip(_empty_parts(num_kv_heads, t + block, group, head_dim), walked))

    def chunks():
        q_padded = jnp.pad(qh, ((0, 0), (0, block), (0, 0), (0, 0)))  # blocks start anywhere in [0, T)
        return jax.lax.fori_loop(0, count, lambda i, c: one_sequence(i, c, q_padded), parts)

    return tuple(x[:, :t] for x in jax.lax.cond(count > 0, chunks, lambda: parts))
