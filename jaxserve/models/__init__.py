"""Model families: one shared decoder (``decoder.py``) with per-family switches from ``ModelConfig``."""

from jaxserve.models.decoder import DecoderLM, forward

__all__ = ["DecoderLM", "forward"]
