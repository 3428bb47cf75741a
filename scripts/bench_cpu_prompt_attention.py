"""A prompt step's attention on XLA:CPU: the chunk path against every row through the native kernel.

    PYTHONPATH=. python scripts/bench_cpu_prompt_attention.py [--layouts 4x128,16x32,1x512+1536] \
        [--heads 9/3/64] [--dtype float32]

A layout ``NxL`` is N prompts of L tokens with no cached context; ``NxL+C`` gives each C tokens of context
before its chunk; groups joined by ``&`` make one step (``1x60+200&3x150``: a prompt's last 60 tokens after 200
in an earlier step, and three new prompts); ``--bucket 512`` pads the rows as the engine's step shapes do. The chunk path (``ragged_paged_attention_chunks``) takes the step's own rows densely and
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


def build(layout: str, heads: tuple[int, int, int], dtype, page_size: int, rng, bucket: int = 0):
    """(q, k, v, k_pages, v_pages, md) of one step: the pages hold every row's K/V (context and chunk). ``layout``
    is one or more ``NxL[+C]`` groups joined by ``&`` (a step mixing them); ``bucket`` pads the rows to that many,
    as the engine's step shapes do."""
    seqs = []  # (q_len, ctx) per sequence
    for group in layout.split("&"):
        count, rest = group.split("x")
        q_len, _, ctx = rest.partition("+")
        seqs += [(int(q_len), int(ctx or 0))] * int(count)
    hq, hkv, d = heads
    per_seq = max(-(-(ctx + q_len) // page_size) for q_len, ctx in seqs)
    num_pages = len(seqs) * per_seq + 1
    tokens = sum(q_len for q_len, _ in seqs)
    rows = max(tokens, bucket)
    k_pages = jnp.asarray(rng.standard_normal((hkv, num_pages, page_size, d)), dtype)
    v_pages = jnp.asarray(rng.standard_normal((hkv, num_pages, page_size, d)), dtype)
    tables = np.arange(len(seqs) * per_seq, dtype=np.int32).reshape(len(seqs), per_seq) + 1
    # This step's rows are the last q_len positions of each sequence's pages.
    page = np.concatenate([tables[i, (ctx + np.arange(q_len)) // page_size] for i, (q_len, ctx) in enumerate(seqs)])
    slot = np.concatenate([(ctx + np.arange(q_len)) % page_size for q_len, ctx in seqs])
    pad = rows - tokens
    k = jnp.pad(k_pages[:, page, slot].swapaxes(0, 1), ((0, pad), (0, 0), (0, 0)))  # [T, hkv, d]
    v = jnp.pad(v_pages[:, page, slot].swapaxes(0, 1), ((0, pad), (0, 0), (0, 0)))
    q = jnp.asarray(rng.standard_normal((rows, hq, d)), dtype)
    cu = np.concatenate([[0], np.cumsum([q_len for q_len, _ in seqs])])
    md = AttentionMetadata(jnp.asarray(cu, jnp.int32), jnp.asarray([c + n for n, c in seqs], jnp.int32),
                           jnp.asarray(tables), jnp.asarray([len(seqs)], jnp.int32))
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
    p.add_argument("--bucket", type=int, default=0, help="pad each step's rows to this many (the engine's bucket)")
    args = p.parse_args()
    if not native.active():
        raise SystemExit("the native CPU attention kernel is not available here")
    heads = tuple(int(x) for x in args.heads.split("/"))
    kw = dict(sm_scale=heads[2] ** -0.5)
    chunks = jax.jit(lambda q, k, v, kp, vp, md: ragged_paged_attention_chunks(q, k, v, kp, vp, md, **kw))
    rows = jax.jit(lambda q, k, v, kp, vp, md: ragged_paged_attention_rows(q, kp, vp, md, **kw))
    rng = np.random.default_rng(0)
    for layout in args.layouts.split(","):
        case = build(layout, heads, jnp.dtype(args.dtype), args.page_size, rng, args.bucket)
        t_chunks, a = timed(chunks, *case, iters=args.iters)
        t_rows, b = timed(rows, *case, iters=args.iters)
        diff = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        print(f"{layout:>20} {args.dtype}: chunks {1e6 * t_chunks:9.0f} us, native rows {1e6 * t_rows:9.0f} us "
              f"({t_chunks / t_rows:.2f}x), max diff {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
