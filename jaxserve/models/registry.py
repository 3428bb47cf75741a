"""The families jaxserve serves, by the architecture names of their checkpoints. Host-only (no jax).

Adding a family: write its short file beside this one (see ``llama.py``, ``gemma3.py``) and list it here.
"""

from __future__ import annotations

from jaxserve.models import gemma2, gemma3, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe
from jaxserve.models.family import Family

FAMILIES: tuple[Family, ...] = (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma2.FAMILY,
                                gemma3.FAMILY, mixtral.FAMILY, qwen2_moe.FAMILY, qwen3_moe.FAMILY)
BY_ARCHITECTURE: dict[str, Family] = {arch: f for f in FAMILIES for arch in f.architectures}
SUPPORTED_ARCHITECTURES = tuple(BY_ARCHITECTURE)


def family_for(architectures: list[str], model_type: str | None = None) -> tuple[str, Family]:
    """The first of a config's ``architectures`` we serve, and its family.

    Raises:
      ValueError: naming the architectures asked for and every one supported.
    """
    for arch in architectures:
        if arch in BY_ARCHITECTURE:
            return arch, BY_ARCHITECTURE[arch]
    raise ValueError(f"unsupported architecture {architectures or model_type!r}; "
                     f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def family(architecture: str) -> Family:
    return BY_ARCHITECTURE[architecture]
