"""Llama 2 / 3 / 3.1 / 3.2: SwiGLU MLP, RMSNorm, grouped-query attention, optional biases (``attention_bias``
on q/k/v/o, ``mlp_bias``), any rope type (Llama 3.1's ``llama3`` scaling among them)."""

from jaxserve.models.family import Family, activation, layer_type_windows


def _config(hf):
    bias = bool(hf.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)),
                hidden_act=activation(hf, "silu"), sliding_windows=layer_type_windows(hf, hf["num_hidden_layers"]))


FAMILY = Family("llama", ("LlamaForCausalLM",), _config)
