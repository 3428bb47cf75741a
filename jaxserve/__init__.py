"""jaxserve: an LLM inference engine in JAX."""

from jaxserve.llm import LLM
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
