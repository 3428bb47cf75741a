"""DeepSeek-V2 (V2-Lite) and DeepSeek-V3 (Kimi-K2 uses V3's class): multi-head latent attention
(``mla_config.py``, ``mla.py``), the first ``first_k_dense_replace`` layers dense and the rest Mixture-of-Experts
with ``n_shared_experts`` ungated shared experts. V2 routes by softmax ("greedy" or "group_limited_greedy"); V3 by
sigmoid with the ``e_score_correction_bias`` choosing ("noaux_tc"); both scale the chosen weights by
``routed_scaling_factor`` (``moe_config.py``). Multi-token-prediction layers (V3's
``num_nextn_predict_layers``, stored after the last decoder layer) are skipped at load (``loader.py``)."""

from jaxserve.models.family import Family, activation
from jaxserve.models.mla_config import MlaConfig
from jaxserve.models.moe_config import MoeConfig
from jaxserve.models.rope import RopeConfig, _yarn_mscale

# (allowed topk_method values, scoring_func) per version, as transformers' routers implement them
_ROUTING = {"v2": (("greedy", "group_limited_greedy"), "softmax"), "v3": (("noaux_tc",), "sigmoid")}
# transformers' defaults for the keys a config.json may leave out (DeepseekV2Config, DeepseekV3Config)
_SHARED_DEFAULTS = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
_DEFAULTS = {
    "v2": dict(_SHARED_DEFAULTS, n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=1407,
               n_shared_experts=2, first_k_dense_replace=0, routed_scaling_factor=1.0),
    "v3": dict(_SHARED_DEFAULTS, n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
               n_shared_experts=1, n_group=8, topk_group=4, first_k_dense_replace=3, routed_scaling_factor=2.5,
               norm_topk_prob=True),
}


def _config(config, version: str):
    hf = dict(_DEFAULTS[version], **config)  # a key given as null stays null (q_lora_rank: no query compression)
    layers = hf["num_hidden_layers"]
    methods, scoring = _ROUTING[version]
    method = hf.get("topk_method") or methods[0]
    if method not in methods:
        raise ValueError(f"topk_method={method!r} is not supported for {hf.get('architectures')} (supported: "
                         f"{', '.join(map(repr, methods))})")
    if (hf.get("scoring_func") or scoring) != scoring:
        raise ValueError(f"scoring_func={hf['scoring_func']!r} is not supported for this architecture (supported: "
                         f"{scoring!r})")
    if (hf.get("moe_layer_freq") or 1) != 1:
        raise ValueError(f"moe_layer_freq={hf['moe_layer_freq']} is not supported (supported: 1)")
    rope_dim = hf["qk_rope_head_dim"]
    params = hf.get("rope_parameters") or hf.get("rope_scaling")
    rope = RopeConfig.from_hf(params, theta=hf.get("rope_theta"),
                              max_position_embeddings=hf.get("max_position_embeddings", 4096), head_dim=rope_dim,
                              original_max_position_embeddings=hf.get("original_max_position_embeddings"))
    sm_scale = (hf["qk_nope_head_dim"] + rope_dim) ** -0.5
    if rope.kind != "default" and params and params.get("mscale_all_dim"):
        sm_scale *= _yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    mla = MlaConfig(hf["kv_lora_rank"], hf["qk_nope_head_dim"], rope_dim, hf["v_head_dim"],
                    q_lora_rank=hf.get("q_lora_rank") or None,
                    rope_interleave=True if version == "v2" else bool(hf.get("rope_interleave", True)),
                    attention_bias=bool(hf.get("attention_bias", False)), sm_scale=sm_scale)
    dense = hf.get("first_k_dense_replace") or 0
    n_group = hf.get("n_group") or 1
    moe = MoeConfig(
        num_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"],
        intermediate_size=hf["moe_intermediate_size"],
        # transformers' V2 router never renormalises (its config's norm_topk_prob is unused)
        norm_topk_prob=version == "v3" and bool(hf.get("norm_topk_prob")),
        sparse_layers=tuple(i >= dense for i in range(layers)),
        shared_expert_size=hf["moe_intermediate_size"] * (hf.get("n_shared_experts") or 0),
        scoring=scoring, topk_method=method, n_group=n_group, topk_group=hf.get("topk_group") or n_group,
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0), correction_bias=version == "v3",
        shared_expert_gated=False)
    # The cache's shape: one latent "KV head" of width kv_lora_rank + qk_rope_head_dim (mla.py)
    return dict(num_kv_heads=1, head_dim=mla.latent_dim, rope=rope, mla=mla, moe=moe,
                mlp_bias=bool(hf.get("mlp_bias", False)), hidden_act=activation(hf, "silu"))


_RENAMES = ((r"\.mlp\.shared_expert\.", ".mlp.shared_experts."),)
V2 = Family("deepseek_v2", ("DeepseekV2ForCausalLM",), lambda hf: _config(hf, "v2"), _RENAMES)
V3 = Family("deepseek_v3", ("DeepseekV3ForCausalLM",), lambda hf: _config(hf, "v3"), _RENAMES)
