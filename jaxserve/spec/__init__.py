"""Speculative decoding: proposals (n-gram lookup in the sequence's own tokens, or a draft model) verified by the
target model in one ragged step, accepted on device by the rejection-sampling rule, rolled back on the host.

``config`` (host, no jax): ``SpeculativeConfig``, vLLM's ``speculative_config`` keys, checked at start-up.
``ngram`` (host, NumPy): the prompt-lookup proposer. ``planner`` (host): which sequences propose how many tokens
this step, and the proposed/accepted/emitted counters. ``rows`` (host): the logits rows a step's verification
reads. ``verify`` (device): acceptance, the correction or bonus token, and the target's logprobs. ``drafter``
(device): the draft model's runner and KV pool. ``draft`` (host): the draft's start-up checks.
"""
