"""The reference ragged paged attention against dense attention written in NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import build_batch, device_args, metadata

from pallas_kernels.ragged_paged_attention import cpu as cpu_attention
from pallas_kernels.ragged_paged_attention import native
from pallas_kernels.ragged_paged_attention import (AttentionMetadata, check_values, ragged_paged_attention,
                                                  ragged_paged_attention_chunks, ragged_paged_attention_rows, write_kv)


def dense_attention(q, k, v, scale, window=None, soft_cap=None):
    """q: [Lq, H, D] at the last Lq positions of k, v: [Lk, KVH, D]."""
    lq, h, _ = q.shape
    lk, kvh, _ = k.shape
    k = np.repeat(k, h // kvh, axis=1)
    v = np.repeat(v, h // kvh, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k).astype(np.float64) * scale
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    qpos = np.arange(lk - lq, lk)[:, None]
    kpos = np.arange(lk)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    s = np.where(mask[None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", w, v)


def make_case(rng, q_lens, kv_lens, **kw):
    """A poisoned ragged batch (see attention_cases.build_batch) with small heads."""
    return build_batch(rng, q_lens, kv_lens, head_dim=16, **kw)


@pytest.mark.parametrize("window,soft_cap", [(None, None), (5, None), (None, 3.0), (7, 2.0)])
def test_reference_matches_dense(window, soft_cap):
    rng = np.random.default_rng(0)
    q_lens = [1, 5, 1, 4, 8, 1, 3]
    kv_lens = [1, 5, 9, 8, 17, 4, 12]  # page edges: 4, 8 and 17 = 4*4+1
    case, keys, values = make_case(rng, q_lens, kv_lens)
    scale = 0.3
    out = np.asarray(ragged_paged_attention(**device_args(case), sm_scale=scale, sliding_window=window,
                                            soft_cap=soft_cap))
    assert np.all(np.isfinite(out))
    cu = case["cu_q_lens"]
    for s in range(len(q_lens)):
        want = dense_attention(case["q"][cu[s] : cu[s + 1]], keys[s], values[s], scale, window, soft_cap)
        np.testing.assert_allclose(out[cu[s] : cu[s + 1]], want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(out[cu[len(q_lens)] :], 0.0)


def test_write_kv_touches_only_its_slots():
    rng = np.random.default_rng(1)
    q_lens, kv_lens = [3, 1, 6], [3, 9, 10]
    case, _, _ = make_case(rng, q_lens, kv_lens, page_size=4)
    k_before = np.nan_to_num(case["k_pages"], nan=7.0)
    total = case["q"].shape[0]
    new_k = rng.standard_normal((total, 2, 16)).astype(np.float32)
    new_v = rng.standard_normal((total, 2, 16)).astype(np.float32)
    k_after, v_after = write_kv(jnp.asarray(k_before), jnp.asarray(k_before), jnp.asarray(new_k), jnp.asarray(new_v),
                                metadata(case))
    k_after, v_after = np.asarray(k_after), np.asarray(v_after)
    expected_k, expected_v = k_before.copy(), k_before.copy()
    cu = case["cu_q_lens"]
    for s, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        for i in range(ql):
            pos = kl - ql + i
            page = case["page_indices"][s, pos // 4]
            expected_k[:, page, pos % 4] = new_k[cu[s] + i]
            expected_v[:, page, pos % 4] = new_v[cu[s] + i]
    np.testing.assert_array_equal(k_after, expected_k)
    np.testing.assert_array_equal(v_after, expected_v)


def test_check_values_rejects_foreign_pages_and_overlong_kv():
    rng = np.random.default_rng(2)
    case, _, _ = make_case(rng, [2, 1], [6, 3])
    check = lambda c: check_values(metadata(c, np.asarray), num_tokens=c["q"].shape[0],  # noqa: E731
                                   num_pages=c["k_pages"].shape[1], page_size=4)
    check(case)
    bad = dict(case, page_indices=case["page_indices"].copy())
    bad["page_indices"][0, 1] = case["k_pages"].shape[1]
    with pytest.raises(ValueError, match=f"page index {case['k_pages'].shape[1]}"):
        check(bad)
    bad = dict(case, kv_lens=case["kv_lens"].copy())
    bad["kv_lens"][1] = 100
    with pytest.raises(ValueError, match="kv_len=100"):
        check(bad)


@pytest.mark.parametrize("slot,value", [((1, 0), -2), ((0, 1), -1)])
def test_check_values_rejects_negative_page_indices(slot, value):
    """Page indices below the pool are as foreign as those past it."""
    rng = np.random.default_rng(8)
    case, _, _ = make_case(rng, [2, 1], [6, 3])
    bad = dict(case, page_indices=case["page_indices"].copy())
    bad["page_indices"][slot] = value
    with pytest.raises(ValueError, match=f"page index {value}"):
        check_values(metadata(bad, np.asarray), num_tokens=bad["q"].shape[0], num_pages=bad["k_pages"].shape[1],
                     page_size=4)


def chunk_rows(case, q_lens, kv_lens):
    """This step's K/V, row for row with q (read back from the pages); padding rows NaN."""
    cu, page_size = case["cu_q_lens"], case["k_pages"].shape[2]
    num_kv_heads, _, _, head_dim = case["k_pages"].shape
    k = np.full((case["q"].shape[0], num_kv_heads, head_dim), np.nan, np.float32)
    v = k.copy()
    for s, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        for i in range(ql):
            pos = kl - ql + i
            page = case["page_indices"][s, pos // page_size]
            k[cu[s] + i] = case["k_pages"][:, page, pos % page_size]
            v[cu[s] + i] = case["v_pages"][:, page, pos % page_size]
    return jnp.asarray(k), jnp.asarray(v)


# (q_lens, kv_lens): decode rows, prompt chunks with and without earlier context, a zero-length entry, page edges.
CPU_BATCHES = [
    ([1, 1, 1, 0, 1, 1], [9, 16, 1, 5, 33, 4]),
    ([5, 8, 3, 0, 7], [5, 20, 12, 4, 8]),
    ([1, 5, 1, 4, 8, 1, 3], [1, 5, 9, 8, 17, 4, 12]),
    ([9, 2], [40, 2]),
]


@pytest.mark.parametrize("lengths", CPU_BATCHES)
@pytest.mark.parametrize("window,soft_cap", [(None, None), (5, 2.0), (7, None)])
@pytest.mark.parametrize("native_rows", ["1", "0"])
def test_cpu_paths_match_reference(lengths, window, soft_cap, native_rows, monkeypatch):
    """The CPU engine's decode path (the native kernel, or the pure-JAX walk with the switch off) and chunk path
    give the reference's result on poisoned batches."""
    monkeypatch.setenv(native.SWITCH, native_rows)
    rng = np.random.default_rng(4)
    q_lens, kv_lens = lengths
    case, _, _ = make_case(rng, q_lens, kv_lens)
    args = device_args(case)
    kw = dict(sm_scale=0.3, sliding_window=window, soft_cap=soft_cap)
    want = np.asarray(ragged_paged_attention(**args, **kw))
    np.testing.assert_allclose(np.asarray(ragged_paged_attention_rows(**args, **kw)), want, rtol=2e-5, atol=2e-5)
    k, v = chunk_rows(case, q_lens, kv_lens)
    got = np.asarray(ragged_paged_attention_chunks(args["q"], k, v, args["k_pages"], args["v_pages"], args["md"], **kw))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # As the engine calls it (its rows in the pages already): the cheaper of the rows path and the chunk path.
    got = ragged_paged_attention_chunks(args["q"], k, v, args["k_pages"], args["v_pages"], args["md"],
                                        pages_hold_rows=True, **kw)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_prompt_step_path_by_cost():
    """Prompts go row by row through the native kernel's tiles; a long chunk over a long cached context stays on the
    chunk path (the bench's layouts at a 512-row bucket: scripts/bench_cpu_prompt_attention.py)."""
    def md(q_lens, kv_lens, slots=64):
        pad = slots - len(q_lens)
        cu = np.concatenate([[0], np.cumsum(q_lens), np.full(pad, sum(q_lens))]).astype(np.int32)
        return AttentionMetadata(jnp.asarray(cu), jnp.asarray(list(kv_lens) + [0] * pad, jnp.int32),
                                 jnp.zeros((slots, 4), jnp.int32), jnp.asarray([len(q_lens)], jnp.int32))

    cheaper = lambda q_lens, kv_lens, **kw: bool(cpu_attention.rows_are_cheaper(md(q_lens, kv_lens), 512, **kw))  # noqa: E731
    assert cheaper([32] * 16, [32] * 16)  # measured 6.5x faster row by row
    assert cheaper([128] * 4, [128] * 4)  # 2.9x
    assert cheaper([256] * 2, [256] * 2)  # 1.7x
    assert not cheaper([512], [2048])  # 0.73x: a long chunk over a long context stays dense
    assert cheaper([1] * 48, [300] * 48)  # decode rows riding in a prompt step
    assert cheaper([512], [512], sliding_window=16)  # a short window sees few keys per row


    # A step as the deep narrow benchmark makes them: 15 decode rows riding along, a prompt's second chunk over
    # its first (168 rows after 23), three new prompts; the rows path measured 8.0 against the chunk path's 12.2 ms.
    ctx = [224, 172, 141, 83, 92, 27, 36, 21, 60, 212, 173, 236, 137, 162, 249]
    assert cheaper([1] * 15 + [168, 168, 147, 14], [c + 1 for c in ctx] + [191, 168, 147, 14])


def _dot_rows(jaxpr) -> list[int]:
    """The row counts (lhs dimension before the contracted one) of every dot in ``jaxpr``, nested ones too."""
    rows = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            rows.append(eqn.invars[0].aval.shape[-2])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else [value]:
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's
                if hasattr(sub, "eqns"):
                    rows += _dot_rows(sub)
    return rows


def test_a_short_chunk_over_its_context_takes_a_block_of_rows_not_the_step():
    """The context walk multiplies ``_CONTEXT_ROWS`` query rows at a time: a 25-row chunk after 186 cached tokens,
    in a 512-row step, costs a block of rows per key tile, not all 512 (which took ~3x its time)."""
    rng = np.random.default_rng(3)
    q_lens, kv_lens = [25, 235, 172], [211, 235, 172]
    case, _, _ = make_case(rng, q_lens, kv_lens, page_size=16, pad_tokens=512 - sum(q_lens))
    args = device_args(case)
    k, v = chunk_rows(case, q_lens, kv_lens)
    jaxpr = jax.make_jaxpr(lambda *a: ragged_paged_attention_chunks(*a, sm_scale=0.3))(
        args["q"], k, v, args["k_pages"], args["v_pages"], args["md"])
    group = args["q"].shape[1] // args["k_pages"].shape[0]
    rows = _dot_rows(jaxpr.jaxpr)
    assert cpu_attention._CONTEXT_ROWS * group in rows  # the context walk's blocks
    assert max(rows) <= cpu_attention._ROW_BLOCK * group  # nothing takes the step's 512 rows at once


@pytest.mark.parametrize("budget", [None, 12 * 1024])
def test_chunk_path_blocks_and_long_context(budget, monkeypatch):
    """More rows than one query span (the causal bound), spans split into blocks of rows when their scores would
    pass the budget (forced small here), and contexts longer than one walk step."""
    if budget is not None:
        monkeypatch.setattr(cpu_attention, "_SCORE_BUDGET_BYTES", budget)
    rng = np.random.default_rng(5)
    q_lens, kv_lens = [150, 1, 90, 30], [170, 70, 90, 100]
    case, _, _ = make_case(rng, q_lens, kv_lens, page_size=8, pad_tokens=20)
    args = device_args(case)
    want = np.asarray(ragged_paged_attention(**args, sm_scale=0.2))
    k, v = chunk_rows(case, q_lens, kv_lens)
    got = np.asarray(ragged_paged_attention_chunks(args["q"], k, v, args["k_pages"], args["v_pages"], args["md"],
                                                   sm_scale=0.2))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(ragged_paged_attention_rows(**args, sm_scale=0.2)), want, rtol=2e-5,
                               atol=2e-5)


