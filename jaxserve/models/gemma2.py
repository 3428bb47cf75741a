"""Gemma 2: embeddings scaled by sqrt(hidden), (1 + w) RMSNorms, a norm before and after both attention and MLP,
GeGLU (``gelu_pytorch_tanh``), scores scaled by ``query_pre_attn_scalar ** -0.5``, attention and final logit
soft-capping, sliding-window and global layers interleaved (windowed first), tied embeddings."""

from jaxserve.models.family import Family, activation, layer_type_windows


def gemma_config(hf, *, default_types: list[str]) -> dict:
    """What Gemma 2 and Gemma 3 share."""
    bias = bool(hf.get("attention_bias", False))
    return dict(
        qkv_bias=bias, o_bias=bias, hidden_act=activation(hf, "gelu_pytorch_tanh"), norm_offset=1.0,
        embed_scale=True, sandwich_norms=True, query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        attn_soft_cap=hf.get("attn_logit_softcapping"), final_soft_cap=hf.get("final_logit_softcapping"),
        sliding_windows=layer_type_windows(hf, hf["num_hidden_layers"], default_types=default_types),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def _config(hf):
    layers = hf["num_hidden_layers"]
    return gemma_config(hf, default_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                           for i in range(layers)])


FAMILY = Family("gemma2", ("Gemma2ForCausalLM",), _config)
