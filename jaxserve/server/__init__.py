"""The serving front ends: request intake, the OpenAI-compatible HTTP API, gRPC, and process wiring."""
