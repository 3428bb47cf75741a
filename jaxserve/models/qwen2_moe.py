"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's layers with a Mixture-of-Experts block beside a shared expert scaled by a
sigmoid gate; ``decoder_sparse_step`` and ``mlp_only_layers`` say which layers are sparse. q/k/v biases follow
the config's own ``qkv_bias`` (default on)."""

from jaxserve.models.family import Family, activation
from jaxserve.models.moe_config import MoeConfig
from jaxserve.models.qwen2 import qwen_windows


def _config(hf):
    return dict(qkv_bias=bool(hf.get("qkv_bias", True)), hidden_act=activation(hf, "silu"),
                sliding_windows=qwen_windows(hf), moe=MoeConfig.from_hf_dict(hf, "qwen2_moe", hf["num_hidden_layers"]))


FAMILY = Family("qwen2_moe", ("Qwen2MoeForCausalLM",), _config)
