"""What ``LLM`` prints when the application has not configured logging: jaxserve's own lines (loading, compiling
with progress, ready) at INFO on stderr, as vLLM does, from a handler on the ``jaxserve`` logger only.

- ``JAXSERVE_CONFIGURE_LOGGING=0``: add no handler (the application's logging set-up decides everything);
- ``JAXSERVE_LOGGING_LEVEL=WARNING`` (any ``logging`` level name): the level of the ``jaxserve`` logger when the
  handler is added (default INFO); or ``logging.getLogger("jaxserve").setLevel(...)``, before or after;
- an application that configured logging (a handler on the root or the ``jaxserve`` logger) before the engine
  starts gets no handler added; one that configures the root logger later takes over: the default handler stays
  silent while the root logger has handlers, and the records reach the application's through propagation.

The command lines (``serve``, ``generate``) configure logging themselves (``jaxserve.server.logs``).
"""

from __future__ import annotations

import logging
import os
import sys

CONFIGURE_ENV = "JAXSERVE_CONFIGURE_LOGGING"
LEVEL_ENV = "JAXSERVE_LOGGING_LEVEL"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the command lines' format


class DefaultHandler(logging.StreamHandler):
    """stderr (as it is at each record), while the application has not configured the root logger."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):  # StreamHandler sets it; the property reads sys.stderr instead
        pass

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:  # the application's handlers get it by propagation
            return
        super().emit(record)


def configure_default_logging() -> bool:
    """Add the default handler to the ``jaxserve`` logger unless told not to or logging is configured already;
    returns whether it added it.

    Raises:
      ValueError: ``JAXSERVE_LOGGING_LEVEL`` is not a level name.
    """
    if os.environ.get(CONFIGURE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    package = logging.getLogger("jaxserve")
    if package.handlers or logging.getLogger().handlers:
        return False
    level = os.environ.get(LEVEL_ENV, "INFO").strip().upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"{LEVEL_ENV}={level!r} is not a logging level (DEBUG, INFO, WARNING, ERROR, CRITICAL)")
    handler = DefaultHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    package.addHandler(handler)
    if package.level == logging.NOTSET or LEVEL_ENV in os.environ:
        package.setLevel(level)
    return True
