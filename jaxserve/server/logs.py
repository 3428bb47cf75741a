"""Logging set-up of the command-line entry points (``jaxserve.serve``, ``jaxserve.generate``): our lines at
the chosen level on stderr, and third-party start-up lines that only look like failures kept out of it."""

from __future__ import annotations

import logging
import os
import sys

# Lines other libraries log at start-up that are harmless here, and why:
QUIETED = {
    # JAX probes for TPU and GPU plugins before settling on the backend it finds ("Unable to initialize
    # backend 'tpu'" on a machine without one); the engine logs the backend it uses.
    "jax._src.xla_bridge": logging.WARNING,
}


def setup(level: str = "info") -> None:
    """Configure the root logger once; call before importing jax or transformers."""
    # transformers advises at import that "PyTorch was not found": jaxserve uses only its tokenizers.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    numeric = getattr(logging, level.upper())
    logging.basicConfig(level=numeric, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name, quiet in QUIETED.items():
        if numeric > logging.DEBUG:
            logging.getLogger(name).setLevel(max(quiet, numeric))
