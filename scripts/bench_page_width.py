"""What a prefill step costs at the one page-table width every step now uses, against the narrow width a page
ladder would have given it (the CPU path).

    python scripts/bench_page_width.py --model PATH [--max-model-len 2048] [--prompts 4] [--chunk 128]
        [--context 0,256] [--repeats 7]

One process, the executor built without warm-up; for each context length, a prefill step of ``--prompts``
chunks of ``--chunk`` new tokens each (with ``--context`` tokens already in the cache before each chunk, so
the chunk's attention walks them) plus as many decode rows riding along, run at the narrowest page bucket
that holds it and at the full width (``StepShapes.step_pages``), the two alternating; it prints the median
step time of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

from jaxserve.config.engine import EngineConfig
from jaxserve.executor.batch import MeshBatch, StepBatch, StepKind
from jaxserve.executor.executor import Executor


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=120)
    ap.add_argument("--context", default="0,256")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    ex = Executor(EngineConfig(model=args.model, max_model_len=args.max_model_len, warmup=False,
                               compilation_cache_dir=None), model_path=args.model)
    shapes, runner, page = ex.shapes, ex.runner, ex.cache_config.page_size
    for context in map(int, args.context.split(",")):
        chunks, kv_lens, tables, next_page = [], [], [], 1
        for i in range(args.prompts * 2):  # chunks, then one decode row each
            new = args.chunk if i < args.prompts else 1
            kv = context + new
            n = -(-kv // page)
            chunks.append([5] * new)
            kv_lens.append(kv)
            tables.append(list(range(next_page, next_page + n)))
            next_page += n
        tokens = shapes.token_bucket(sum(map(len, chunks)))
        narrow = shapes.page_bucket(max(map(len, tables)))
        wide = shapes.step_pages(False, max(map(len, tables)))
        batches = {w: MeshBatch.stack([StepBatch.build(chunks, kv_lens, tables, num_tokens=tokens,
                                                       max_seqs=shapes.prefill_seqs(tokens), pages_per_seq=w)])
                   for w in (narrow, wide)}
        times = {w: [] for w in batches}
        for w, batch in batches.items():  # compile both
            jax.block_until_ready(runner.run(StepKind.PREFILL, batch))
        for _ in range(args.repeats):
            for w, batch in batches.items():
                start = time.perf_counter()
                jax.block_until_ready(runner.run(StepKind.PREFILL, batch))
                times[w].append(time.perf_counter() - start)
        med = {w: statistics.median(t) * 1e3 for w, t in times.items()}
        print(f"context {context}: {args.prompts} chunks of {args.chunk} + {args.prompts} decodes, {tokens} rows: "
              f"{narrow} pages {med[narrow]:.1f} ms, {wide} pages {med[wide]:.1f} ms "
              f"(x{med[wide] / med[narrow]:.2f})", flush=True)


if __name__ == "__main__":
    main()
