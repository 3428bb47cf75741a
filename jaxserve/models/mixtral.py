"""Mixtral: Mistral's layers with a Mixture-of-Experts block (top-2 of 8 SwiGLU experts, probabilities always
renormalised) in place of every MLP; the checkpoint's ``block_sparse_moe`` is read as ``mlp``."""

from jaxserve.models.family import Family, activation, layer_type_windows
from jaxserve.models.moe_config import MoeConfig


def _config(hf):
    layers = hf["num_hidden_layers"]
    return dict(hidden_act=activation(hf, "silu"), sliding_windows=layer_type_windows(hf, layers),
                moe=MoeConfig.from_hf_dict(hf, "mixtral", layers))


FAMILY = Family("mixtral", ("MixtralForCausalLM",), _config)
