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


def _version() -> str:
    """The installed distribution's version (pyproject.toml's), as ``GET /version`` reports it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def __getattr__(name: str):
    if name == "__version__":
        return _version()
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
