"""Memory per sequence of a hybrid linear-attention model (KV pages of its full-attention layers plus one state
slot) against the same model with every layer full attention, at a few context lengths; from the engine's own
sizing code (``kv_cache.bytes_per_token``, ``LinearAttentionConfig.state_bytes``). Host-only arithmetic.

    python scripts/hybrid_memory.py [--page-size 16] [--lengths 4096 32768]
"""

from __future__ import annotations

import argparse

from jaxserve.executor.kv_cache import bytes_per_token
from jaxserve.models.config import ModelConfig
from scripts import bench_results

# Qwen3-Next-80B-A3B's config.json shape (the published checkpoint's; no weights are read).
QWEN3_NEXT_80B = dict(
    architectures=["Qwen3NextForCausalLM"], hidden_size=2048, num_hidden_layers=48, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, intermediate_size=5120, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, num_experts=512, num_experts_per_tok=10, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], linear_num_key_heads=16, linear_num_value_heads=32,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
    vocab_size=151936, max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
    torch_dtype="bfloat16")


def per_sequence(cfg: ModelConfig, tokens: int, page_size: int, itemsize_dtype: str = "bfloat16") -> int:
    """Bytes one sequence of ``tokens`` holds: its pages (whole pages) and, for a hybrid, its state slot."""
    pages = -(-tokens // page_size)
    kv = pages * page_size * bytes_per_token(cfg, itemsize_dtype)
    return kv + (cfg.linear_attention.state_bytes if cfg.linear_attention else 0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768])
    bench_results.add_arguments(p)
    args = p.parse_args()
    figures = bench_results.Results(args)
    hybrid = ModelConfig.from_hf_dict(QWEN3_NEXT_80B)
    full = ModelConfig.from_hf_dict({**QWEN3_NEXT_80B, "layer_types": ["full_attention"] * 48})
    print(f"{hybrid.architecture}: {hybrid.num_attention_layers} full-attention layers, "
          f"{hybrid.linear_attention.num_linear_layers} Gated DeltaNet layers; state slot "
          f"{hybrid.linear_attention.state_bytes / 2**20:.1f} MiB (float32); KV "
          f"{bytes_per_token(hybrid, 'bfloat16'):,} B/token (bf16) vs {bytes_per_token(full, 'bfloat16'):,} B/token "
          f"with all {full.num_layers} layers full attention\n")
    print("| context | hybrid: pages + state | all full attention: pages | ratio |")
    print("|---:|---:|---:|---:|")
    for n in args.lengths:
        h, f = per_sequence(hybrid, n, args.page_size), per_sequence(full, n, args.page_size)
        print(f"| {n:,} | {h / 2**20:,.1f} MiB | {f / 2**20:,.1f} MiB | {h / f:.2f} |")
        figures.add(f"Qwen3-Next-80B-A3B, {n:,} tokens: hybrid (pages + state) / all full attention", h / f, "x")
    figures.save()


if __name__ == "__main__":
    main()
