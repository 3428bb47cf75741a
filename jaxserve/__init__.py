"""jaxserve: an LLM inference engine in JAX."""

from jaxserve.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
