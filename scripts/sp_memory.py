"""Peak memory per device of one long-prompt prefill step at sequence = 1, 2, 4 (sequence parallelism).

Compiles (never runs) the engine's prefill step for a single prompt of ``--prompt-len`` tokens in one chunk,
from abstract parameters and KV cache placed on the mesh ``sequence=S[,tensor=T]``, and prints XLA's
``memory_analysis()`` of the per-device program: arguments (parameters, cache pages, batch), temporaries
(activations, attention scratch) and the peak (arguments + outputs - donated aliases + temporaries). Nothing
is allocated, so full-size shapes run on a laptop; the default is Llama-3.2-1B's shape in bfloat16.

    python scripts/sp_memory.py --prompt-len 8192 --sequence 1,2,4
    python scripts/sp_memory.py --model path/to/hf-folder --prompt-len 16384 --sequence 1,2,4 --tensor 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import bench_results  # noqa: E402

LLAMA_1B = {  # Llama-3.2-1B's shape (no weights are needed)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "torch_dtype": "bfloat16",
}
MIB = 2**20


def measure(hf: dict, prompt_len: int, sequence: int, tensor: int, dtype_name: str, page_size: int) -> dict:
    import jax
    import numpy as np

    from jaxserve.models.attention import AttentionBackend, ShardedAttention
    from jaxserve.executor.batch import MeshBatch, StepBatch
    from jaxserve.models.config import ModelConfig
    from jaxserve.executor.kv_cache import CacheConfig, cache_sharding
    from jaxserve.models.loader import DTYPES, abstract_model, param_shardings
    from jaxserve.executor.runner import StepOutput, jit_step
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec
    from sharding.mesh import make_mesh
    from sharding.layout import StepLayout
    from sharding.rules import model_rules

    cfg = ModelConfig.from_hf_dict(hf)
    dtype = DTYPES[dtype_name]
    mesh = make_mesh(f"sequence={sequence},tensor={tensor}", num_devices=sequence * tensor)
    rules = model_rules(cfg.num_heads, cfg.num_kv_heads, mesh)
    graphdef, state = abstract_model(cfg, dtype)
    shardings = param_shardings(state, mesh, rules)
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        value = var.get_value()
        var.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=shardings[path]))
    params = nnx.from_flat_state(flat)

    pages = -(-prompt_len // page_size)
    cache = CacheConfig(page_size, max(2, pages))
    shape, sharding = cache_sharding(cfg, cache, mesh)
    kv = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    kv_cache = [(kv, kv) for _ in range(cfg.num_layers)]

    one = StepBatch.build([[1] * prompt_len], [prompt_len], [list(range(pages))], num_tokens=prompt_len,
                          max_seqs=1, pages_per_seq=pages)
    batch = MeshBatch.stack([one])
    layout = StepLayout.create(mesh, rules, split_sequence=True)
    abstract = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)  # noqa: E731
    replicated = NamedSharding(mesh, PartitionSpec())
    packed = abstract(batch.pack(), replicated)
    attention = ShardedAttention(AttentionBackend(), layout, cfg.num_kv_heads)
    outs = (StepOutput(replicated, replicated), jax.tree.map(lambda a: a.sharding, kv_cache))
    lowered = jit_step(graphdef, 1, outs).lower(params, packed, kv_cache, batch.shape_fields(), attention, layout)
    stats = lowered.compile().memory_analysis()

    def per_device(tree) -> int:
        return sum(int(np.prod(s.sharding.shard_shape(s.shape))) * np.dtype(s.dtype).itemsize
                   for s in jax.tree.leaves(tree))

    peak = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + \
        stats.temp_size_in_bytes
    return {
        "sequence": sequence, "tensor": tensor, "prompt_len": prompt_len,
        "params_mib": per_device(params) / MIB, "kv_cache_mib": per_device(kv_cache) / MIB,
        "arguments_mib": stats.argument_size_in_bytes / MIB, "temp_mib": stats.temp_size_in_bytes / MIB,
        "peak_mib": peak / MIB,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a folder with config.json (default: Llama-3.2-1B's shape)")
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--sequence", default="1,2,4", help="comma-separated sequence sizes")
    parser.add_argument("--tensor", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # child: one sequence size
    bench_results.add_arguments(parser)
    args = parser.parse_args(argv)
    hf = json.loads((Path(args.model) / "config.json").read_text()) if args.model else LLAMA_1B

    if args.one is not None:
        print(json.dumps(measure(hf, args.prompt_len, args.one, args.tensor, args.dtype, args.page_size)))
        return
    sizes = [int(s) for s in args.sequence.split(",")]
    rows = []
    for s in sizes:  # a process per size: a fresh compiler, as many emulated devices as the mesh needs
        env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={s * args.tensor}")
        cmd = [sys.executable, __file__, "--one", str(s), *(argv if argv is not None else sys.argv[1:])]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    name = args.model or "Llama-3.2-1B shape"
    print(f"{name}, {args.dtype}, one {args.prompt_len}-token prompt prefilled in one chunk, tensor={args.tensor}, "
          f"page size {args.page_size}; per device:\n")
    print("| sequence | parameters | KV cache | all arguments | temporaries | peak | peak vs sequence=1 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    base = rows[0]["peak_mib"]
    figures = bench_results.Results(args)
    for r in rows:
        print(f"| {r['sequence']} | {r['params_mib']:.0f} MiB | {r['kv_cache_mib']:.0f} MiB | "
              f"{r['arguments_mib']:.0f} MiB | {r['temp_mib']:.0f} MiB | {r['peak_mib']:.0f} MiB | "
              f"{r['peak_mib'] / base:.2f} |")
        figures.add(f"{args.prompt_len}-token prompt, tensor={args.tensor}, sequence={r['sequence']}: peak per device "
                    f"vs sequence={sizes[0]}", r["peak_mib"] / base, "x")
    figures.save()


if __name__ == "__main__":
    main()
