"""Batch-1 decode step time and offline throughput of fp32, bf16, 8-bit weights and 8-bit KV, in one invocation.

    python scripts/bench_quant.py --model /path/to/100m [--rounds 3] [--context 64] [--steps 16]
        [--num-requests 16 --prompt-len 16:128 --output-len 32] [--configs fp32,bf16,w_int8,kv_int8] [--show-hlo]

All engines are built first (same limits, greedy, EOS ignored); then each round runs every configuration in turn
(alternating, so a noisy machine's slow spells spread over all of them): a batch-1 decode probe (median wall time
of an engine step, ``benchmark_offline.probe_decode``) and the offline workload (output tokens/s). The first
round compiles and is not counted. Reports the median over the counted rounds. ``--show-hlo`` prints how XLA
compiles one int8 linear layer at batch 1 on this backend: the int8 x int8 dot (one library fusion) against
converting the weight first (a separate pass writing the whole converted matrix).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmark_offline import probe_decode, run_jaxserve  # noqa: E402
from jaxserve.engine.engine import Engine  # noqa: E402
from jaxserve.config.engine import EngineConfig  # noqa: E402
from scripts import bench_results  # noqa: E402

CONFIGS = {
    "fp32": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "w_int8": dict(dtype="bfloat16", quantization="int8"),
    "kv_int8": dict(dtype="bfloat16", kv_cache_dtype="int8"),
    "w_fp8": dict(dtype="bfloat16", quantization="fp8"),
    "w_int8_kv_int8": dict(dtype="bfloat16", quantization="int8", kv_cache_dtype="int8"),
    "kv_fp8": dict(dtype="bfloat16", kv_cache_dtype="fp8"),
    "kv_fp8_e5m2": dict(dtype="bfloat16", kv_cache_dtype="fp8_e5m2"),
}


def show_hlo(hidden: int = 768, out: int = 2048) -> None:
    import jax
    import jax.numpy as jnp

    from jaxserve.models import layers

    args = (jax.ShapeDtypeStruct((1, hidden), jnp.bfloat16), jax.ShapeDtypeStruct((hidden, out), jnp.int8),
            jax.ShapeDtypeStruct((out,), jnp.float32))
    for name, fn in (("int8 rows x int8 weight (served)", layers.quantized_matmul),
                     ("weight converted to bf16 first", lambda x, w, s: layers.matmul_f32(x, w.astype(x.dtype)) * s)):
        text = jax.jit(fn).lower(*args).compile().as_text()
        entry = text[text.index("ENTRY"):]
        print(f"--- {name}:\n" + "\n".join(line.split(", metadata")[0] for line in entry.splitlines()[1:-1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--configs", default="fp32,bf16,w_int8,kv_int8", help=f"any of {','.join(CONFIGS)}")
    p.add_argument("--rounds", type=int, default=3, help="counted rounds (one more compiles first)")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-len", default="16:128")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--show-hlo", action="store_true")
    bench_results.add_arguments(p)
    args = p.parse_args()
    figures = bench_results.Results(args)
    if args.show_hlo:
        show_hlo()
    names = args.configs.split(",")
    lo, hi = map(int, args.prompt_len.split(":"))
    engines = {}
    for name in names:
        engines[name] = Engine(EngineConfig(model=args.model, max_num_seqs=8, max_num_batched_tokens=256,
                                            max_model_len=hi + args.output_len + 64, num_pages=256, warmup=False,
                                            compilation_cache_dir=None, enable_prefix_caching=False,
                                            **CONFIGS[name]))
        print(f"{name}: {engines[name].executor.info.describe()['kv_bytes_per_token']} KV bytes/token", flush=True)
    rng = np.random.default_rng(0)
    vocab = next(iter(engines.values())).model_config.vocab_size
    prompts = [rng.integers(3, vocab, n).tolist() for n in rng.integers(lo, hi + 1, args.num_requests)]
    w = {"prompts": prompts, "output_len": args.output_len}
    step_s = {n: [] for n in names}
    tok_s = {n: [] for n in names}
    cpu_s = {n: [] for n in names}  # the offline run's CPU time (all threads): steadier than wall time when shared
    for r in range(args.rounds + 1):
        for name in names:
            e = engines[name]
            probe = probe_decode(e, 1, args.context, args.steps)
            cpu = time.process_time()
            run = run_jaxserve(e, w)
            cpu = time.process_time() - cpu
            if r:
                step_s[name].append(probe["step_s"])
                tok_s[name].append(run["output_tokens"] / run["seconds"])
                cpu_s[name].append(cpu)
        print(f"round {r}{' (compiles, not counted)' if not r else ''} done", flush=True)
    base = float(np.median(step_s["bf16"])) if "bf16" in names else None
    print("\n| config | batch-1 decode step (ms, median) | vs bf16 | offline output tokens/s (median) "
          "| offline CPU seconds (median) |")
    print("| --- | --- | --- | --- | --- |")
    for name in names:
        s = float(np.median(step_s[name]))
        ratio = f"{base / s:.2f}x" if base else "-"
        print(f"| {name} | {s * 1e3:.2f} | {ratio} | {float(np.median(tok_s[name])):.1f} "
              f"| {float(np.median(cpu_s[name])):.2f} |")
        figures.add(f"{name}: batch-1 decode step", s * 1e3, "ms")
        if base:
            figures.add(f"{name}: batch-1 decode step, bf16 / it", base / s, "x")
        figures.add(f"{name}: offline output tok/s", float(np.median(tok_s[name])), "tok/s")
        figures.add(f"{name}: offline CPU seconds", float(np.median(cpu_s[name])), "s")
    figures.save()


if __name__ == "__main__":
    main()
