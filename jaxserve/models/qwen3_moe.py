"""Qwen3-MoE: Qwen3's layers (q/k norm, biases only with ``attention_bias``) with a Mixture-of-Experts block,
top-k probabilities renormalised when ``norm_topk_prob``."""

from jaxserve.models.family import Family, activation
from jaxserve.models.moe_config import MoeConfig
from jaxserve.models.qwen2 import qwen_windows


def _config(hf):
    bias = bool(hf.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, hidden_act=activation(hf, "silu"),
                sliding_windows=qwen_windows(hf), moe=MoeConfig.from_hf_dict(hf, "qwen3_moe", hf["num_hidden_layers"]))


FAMILY = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), _config)
