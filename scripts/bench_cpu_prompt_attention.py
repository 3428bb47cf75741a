"""A prompt step's attention on XLA:CPU: the chunk path against every row through the native kernel.

    PYTHONPATH=. python scripts/bench_cpu_prompt_attention.py [--layouts 4x128,16x32,1x512+1536] \
        [--heads 9/3/64] [--dtype float32]

A layout ``NxL`` is N prompts of L tokens with no cached context; ``NxL+C`` gives each C tokens of context
before its chunk. The chunk path (``ragged_paged_attention_chunks``) takes the step's own rows densely and
walks the context; the rows path (``ragged_paged_attention_rows``) sends every row through the native kernel
(``native.py``), which reads each row's keys from the pages in place. Prints microseconds per call (one layer),
the median of ``--iters`` calls, and the largest difference between the two results.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.ragged_paged_attention import (
    native,
    ragged_paged_attention_chunks,
    ragged_paged_attention_rows,
)


def build(layout: str, heads: tuple[int, int, int], dtype, page_size: int, rng):
    """(q, k, v, k_pages, v_pages, md) of one step: the pages hold every row's K/V (context and chunk)."""
    count, rest = layout.split("x")
    q_len, _, ctx = rest.partition("+")
    count, q_len, ctx = int(count), int(q_len), int(ctx or 0)
    hq, hkv, d = heads
    kv_len = ctx + q_len
    per_seq = -(-kv_len // page_size)
    num_pages = count * per_seq + 1
    tokens = count * q_len
    k_pages = jnp.asarray(rng.standard_normal((hkv, num_pages, page_size, d)), dtype)
    v_pages = jnp.asarray(rng.standard_normal((hkv, num_pages, page_size, d)), dtype)
    tables = np.arange(count * per_seq, dtype=np.int32).reshape(count, per_seq) + 1
    # This step's rows are the last q_len positions of each sequence's pages.
    pos = ctx + np.arange(q_len)
    page = tables[:, pos // page_size]  # [count, q_len]
    slot = np.broadcast_to(pos % page_size, page.shape)
    k = k_pages[:, page.reshape(-1), slot.reshape(-1)].swapaxes(0, 1)  # [T, hkv, d]
    v = v_pages[:, page.reshape(-1), slot.reshape(-1)].swapaxes(0, 1)
    q = jnp.asarray(rng.standard_normal((tokens, hq, d)), dtype)
    md = AttentionMetadata(jnp.asarray(np.arange(count + 1) * q_len, jnp.int32),
                           jnp.full((count,), kv_len, jnp.int32), jnp.asarray(tables), jnp.asarray([count], jnp.int32))
    return q, k, v, k_pages, v_pages, md


def timed(fn, *args, iters: int) -> tuple[float, jax.Array]:
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="4x128,16x32,2x256,1x512,1x512+1536")
    p.add_argument("--heads", default="9/3/64", help="query heads / KV heads / head_dim")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=9)
    args = p.parse_args()
    if not native.active():
        raise SystemExit("the native CPU attention kernel is not available here")
    heads = tuple(int(x) for x in args.heads.split("/"))
    kw = dict(sm_scale=heads[2] ** -0.5)
    chunks = jax.jit(lambda q, k, v, kp, vp, md: ragged_paged_attention_chunks(q, k, v, kp, vp, md, **kw))
    rows = jax.jit(lambda q, k, v, kp, vp, md: ragged_paged_attention_rows(q, kp, vp, md, **kw))
    rng = np.random.default_rng(0)
    for layout in args.layouts.split(","):
        case = build(layout, heads, jnp.dtype(args.dtype), args.page_size, rng)
        t_chunks, a = timed(chunks, *case, iters=args.iters)
        t_rows, b = timed(rows, *case, iters=args.iters)
        diff = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        print(f"{layout:>12} {args.dtype}: chunks {1e6 * t_chunks:9.0f} us, native rows {1e6 * t_rows:9.0f} us "
              f"({t_chunks / t_rows:.2f}x), max diff {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
