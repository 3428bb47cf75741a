"""Qwen3-Next and Qwen3.5 (dense and MoE text models): hybrids of Gated DeltaNet layers (``gated_deltanet``; three
of every four by default) and gated full attention (q_proj also yields a sigmoid gate of the attention output;
per-head q/k RMSNorm; rope on the first ``partial_rotary_factor`` of each head's channels). Every RMSNorm scales
by ``1 + w`` in fp32. Qwen3-Next and Qwen3.5-MoE have a Mixture-of-Experts block with a gated shared expert in
their sparse layers; Qwen3.5's dense model a plain SwiGLU MLP.

Qwen3.5 rotates with multimodal rope sections; for text every section has the same position, which is plain rope.
"""

import dataclasses

from jaxserve.models.family import Family, activation
from jaxserve.models.moe_config import MoeConfig
from jaxserve.models.rope import RopeConfig
from jaxserve.models.state_config import LinearAttentionConfig


def _rope(hf, head_dim: int) -> tuple[RopeConfig, int]:
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    factor = float(params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    for key in ("mrope_section", "mrope_interleaved"):
        params.pop(key, None)
    rotary = int(head_dim * factor)
    rope = RopeConfig.from_hf(params, theta=hf.get("rope_theta"), head_dim=rotary,
                              max_position_embeddings=hf.get("max_position_embeddings", 4096))
    return rope, rotary


def _config(hf, *, fused: bool, moe_family: str | None):
    layers = hf["num_hidden_layers"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    rope, rotary = _rope(hf, head_dim)
    bias = bool(hf.get("attention_bias", False))
    moe = None
    if moe_family is not None and hf.get("num_experts", 0):
        moe = MoeConfig.from_hf_dict(hf, "qwen3_moe", layers)
        moe = dataclasses.replace(moe, shared_expert_size=hf.get("shared_expert_intermediate_size", 0),
                                  norm_topk_prob=moe.norm_topk_prob or moe_family == "qwen3_5_moe")
    return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, hidden_act=activation(hf, "silu"), norm_offset=1.0,
                attn_output_gate=True, rope=rope, rotary_dim=rotary, moe=moe,
                linear_attention=LinearAttentionConfig.from_hf(hf, fused_projections=fused))


FAMILY = Family("qwen3_next", ("Qwen3NextForCausalLM",),
                lambda hf: _config(hf, fused=True, moe_family="qwen3_next"))
QWEN3_5 = Family("qwen3_5", ("Qwen3_5ForCausalLM",), lambda hf: _config(hf, fused=False, moe_family=None))
QWEN3_5_MOE = Family("qwen3_5_moe", ("Qwen3_5MoeForCausalLM",),
                     lambda hf: _config(hf, fused=False, moe_family="qwen3_5_moe"))
