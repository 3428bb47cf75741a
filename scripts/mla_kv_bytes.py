"""KV-cache bytes per token of DeepSeek-V3's latent cache against grouped-query caches of similar-size models.

    python scripts/mla_kv_bytes.py

Reads only shapes (``jaxserve.tools.model_specs.PRESETS``, and Llama-3.1-405B's published config.json shape
written out here); counts with ``kv_cache.bytes_per_token``, the rule the engine, ``capacity`` and ``aot`` size
their pools by. Prints a Markdown table.
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp

from jaxserve.executor.kv_cache import bytes_per_token
from jaxserve.models.config import ModelConfig
from jaxserve.tools.model_specs import PRESETS
from scripts import bench_results

LLAMA_405B = dict(PRESETS["llama-3.1-70b"], hidden_size=16384, num_hidden_layers=126, num_attention_heads=128,
                  num_key_value_heads=8, intermediate_size=53248)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_results.add_arguments(p)
    figures = bench_results.Results(p.parse_args())
    v3 = ModelConfig.from_hf_dict(PRESETS["deepseek-v3"])
    m = v3.mla
    expanded = v3.num_layers * v3.num_heads * (m.qk_head_dim + m.v_head_dim) * 2  # K and V of every head, bf16
    rows = [
        ("DeepSeek-V3 (671B), latent cache, bf16", v3, jnp.bfloat16, None),
        ("DeepSeek-V3 (671B), latent cache, int8 + scales", v3, jnp.int8, None),
        ("DeepSeek-V3 (671B), if K/V were expanded per head, bf16", v3, None, expanded),
        ("Llama-3.1-405B, GQA 8 KV heads x 128, bf16", ModelConfig.from_hf_dict(LLAMA_405B), jnp.bfloat16, None),
        ("Llama-3.1-70B, GQA 8 KV heads x 128, bf16", ModelConfig.from_hf_dict(PRESETS["llama-3.1-70b"]),
         jnp.bfloat16, None),
    ]
    print("| model | parameters | KV bytes per token | per token per tensor=8 shard |")
    print("|---|---|---|---|")
    for name, cfg, dtype, fixed in rows:
        total = fixed if fixed is not None else bytes_per_token(cfg, dtype)
        shard = "—" if fixed is not None else f"{bytes_per_token(cfg, dtype, 8):,}"
        print(f"| {name} | {cfg.num_params / 1e9:.0f}B | {total:,} | {shard} |")
        figures.add(f"{name}: KV bytes per token", total, "B")
    figures.save()


if __name__ == "__main__":
    main()
