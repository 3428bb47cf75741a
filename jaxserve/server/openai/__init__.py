"""The OpenAI-compatible HTTP front end, one module per endpoint family.

- ``server``: ``OpenAIServer``, the FastAPI app assembled from the endpoint modules' routers;
- ``completions`` (``/v1/completions``), ``chat`` (``/v1/chat/completions``), ``models`` (``/v1/models``),
  ``tokens`` (``/tokenize``, ``/detokenize``), ``admin`` (adapters, live weights, sleep), ``health``
  (``/health``, ``/live``, ``/metrics``);
- beside them: ``protocol`` (the request bodies), ``tool_calls`` (tool-call parsers, forced tool choice),
  ``logprobs`` (each API's logprob shapes), ``context`` (what the endpoints share: the engine, the body read
  within its limit, the ``model`` field, admitting prompts), ``errors`` (failures as OpenAI error responses) and
  ``streaming`` (SSE framing and client-disconnect handling, shared with the router, so it imports no engine).

A new endpoint family gets a module of its own beside these, with its request bodies in ``protocol`` and its
router registered in ``server``: the Responses API as ``responses``, Anthropic's Messages as ``messages``,
embeddings and scores as ``embeddings``.

This ``__init__`` imports nothing, so that the router can import ``streaming`` without the engine.
"""
