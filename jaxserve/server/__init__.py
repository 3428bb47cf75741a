"""The serving front ends: the engine on a thread of its own driven from asyncio (``async_engine``), request
intake, the OpenAI-compatible HTTP API (``openai/``, a module per endpoint family), gRPC (``protos/``),
Prometheus metrics, the router over several decode processes, and the process wiring (``app``, ``args``,
``logs``)."""
