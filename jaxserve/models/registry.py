"""The families jaxserve serves, by the architecture names of their checkpoints. Host-only (no jax).

Adding a family: write its short file beside this one (see ``llama.py``, ``gemma3.py``) and list it here.
"""

from __future__ import annotations

from jaxserve.models import (
    deepseek,
    gemma2,
    gemma3,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
    qwen3_next,
)
from jaxserve.models.family import Family

FAMILIES: tuple[Family, ...] = (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma2.FAMILY,
                                gemma3.FAMILY, mixtral.FAMILY, qwen2_moe.FAMILY, qwen3_moe.FAMILY,
                                gpt_oss.FAMILY)
# Hybrids of linear attention (a recurrent state per sequence) and full attention.
FAMILIES += (qwen3_next.FAMILY, qwen3_next.QWEN3_5, qwen3_next.QWEN3_5_MOE)
FAMILIES += (deepseek.V2, deepseek.V3)
BY_ARCHITECTURE: dict[str, Family] = {arch: f for f in FAMILIES for arch in f.architectures}
SUPPORTED_ARCHITECTURES = tuple(BY_ARCHITECTURE)
# config.json's ``model_type`` -> the architecture it means, for a config that lists no ``architectures``
# (gemma3 is the multimodal wrapper, whose text model is a nested ``text_config``: not one of these).
BY_MODEL_TYPE: dict[str, str] = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
BY_MODEL_TYPE.update({"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                      "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"})
BY_MODEL_TYPE.update({"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                      "kimi_k2": "DeepseekV3ForCausalLM"})


def family_for(architectures: list[str], model_type: str | None = None) -> tuple[str, Family]:
    """The first of a config's ``architectures`` we serve, and its family; a config without ``architectures``
    by its ``model_type`` (``BY_MODEL_TYPE``).

    Raises:
      ValueError: naming the architectures (or model type) asked for and every one supported.
    """
    for arch in architectures:
        if arch in BY_ARCHITECTURE:
            return arch, BY_ARCHITECTURE[arch]
    if architectures:
        raise ValueError(f"unsupported architecture {architectures!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if model_type in BY_MODEL_TYPE:
        arch = BY_MODEL_TYPE[model_type]
        return arch, BY_ARCHITECTURE[arch]
    if model_type is None:
        raise ValueError("config.json names neither 'architectures' nor 'model_type'; supported architectures: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    raise ValueError(f"config.json has no 'architectures' and its model_type {model_type!r} is not supported; "
                     f"supported model types: {', '.join(BY_MODEL_TYPE)}")


def family(architecture: str) -> Family:
    return BY_ARCHITECTURE[architecture]
