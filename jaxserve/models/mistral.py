"""Mistral: Llama's layers without biases, every layer windowed when the config sets ``sliding_window``."""

from jaxserve.models.family import Family, activation, layer_type_windows


def _config(hf):
    return dict(hidden_act=activation(hf, "silu"), sliding_windows=layer_type_windows(hf, hf["num_hidden_layers"]))


FAMILY = Family("mistral", ("MistralForCausalLM",), _config)
