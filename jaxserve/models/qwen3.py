"""Qwen3: Qwen2's layers with per-head RMSNorm of q and k before rope, biases (q/k/v/o) only with ``attention_bias``."""

from jaxserve.models.family import Family, activation
from jaxserve.models.qwen2 import qwen_windows


def _config(hf):
    bias = bool(hf.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, hidden_act=activation(hf, "silu"),
                sliding_windows=qwen_windows(hf))


FAMILY = Family("qwen3", ("Qwen3ForCausalLM",), _config)