@pytest.mark.parametrize("row_keys, page_size", [(8, 4), (4, 8)])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_walk_takes_whole_steps_then_single_pages(row_keys, page_size, window, monkeypatch):
    """The decode walk in whole steps of ``_ROW_KEYS`` keys while the keys fill them, then the rest a page at a
    time (two pages per step, or steps of a single page when a page holds more than ``_ROW_KEYS``), rows ending
    inside and at the edge of a step, windows starting in a later step, and a row long enough (45 keys: five
    whole steps and a part) that the walk takes its part as one more whole step: the reference's result."""
    monkeypatch.setattr(cpu_attention, "_ROW_KEYS", row_keys)
    monkeypatch.setenv(native.SWITCH, "0")
    rng = np.random.default_rng(8)
    q_lens, kv_lens = [1, 1, 1, 1, 1, 0, 1], [8, 17, 31, 3, 24, 4, 45]
    case, _, _ = make_case(rng, q_lens, kv_lens, page_size=page_size)
    args = device_args(case)
    kw = dict(sm_scale=0.3, sliding_window=window)
    np.testing.assert_allclose(np.asarray(ragged_paged_attention_rows(**args, **kw)),
                               np.asarray(ragged_paged_attention(**args, **kw)), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("context_rows", [64, 4])
def test_chunk_context_walks_several_tiles(window, context_rows, monkeypatch):
    """A chunk's cached context walked a few pages at a time (two pages per step here, so contexts of up to 40
    keys take several steps, and a window skips the steps before it), its rows a block at a time (4 rows per
    block: the 5- and 9-row chunks take two and three): the reference's result."""
    monkeypatch.setattr(cpu_attention, "_CONTEXT_KEYS", 8)
    monkeypatch.setattr(cpu_attention, "_CONTEXT_ROWS", context_rows)
    rng = np.random.default_rng(7)
    q_lens, kv_lens = [5, 1, 9, 3, 0], [33, 17, 40, 12, 4]
    case, _, _ = make_case(rng, q_lens, kv_lens)
    args = device_args(case)
    want = np.asarray(ragged_paged_attention(**args, sm_scale=0.3, sliding_window=window))
    k, v = chunk_rows(case, q_lens, kv_lens)
    got = np.asarray(ragged_paged_attention_chunks(args["q"], k, v, args["k_pages"], args["v_pages"], args["md"],
                                                   sm_scale=0.3, sliding_window=window))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_chunk_path_checks_its_rows():
    rng = np.random.default_rng(6)
    case, _, _ = make_case(rng, [2, 1], [6, 3])
    args = device_args(case)
    k, _ = chunk_rows(case, [2, 1], [6, 3])
    with pytest.raises(ValueError, match="k and v must be"):
        ragged_paged_attention_chunks(args["q"], k[:-1], k[:-1], args["k_pages"], args["v_pages"], args["md"],
                                      sm_scale=0.3)


def test_chunk_path_scores_stay_within_budget():
    """A long-context prompt chunk: the compiled program's scratch stays bounded by the score budget, where one
    [rows x context] score window per sequence needed 8.6 GiB here."""
    rows, heads, kv_heads, head_dim, page_size, pages_per_seq, slots = 4096, 32, 8, 64, 16, 512, 4
    f32, i32 = jnp.float32, jnp.int32
    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in [
        ((rows, heads, head_dim), f32), ((rows, kv_heads, head_dim), f32), ((rows, kv_heads, head_dim), f32),
        ((kv_heads, slots * pages_per_seq, page_size, head_dim), f32),
        ((kv_heads, slots * pages_per_seq, page_size, head_dim), f32)]]
    shapes.append(AttentionMetadata(*(jax.ShapeDtypeStruct(s, i32) for s in [
        (slots + 1,), (slots,), (slots, pages_per_seq), (1,)])))
    fn = jax.jit(lambda *a: ragged_paged_attention_chunks(*a, sm_scale=0.125))
    temp = fn.lower(*shapes).compile().memory_analysis().temp_size_in_bytes
    assert temp < 1.5 * 2**30, f"{temp / 2**30:.1f} GiB of scratch"
