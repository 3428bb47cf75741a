"""A prompt step's attention on XLA:CPU: the chunk path against every row through the native kernel.

    PYTHONPATH=. python scripts/bench_cpu_prompt_attention.py [--layouts 4x128,16x32,1x512+1536] \
        [--heads 9/3/64] [--dtype float32]

A layout ``NxL`` is N prompts of L tokens with no cached context; ``NxL+C`` gives each C tokens of context
before its chunk; groups joined by ``&`` make one step (``1x60+200&3x150``: a prompt's last 60 tokens after 200
in an earlier step, and three new prompts); ``--bucket 512`` pads the rows as the engine's step shapes do. The chunk path (``ragged_paged_attention_chunks``) takes the step's own rows densely and
walks the context; the rows path (``ragged_paged_attention_rows``) sends every row through the native kernel
(``native.py``), which reads each row's keys from the pages in place. Prints microseconds per call (one layer),
the median of ``--iters`` calls, and the largest difference between the two results.

``--steps-from MODEL`` takes the layouts from the engine instead: it runs the deep narrow benchmark's workload
(``benchmark_offline.py``'s: 48 prompts of 16-256 tokens, 64 tokens each, 512-token steps) on MODEL, records
every prompt step's metadata (page tables included), and times each step's attention three ways: as the engine
runs it (``pages_hold_rows``: the cost model picks a path), the chunk path, the rows path; then the totals.
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
from scripts import bench_results


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
    p.add_argument("--steps-from", default=None, metavar="MODEL", help="time the prompt steps of the deep narrow "
                   "benchmark's workload on MODEL instead of --layouts")
    bench_results.add_arguments(p)
    args = p.parse_args()
    if not native.active():
        raise SystemExit("the native CPU attention kernel is not available here")
    if args.steps_from:
        return engine_steps(args)
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


def engine_steps(args) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import benchmark_offline

    from jaxserve.config.engine import EngineConfig
    from jaxserve.engine.engine import Engine
    from jaxserve.executor.batch import StepKind

    engine = Engine(EngineConfig(model=args.steps_from, dtype=args.dtype, max_num_seqs=48,
                                 max_num_batched_tokens=512, max_model_len=320, warmup=False,
                                 compilation_cache_dir=None))
    cfg = engine.model_config
    w = benchmark_offline.workload(argparse.Namespace(seed=0, prompt_len="16:256", num_requests=48, output_len=64),
                                   cfg.vocab_size)
    runner, steps = engine.executor.runner, []
    real = runner.run

    def record(kind, batch, *a, **k):
        if kind == StepKind.PREFILL:
            steps.append((batch.token_ids.shape[0], jax.tree.map(np.array, batch.md)))
        return real(kind, batch, *a, **k)

    runner.run = record
    benchmark_offline.run_jaxserve(engine, w)
    runner.run = real
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rng = np.random.default_rng(0)
    pages = 1 + max(int(md.page_indices.max()) for _, md in steps)
    dtype = jnp.dtype(args.dtype)
    kp = jnp.asarray(rng.standard_normal((hkv, pages, engine.executor.config.page_size, d)), dtype)
    vp = jnp.asarray(rng.standard_normal(kp.shape), dtype)
    kw = dict(sm_scale=d ** -0.5)
    paths = {
        "engine": jax.jit(lambda q, k, v, md: ragged_paged_attention_chunks(q, k, v, kp, vp, md,
                                                                             pages_hold_rows=True, **kw)),
        "chunks": jax.jit(lambda q, k, v, md: ragged_paged_attention_chunks(q, k, v, kp, vp, md, **kw)),
        "rows": jax.jit(lambda q, k, v, md: ragged_paged_attention_rows(q, kp, vp, md, **kw)),
    }
    totals = dict.fromkeys(paths, 0.0)
    for tokens, md in steps:
        md = AttentionMetadata(jnp.asarray(md.cu_q_lens.reshape(-1)), jnp.asarray(md.kv_lens.reshape(-1)),
                               jnp.asarray(md.page_indices.reshape(md.page_indices.shape[-2:])),
                               jnp.asarray(md.num_seqs.reshape(-1)))  # one replica's
        q = jnp.asarray(rng.standard_normal((tokens, hq, d)), dtype)
        k = jnp.asarray(rng.standard_normal((tokens, hkv, d)), dtype)
        times = {name: timed(fn, q, k, k, md, iters=args.iters)[0] for name, fn in paths.items()}
        for name, t in times.items():
            totals[name] += t
        q_lens = np.diff(np.asarray(md.cu_q_lens))[: int(md.num_seqs[0])]
        print(f"step of {tokens} rows, {len(q_lens)} sequences ({int(np.sum(q_lens == 1))} single rows): "
              + ", ".join(f"{name} {1e3 * t:6.2f} ms" for name, t in times.items()), flush=True)
    print(f"one layer over the {len(steps)} prompt steps: "
          + ", ".join(f"{name} {1e3 * t:.1f} ms" for name, t in totals.items()))
    figures = bench_results.Results(args)
    for name, t in totals.items():
        figures.add(f"the deep narrow workload's {len(steps)} prompt steps, one layer each: {name} path", 1e3 * t, "ms")
    figures.save()


if __name__ == "__main__":
    main()
