"""The sampler's cost with and without the structured-output bitmask and the logit_bias inputs, alternating in
one process, and the host time to fill one constrained row's mask.

    PYTHONPATH=. python scripts/bench_sampler_masks.py --slots 32 --vocab 32000 --repeats 30
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from jaxserve.executor.sampler import SamplingTensors, sample
from jaxserve.sampling_params import SamplingParams
from scripts import bench_results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=30)
    bench_results.add_arguments(p)
    args = p.parse_args()
    figures = bench_results.Results(args)
    s, v = args.slots, args.vocab
    logits = jax.device_put(np.random.default_rng(0).normal(size=(s, v)).astype(np.float32))
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i) for i in range(s)]
    common = dict(num_slots=s, seeds=list(range(s)), num_generated=[0] * s, penalty_rows=[0] * s)
    variants = {
        "no mask, no bias inputs": SamplingTensors.build(params, **common),
        "bitmask + logit_bias inputs (as served)": SamplingTensors.build(
            params, token_bitmask=np.full((s, (v + 31) // 32), -1, np.int32), logit_bias_width=300, **common),
    }
    fn = jax.jit(sample)
    for t in variants.values():
        jax.block_until_ready(fn(logits, t))
    times = {k: [] for k in variants}
    for _ in range(args.repeats):  # alternate, so load on the machine hits both alike
        for name, t in variants.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(logits, t).token_ids)
            times[name].append(time.perf_counter() - start)
    base = np.median(times["no mask, no bias inputs"])
    for name, ts in times.items():
        print(f"{name}: median {np.median(ts) * 1e3:.2f} ms ({np.median(ts) / base:.2f}x)")
        figures.add(f"sampler step, {name}", np.median(ts) * 1e3, "ms")

    import sys

    sys.path.insert(0, "tests")
    from jaxserve.sampling_params import StructuredOutputsParams
    from jaxserve.text.structured_output import GrammarCompiler

    from tiny import train_tokenizer  # noqa: E402

    tok = train_tokenizer(4096)
    compiler = GrammarCompiler(tok, len(tok), [1])
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    m = compiler.matcher(StructuredOutputsParams(json=schema))
    from llguidance.numpy import fill_next_token_bitmask

    mask = np.zeros((1, compiler.bitmask_words), np.int32)
    fills = []
    for token in tok.encode('{"name": "Ada Lovelace", "age": 36}', add_special_tokens=False):
        start = time.perf_counter()
        fill_next_token_bitmask(m, mask, 0)
        fills.append(time.perf_counter() - start)
        m.consume_token(token)
    print(f"mask fill, JSON schema, {len(tok)}-token vocabulary: median {np.median(fills) * 1e6:.0f} us over "
          f"{len(fills)} steps")
    figures.add("llguidance mask fill per step, small JSON schema", np.median(fills) * 1e6, "µs")
    figures.save()


if __name__ == "__main__":
    main()
