"""Attention sinks (gpt-oss): one learned logit per query head that joins every row's softmax denominator with no
value. The reference against dense NumPy attention, then every other backend (the CPU rows with the native
kernel and with the pure-JAX walk, the CPU chunk path, the TPU, GPU (Triton) and Mosaic GPU kernels in interpret
mode) against the reference, on poisoned batches (tests/attention_cases.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_reference_attention import chunk_rows

from pallas_kernels.ragged_paged_attention import (
    native,
    ragged_paged_attention,
    ragged_paged_attention_chunks,
    ragged_paged_attention_gpu,
    ragged_paged_attention_rows,
    ragged_paged_attention_tpu,
)
from pallas_kernels.ragged_paged_attention.mosaic_gpu import ragged_paged_attention_mosaic_gpu

from attention_cases import MIXED, assert_matches_reference, build_batch, device_args

KW = dict(sm_scale=0.3, sliding_window=5, soft_cap=None)


def dense_with_sinks(q, k, v, scale, window, sinks):
    """q [Lq, H, D] at the last Lq positions of k, v [Lk, KVH, D]; sinks [H]: transformers' gpt-oss eager
    attention (the sink concatenated to the scores, softmax, the sink's column dropped)."""
    lq, h, _ = q.shape
    lk, kvh, _ = k.shape
    k, v = np.repeat(k, h // kvh, axis=1), np.repeat(v, h // kvh, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k).astype(np.float64) * scale
    qpos, kpos = np.arange(lk - lq, lk)[:, None], np.arange(lk)[None, :]
    mask = (kpos <= qpos) & (kpos > qpos - window)
    s = np.where(mask[None], s, -np.inf)
    s = np.concatenate([s, np.broadcast_to(sinks[:, None, None], (h, lq, 1))], axis=-1)
    w = np.exp(s - s.max(-1, keepdims=True))
    w = (w / w.sum(-1, keepdims=True))[..., :-1]
    return np.einsum("hqk,khd->qhd", w, v)


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(3)
    batch, keys, values = build_batch(rng, *MIXED, num_kv_heads=2, group=2, head_dim=16)
    # Large enough to matter: some heads' sink outweighs most of their keys.
    sinks = (2.0 * rng.standard_normal(4)).astype(np.float32)
    want = ragged_paged_attention(**device_args(batch), **KW, sinks=jnp.asarray(sinks))
    return batch, keys, values, sinks, np.asarray(want)


def check(got, case, tol=2e-5):
    batch, _, _, _, want = case
    got = np.asarray(jnp.asarray(got, jnp.float32))
    real = int(batch["cu_q_lens"][batch["num_seqs"][0]])
    np.testing.assert_array_equal(got[real:], 0.0)
    np.testing.assert_allclose(got[:real], want[:real], rtol=tol, atol=tol)


def test_reference_matches_dense_attention_with_sinks(case):
    batch, keys, values, sinks, want = case
    cu, q_lens = batch["cu_q_lens"], MIXED[0]
    plain = np.asarray(ragged_paged_attention(**device_args(batch), **KW))
    for s in range(len(q_lens)):
        rows = slice(cu[s], cu[s + 1])
        np.testing.assert_allclose(want[rows], dense_with_sinks(batch["q"][rows], keys[s], values[s], 0.3, 5, sinks),
                                   rtol=2e-5, atol=2e-5)
    assert not np.allclose(want[: cu[len(q_lens)]], plain[: cu[len(q_lens)]], atol=1e-2)  # the sinks bite
    np.testing.assert_array_equal(want[cu[len(q_lens)]:], 0.0)


@pytest.mark.parametrize("native_rows", ["1", "0"])
def test_cpu_paths_with_sinks(case, native_rows, monkeypatch):
    """The decode rows (the native kernel's output rescaled by its log-sum-exp, or the walk with the sink merged
    as a part) and the chunk path (the sink merged with the chunk's and the context's parts)."""
    monkeypatch.setenv(native.SWITCH, native_rows)
    batch, *_ = case
    args, sinks = device_args(batch), jnp.asarray(case[3])
    check(ragged_paged_attention_rows(**args, **KW, sinks=sinks), case)
    k, v = chunk_rows(batch, *MIXED)
    check(ragged_paged_attention_chunks(args["q"], k, v, args["k_pages"], args["v_pages"], args["md"], **KW,
                                        sinks=sinks), case)


def test_gpu_kernel_with_sinks(case):
    """Split keys (3 splits, some empty): only split 0 starts from the sink, so the merge counts it once."""
    batch, *_ = case
    check(ragged_paged_attention_gpu(**device_args(batch), **KW, sinks=jnp.asarray(case[3]),
                                     block_sizes=dict(block_q=2, block_kv=16, num_splits=3),
                                     interpret=jax.default_backend() != "gpu"), case)


def test_tpu_kernel_with_sinks(case):
    batch, *_ = case
    check(ragged_paged_attention_tpu(**device_args(batch), **KW, sinks=jnp.asarray(case[3]),
                                     block_sizes=dict(block_q=2, block_kv=8), interpret=True), case)


def test_mosaic_gpu_kernel_with_sinks():
    """In the Mosaic GPU interpreter (compiled on a GPU): bf16 (the kernel's wgmma operands), pages of 8 rows, a
    GQA group of 4 (a tile row's sink is its query head's, row r of a tile being head r % group) on two KV heads, a
    window and a soft cap."""
    rng = np.random.default_rng(5)
    batch, _, _ = build_batch(rng, *MIXED, num_kv_heads=2, group=4, head_dim=16, dtype="bfloat16", page_size=8)
    args, sinks = device_args(batch), jnp.asarray(2.0 * rng.standard_normal(8), jnp.float32)
    kw = dict(KW, soft_cap=4.0)
    got = ragged_paged_attention_mosaic_gpu(**args, **kw, sinks=sinks, interpret=jax.default_backend() != "gpu")
    want = ragged_paged_attention(**args, **kw, sinks=sinks)
    assert_matches_reference(got, batch, **kw, ref=want)
    real = int(batch["cu_q_lens"][batch["num_seqs"][0]])
    plain = ragged_paged_attention(**args, **kw)
    assert not np.allclose(np.asarray(want[:real], np.float32), np.asarray(plain[:real], np.float32), atol=0.1)


def test_sinks_shape_is_checked_at_trace_time(case):
    batch, *_ = case
    with pytest.raises(ValueError, match=r"sinks must be \[num_q_heads\]"):
        ragged_paged_attention(**device_args(batch), **KW, sinks=jnp.zeros((3,), jnp.float32))
