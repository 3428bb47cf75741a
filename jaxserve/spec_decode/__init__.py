"""Speculative decoding on the host: proposals (n-gram lookup in the sequence's own tokens, or a draft model)
verified by the target model in one ragged step, accepted on device, rolled back on the host. Imports no jax.

``ngram``: the prompt-lookup proposer (NumPy). ``planner``: which sequences propose how many tokens this step,
and the proposed/accepted/emitted counters. ``rows``: the logits rows a step's verification reads. ``draft``: a
draft model's start-up checks. The options are ``jaxserve.config.speculative``; the device parts (the draft
model's runner, acceptance) are ``jaxserve.executor.drafter`` and ``jaxserve.executor.verify``.
"""
