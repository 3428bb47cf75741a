"""The network on device: model families over shared layers, their configuration, checkpoints and loading.

``layers.py`` (pure functions), ``attention.py`` (K/V writes into the page pool and ragged paged attention over
it) and ``decoder.py`` (the modules and the decoder loop, ``DecoderLM`` and ``forward``) are shared; each family
is a short file declaring its switches and weight names (``llama.py``, ``mistral.py``, ``qwen2.py``, ``qwen3.py``,
``gemma2.py``, ``gemma3.py``, ``mixtral.py``, ``qwen2_moe.py``, ``qwen3_moe.py``), listed in ``registry.py``.
``config.py`` reads ``config.json``; ``checkpoint.py`` finds and reads checkpoint folders; ``loader.py`` maps
their tensors onto the modules and shardings; ``quantization.py`` holds 8-bit weights; ``demo.py`` builds the
built-in demo model. The family files, the registry, ``rope.py``, ``config.py`` and ``checkpoint.py`` import no
jax: the host reads configurations through them, so this package imports nothing itself.
"""
