"""Qwen2 / 2.5: q/k/v biases (no o bias); sliding windows only with ``use_sliding_window``, on the layers from
``max_window_layers`` on (or as ``layer_types`` says)."""

from jaxserve.models.family import Family, activation, layer_type_windows


def qwen_windows(hf) -> tuple[int | None, ...]:
    """Qwen2/Qwen3 windows: none unless ``use_sliding_window``; then ``layer_types`` or ``max_window_layers``."""
    layers = hf["num_hidden_layers"]
    if not hf.get("use_sliding_window", False) or hf.get("sliding_window") is None:
        return (None,) * layers
    first = hf.get("max_window_layers", layers)
    default = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return layer_type_windows(hf, layers, default_types=default)


def _config(hf):
    return dict(qkv_bias=True, hidden_act=activation(hf, "silu"), sliding_windows=qwen_windows(hf))


FAMILY = Family("qwen2", ("Qwen2ForCausalLM",), _config)
