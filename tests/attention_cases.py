"""Ragged batches for the kernel tests, and the checks shared by the TPU and GPU kernel tests.

Batches are built to make stray reads fail: pages no sequence uses and the unused tail of every page are NaN,
page-table entries past a sequence's pages and the metadata of padding slots are out-of-range garbage, padding
query rows are NaN, and each sequence's pages are shuffled across the pool.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention import AttentionMetadata, ragged_paged_attention, write_kv

TOLERANCE = {"float32": dict(rtol=2e-5, atol=2e-5), "bfloat16": dict(rtol=2e-2, atol=2e-2)}

# (q_lens, kv_lens); every list has a zero-length entry and kv lengths on and next to page edges (page_size 4).
DECODE = ([1, 1, 1, 0, 1, 1], [9, 16, 1, 5, 33, 4])
PREFILL = ([5, 8, 3, 0, 7], [5, 20, 12, 4, 8])
MIXED = ([1, 6, 0, 1, 9, 3, 1], [17, 6, 3, 8, 24, 12, 1])

# (lengths, group, head_dim, dtype, sliding_window, soft_cap), shared by both kernels' tests (which then share
# the reference's compilations). Every GQA ratio, head dim, dtype and batch kind appears; the block-size and
# random-batch tests add group 1 and 8 with multi-token tiles.
CONFIGS = [
    (DECODE, 1, 64, "float32", None, None),
    (DECODE, 8, 128, "bfloat16", 6, None),
    (PREFILL, 2, 128, "float32", None, 2.5),
    (PREFILL, 4, 64, "bfloat16", None, None),
    (MIXED, 4, 128, "float32", 5, 3.0),
    (MIXED, 2, 64, "bfloat16", 7, None),
]


def build_batch(rng, q_lens, kv_lens, *, num_kv_heads=2, group=2, head_dim=64, page_size=4, dtype="float32",
                pad_tokens=3, pad_slots=2, spare_pages=6, extra_page_slots=2):
    """A batch as a dict of NumPy arrays (q, k_pages, v_pages and the metadata fields), plus each live sequence's
    keys/values ([kv_len, KVH, D] lists)."""
    num_live = len(q_lens)
    slots = num_live + pad_slots
    needed = [-(-kv // page_size) for kv in kv_lens]
    pages_per_seq = max(needed + [1]) + extra_page_slots
    num_pages = sum(needed) + spare_pages
    k_pages = np.full((num_kv_heads, num_pages, page_size, head_dim), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    free = list(rng.permutation(num_pages))
    # Entries a kernel must never dereference: out of range in both directions.
    page_indices = rng.choice(np.array([-3, num_pages, num_pages + 17, 2**30], np.int32), (slots, pages_per_seq))
    page_indices = page_indices.astype(np.int32)
    keys, values = [], []
    for s, kv in enumerate(kv_lens):
        pages = [free.pop() for _ in range(needed[s])]
        page_indices[s, : needed[s]] = pages
        k = rng.standard_normal((kv, num_kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((kv, num_kv_heads, head_dim)).astype(np.float32)
        for t in range(kv):
            k_pages[:, pages[t // page_size], t % page_size] = k[t]
            v_pages[:, pages[t // page_size], t % page_size] = v[t]
        keys.append(k)
        values.append(v)
    cu = np.zeros(slots + 1, np.int32)
    cu[1 : num_live + 1] = np.cumsum(q_lens)
    cu[num_live + 1 :] = cu[num_live]
    num_tokens = int(cu[num_live]) + pad_tokens
    q = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)).astype(np.float32)
    q[cu[num_live] :] = np.nan
    kv = rng.integers(10**6, 2 * 10**6, slots).astype(np.int32)
    kv[:num_live] = kv_lens
    batch = dict(q=q, k_pages=k_pages, v_pages=v_pages, cu_q_lens=cu, kv_lens=kv, page_indices=page_indices,
                 num_seqs=np.array([num_live], np.int32))
    for name in ("q", "k_pages", "v_pages"):
        batch[name] = np.asarray(jnp.asarray(batch[name], dtype))
    return batch, keys, values


def random_lengths(rng, num_seqs, *, page_size, max_q=9, max_kv=40):
    """A mix of decode rows, prefill chunks, zero-length entries and kv lengths on page boundaries."""
    q_lens, kv_lens = [], []
    for _ in range(num_seqs):
        kind = rng.integers(4)
        q = [1, int(rng.integers(2, max_q + 1)), 0, 1][kind]
        if rng.random() < 0.4:
            kv = page_size * int(rng.integers(1, max_kv // page_size + 1)) + int(rng.choice([-1, 0, 1]))
        else:
            kv = int(rng.integers(1, max_kv + 1))
        q_lens.append(q)
        kv_lens.append(max(kv, q, 1))
    return q_lens, kv_lens


def random_batch(rng, *, slots=8, tokens=40, pages_per_seq=12, num_pages=100, page_size=4, **kwargs):
    """A random batch with fixed padded shapes, so that a loop of them compiles a kernel once."""
    live = int(rng.integers(1, slots + 1))
    q_lens, kv_lens = random_lengths(rng, live, page_size=page_size, max_kv=(pages_per_seq - 1) * page_size)
    while sum(q_lens) > tokens:
        q_lens[int(np.argmax(q_lens))] -= 1
    used = [-(-kv // page_size) for kv in kv_lens]
    batch, _, _ = build_batch(rng, q_lens, kv_lens, page_size=page_size, pad_slots=slots - live,
                              pad_tokens=tokens - sum(q_lens), spare_pages=num_pages - sum(used),
                              extra_page_slots=pages_per_seq - max(used), **kwargs)
    assert batch["q"].shape[0] == tokens and batch["page_indices"].shape == (slots, pages_per_seq)
    return batch


def metadata(batch, to=jnp.asarray):
    """The batch's ``AttentionMetadata`` (device arrays; ``to=np.asarray`` for the host's NumPy form)."""
    return AttentionMetadata(*(to(batch[n]) for n in ("cu_q_lens", "kv_lens", "page_indices", "num_seqs")))


def device_args(batch):
    """The batch as the kernels' leading arguments: ``dict(q, k_pages, v_pages, md)`` of device arrays."""
    return dict({k: jnp.asarray(batch[k]) for k in ("q", "k_pages", "v_pages")}, md=metadata(batch))


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def reference_attention(q, k_pages, v_pages, md, *, sm_scale, sliding_window=None, soft_cap=None):
    return ragged_paged_attention(q, k_pages, v_pages, md, sm_scale=sm_scale, sliding_window=sliding_window,
                                  soft_cap=soft_cap)


