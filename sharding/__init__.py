"""Mesh axis sizes (``config``), device meshes (``mesh``), the logical-axis rules that place params, activations
and the KV cache on them (``rules``, ``layout``), and multi-host coordination (``multihost``). Import the
submodules: ``config`` parses a spec without importing jax, so flag parsing stays fast."""
