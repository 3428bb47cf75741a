"""Model families over shared layers.

``layers.py`` (pure functions) and ``decoder.py`` (the modules and the decoder loop, ``DecoderLM`` and
``forward``) are shared; each family is a short file declaring its switches and weight names (``llama.py``,
``mistral.py``, ``qwen2.py``, ``qwen3.py``, ``gemma2.py``, ``gemma3.py``), listed in ``registry.py``. The family
files, the registry and ``rope.py`` import no jax: the host reads configurations through them, so this package
imports nothing itself.
"""
