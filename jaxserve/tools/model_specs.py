"""What ``--model`` names for the offline tools (``aot``, ``capacity``, ``plan``): a preset shape, a local
Hugging Face folder or a hub id; only the config.json is read, never weights. Host-only (no jax).

``model_config`` resolves all three the same way for every tool and turns each way it can fail (unknown name,
missing folder or config.json, a hub that cannot be reached, an unsupported architecture) into one
``ModelSpecError`` line for the user.
"""

from __future__ import annotations

import re
from pathlib import Path

from jaxserve.models.checkpoint import read_model_config
from jaxserve.models.config import ModelConfig

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_LLAMA = dict(architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5, vocab_size=128256,
              max_position_embeddings=131072, torch_dtype="bfloat16", bos_token_id=128000, eos_token_id=128001)
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], rms_norm_eps=1e-6, vocab_size=151936, head_dim=128,
              max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
              bos_token_id=151643, eos_token_id=151645)
# gpt-oss publishes its experts in MXFP4 (dequantized at load, jaxserve/models/mxfp4.py): these are the shapes.
_GPT_OSS = dict(architectures=["GptOssForCausalLM"], hidden_size=2880, intermediate_size=2880, head_dim=64,
                num_attention_heads=64, num_key_value_heads=8, num_experts_per_tok=4, vocab_size=201088,
                sliding_window=128, attention_bias=True, rms_norm_eps=1e-5, max_position_embeddings=131072,
                rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                     truncate=False, original_max_position_embeddings=4096),
                swiglu_limit=7.0, tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=200002)
# The config.json shapes of the published checkpoints (no weights are needed to compile).
PRESETS: dict[str, dict] = {
    "llama-3.2-1b": dict(_LLAMA, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, intermediate_size=8192, tie_word_embeddings=True,
                         rope_parameters=dict(_LLAMA3_ROPE, factor=32.0)),
    "llama-3.1-8b": dict(_LLAMA, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336, tie_word_embeddings=False,
                         rope_parameters=dict(_LLAMA3_ROPE, factor=8.0)),
    "llama-3.1-70b": dict(_LLAMA, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, intermediate_size=28672, tie_word_embeddings=False,
                          rope_parameters=dict(_LLAMA3_ROPE, factor=8.0)),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=12288),
    "qwen3-32b": dict(_QWEN3, hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                      intermediate_size=25600),
    "mixtral-8x7b": dict(architectures=["MixtralForCausalLM"], hidden_size=4096, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=32000,
                         num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5, max_position_embeddings=32768,
                         rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False, torch_dtype="bfloat16",
                         bos_token_id=1, eos_token_id=2),
    "qwen3-30b-a3b": dict(_QWEN3, architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[]),
    "gpt-oss-120b": dict(_GPT_OSS, num_hidden_layers=36, num_local_experts=128,
                         layer_types=["sliding_attention", "full_attention"] * 18),
    "gpt-oss-20b": dict(_GPT_OSS, num_hidden_layers=24, num_local_experts=32,
                        layer_types=["sliding_attention", "full_attention"] * 12),
    "mistral-7b": dict(architectures=["MistralForCausalLM"], hidden_size=4096, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=32768,
                       rms_norm_eps=1e-5, max_position_embeddings=32768, rope_theta=1000000.0, sliding_window=None,
                       tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2),
}
# DeepSeek-V3 (671B; Kimi-K2 has its shape with 384 experts and 64 heads): multi-head latent attention, 3 dense
# layers then 58 of 256 routed experts (top 8 in the 4 best of 8 groups) and a shared one. Its multi-token-prediction
# layer (num_nextn_predict_layers) is not served.
PRESETS["deepseek-v3"] = dict(
    architectures=["DeepseekV3ForCausalLM"], hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
    num_key_value_heads=128, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
    n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
    routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc", q_lora_rank=1536,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280,
    max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16",
    rope_theta=10000.0, rope_scaling=dict(type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0,
                                          original_max_position_embeddings=4096, beta_fast=32, beta_slow=1),
    num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1)


class ModelSpecError(ValueError):
    """A ``--model`` the tools cannot read: one line for the user, naming the model and what is wrong."""


_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def model_config(model: str, flag: str = "--model") -> ModelConfig:
    """A preset name (``PRESETS``), a local folder's config.json, or a hub id's config.json (fetched without
    weights). Raises ``ModelSpecError`` (``flag`` names the option in its message)."""
    if model in PRESETS:
        return ModelConfig.from_hf_dict(PRESETS[model])
    path = Path(model).expanduser()
    if not path.is_dir() and not path.exists() and (not _HUB_ID.fullmatch(model)
                                                    or model.startswith((".", "/", "~"))):
        raise ModelSpecError(f"{flag} {model!r} is neither a preset ({', '.join(PRESETS)}), an existing folder "
                             "nor a hub id (ORG/NAME)")
    try:
        return read_model_config(model, weights=False)[1]
    except ValueError as e:
        text = str(e)  # "model 'X' ..." -> "--model 'X' ..."
        text = f"{flag} {text[len('model '):]}" if text.startswith(f"model {model!r}") else f"{flag} {model!r}: {text}"
        hint = f" (or one of the presets: {', '.join(PRESETS)})" if not path.exists() else ""
        raise ModelSpecError(text + hint) from None
