"""Gemma 3 (text): Gemma 2's layers with per-head (1 + w) RMSNorm of q and k, no soft-capping by default, and
two rope settings: the global layers' (``rope_theta``, possibly scaled) and the windowed layers' own base
(``rope_local_base_freq``); by default five windowed layers to one global."""

from jaxserve.models.family import Family
from jaxserve.models.gemma2 import gemma_config
from jaxserve.models.rope import RopeConfig


def _config(hf):
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true is not supported (causal attention only)")
    layers, pattern = hf["num_hidden_layers"], int(hf.get("sliding_window_pattern", 6))
    fields = gemma_config(hf, default_types=["sliding_attention" if (i + 1) % pattern else "full_attention"
                                             for i in range(layers)])
    fields["qk_norm"] = True
    params = hf.get("rope_parameters") or {}
    shape = dict(max_position_embeddings=hf.get("max_position_embeddings", 131072),
                 head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    if "full_attention" in params or "sliding_attention" in params:  # transformers >= 5: one dict per layer type
        full, local = params.get("full_attention"), params.get("sliding_attention")
        fields["rope"] = RopeConfig.from_hf(full, theta=1_000_000.0, **shape)
        fields["sliding_rope"] = RopeConfig.from_hf(local, theta=10_000.0, **shape)
    else:  # older configs: rope_theta (+ rope_scaling) for global layers, rope_local_base_freq for windowed ones
        fields["rope"] = RopeConfig.from_hf(hf.get("rope_scaling") or params,
                                            theta=hf.get("rope_theta", 1_000_000.0), **shape)
        fields["sliding_rope"] = RopeConfig(theta=float(hf.get("rope_local_base_freq", 10_000.0)))
    return fields


FAMILY = Family("gemma3", ("Gemma3ForCausalLM",), _config)