def assert_matches_reference(out, batch, *, sm_scale, sliding_window=None, soft_cap=None, ref=None):
    """Kernel output vs the reference, per dtype tolerance; real rows must be finite, padding rows exactly 0."""
    if ref is None:
        ref = reference_attention(**device_args(batch), sm_scale=sm_scale, sliding_window=sliding_window,
                                  soft_cap=soft_cap)
    out = np.asarray(jnp.asarray(out, jnp.float32))
    ref = np.asarray(jnp.asarray(ref, jnp.float32))
    real = int(batch["cu_q_lens"][batch["num_seqs"][0]])
    assert out.shape == batch["q"].shape
    assert np.all(np.isfinite(out[:real])), "non-finite output in a real row"
    np.testing.assert_array_equal(out[real:], 0.0)
    np.testing.assert_allclose(out[:real], ref[:real], **TOLERANCE[jnp.dtype(batch["q"].dtype).name])
    return ref


def new_rows(rng, batch):
    """Random new K/V rows for every query row of the batch (padding rows included, to prove they are not
    written)."""
    num_tokens = batch["q"].shape[0]
    num_kv_heads, _, _, head_dim = batch["k_pages"].shape
    dtype = batch["k_pages"].dtype
    make = lambda: np.asarray(jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads, head_dim)), dtype))
    return make(), make()


def assert_write_matches(write_fn, batch, new_k, new_v):
    """Run a KV-write kernel and check it page by page against ``reference.write_kv``.

    Pages of the written sequences must hold the new rows at their slots and be unchanged elsewhere; every
    other page must be byte-identical (NaN poison included) before and after.
    """
    args = device_args(batch)
    k_before, v_before = batch["k_pages"], batch["v_pages"]
    got = write_fn(args["k_pages"], args["v_pages"], jnp.asarray(new_k), jnp.asarray(new_v), args["md"])
    want = write_kv(args["k_pages"], args["v_pages"], jnp.asarray(new_k), jnp.asarray(new_v), args["md"])
    page_size = k_before.shape[2]
    touched = set()
    cu, kv_lens, pages = batch["cu_q_lens"], batch["kv_lens"], batch["page_indices"]
    for s in range(int(batch["num_seqs"][0])):
        q_len = cu[s + 1] - cu[s]
        for pos in range(kv_lens[s] - q_len, kv_lens[s]):
            touched.add(int(pages[s, pos // page_size]))
    assert touched or int(cu[batch["num_seqs"][0]]) == 0
    for before, got_pages, want_pages in ((k_before, got[0], want[0]), (v_before, got[1], want[1])):
        got_pages, want_pages = np.asarray(got_pages), np.asarray(want_pages)
        as_bytes = lambda a: a.view(np.uint8)
        for p in range(before.shape[1]):
            expected = want_pages[:, p] if p in touched else before[:, p]
            assert np.array_equal(as_bytes(got_pages[:, p]), as_bytes(expected)), f"page {p} differs"
            if p in touched:
                assert not np.array_equal(as_bytes(got_pages[:, p]), as_bytes(before[:, p])), f"page {p} unwritten"
    return touched
