"""jaxserve: an LLM inference engine in JAX.

Exports resolve lazily so host-only modules (scheduler, block manager) import without jax.
"""

import importlib

_EXPORTS = {
    "LLM": "jaxserve.llm",
    "SamplingParams": "jaxserve.sampling_params",
    "StructuredOutputsParams": "jaxserve.sampling_params",
    "RequestOutput": "jaxserve.outputs",
    "CompletionOutput": "jaxserve.outputs",
    "Logprob": "jaxserve.outputs",
    "LoRARequest": "jaxserve.lora_request",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
