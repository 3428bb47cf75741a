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


# uvicorn's lines about its own life (started, shutting down, finished), logged as ``uvicorn.error`` at INFO: the
# server logs its start ("loading and warming up ...; HTTP on ... and gRPC on ...") and stop ("stopped") under
# jaxserve's names (``jaxserve.serve``, ``jaxserve.server.router``), so these only repeat them under a name that
# reads as a failure. uvicorn's warnings and errors (a malformed request, ...) keep its loggers; with
# ``--uvicorn-log-level debug`` (or trace) its lifecycle lines show too.
UVICORN_LIFECYCLE = ("Started server process", "Finished server process", "Shutting down", "Uvicorn running on",
                     "Waiting for connections to close", "Waiting for background tasks to complete",
                     "Waiting for application startup", "Application startup complete",
                     "Waiting for application shutdown", "Application shutdown complete")


class _UvicornLifecycle(logging.Filter):
    """Drops uvicorn's INFO lifecycle lines (``UVICORN_LIFECYCLE``) unless its logger is set to debug."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not isinstance(record.msg, str):
            return True
        level = logging.getLogger(record.name).level
        if level and level <= logging.DEBUG:
            return True
        return not record.msg.startswith(UVICORN_LIFECYCLE)


def setup(level: str = "info") -> None:
    """Configure the root logger once; call before importing jax or transformers."""
    # transformers advises at import that "PyTorch was not found": jaxserve uses only its tokenizers.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    numeric = getattr(logging, level.upper())
    logging.basicConfig(level=numeric, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _UvicornLifecycle) for f in uvicorn.filters):
        uvicorn.addFilter(_UvicornLifecycle())
    for name, quiet in QUIETED.items():
        if numeric > logging.DEBUG:
            logging.getLogger(name).setLevel(max(quiet, numeric))
