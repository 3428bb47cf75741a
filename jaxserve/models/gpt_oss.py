"""gpt-oss: biases on q/k/v/o, a learned attention sink per query head, sliding-window and full layers alternating
(windowed first), YaRN rope, and a Mixture-of-Experts block in every layer: a router with a bias whose softmax
runs over the top-k logits, experts with biases and a clamped gated activation (``MoeConfig``). The checkpoint's
``mlp.router`` is read as our ``mlp.gate``; its experts' fused, interleaved ``gate_up_proj`` (and its bias) is
split into our ``gate_proj`` and ``up_proj`` at load, and MXFP4 expert weights are dequantized at load
(``models/loader.py``, ``models/mxfp4.py``)."""

from jaxserve.models.family import Family, layer_type_windows
from jaxserve.models.moe_config import MoeConfig


def _config(hf):
    layers = hf["num_hidden_layers"]
    bias = bool(hf.get("attention_bias", True))
    windows = layer_type_windows(hf, layers, default_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                                            for i in range(layers)])
    return dict(qkv_bias=bias, o_bias=bias, attn_sinks=True, sliding_windows=windows,
                moe=MoeConfig.from_hf_dict(hf, "gpt_oss", layers))


FAMILY = Family("gpt_oss", ("GptOssForCausalLM",), _config, weight_renames=((r"\.mlp\.gate\.", ".mlp.router."),))
