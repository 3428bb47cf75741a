"""The one rule for a step that fails: the requests in it end with reason "error" (``RequestOutput.error`` saying
why) and give their pages back; every other request carries on.

The engine applies it to a step its executor reports failed (``StepFailed``: the plan's requests; when the KV
cache went with the step, every other sequence also recomputes its KV: ``Engine._fail_step``). The driver thread
(``jaxserve.engine.driver``) applies it to a ``step()`` that raised anything else: the requests in the batches
that step ran, or every live one when none ran (a failure not tied to a batch: nothing else could make progress
either). Host-only: no jax import.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from jaxserve.scheduler.sequence import Sequence

logger = logging.getLogger(__name__)


def end_failed_step(abort: Callable[[str, str], object | None], seqs: Iterable[Sequence], error: BaseException, *,
                    what: str = "step", otherwise: Iterable[str] = ()) -> list:
    """End the requests of a failed step and return their final outputs.

    Args:
      abort: ``abort(request_id, message)`` ends one request with reason "error" and ``message`` as its error,
        and returns its final output (None if it was not live).
      seqs: the sequences the failed step ran; their requests end, each once, in order.
      error: what the step raised (logged with its traceback; its text goes into each request's message).
      what: the step's name in the log ("step", "prefill step", ...).
      otherwise: the requests that end when ``seqs`` is empty.
    """
    affected = list(dict.fromkeys(s.request_id for s in seqs)) or list(dict.fromkeys(otherwise))
    logger.error("a %s failed; its requests %s finish with reason 'error'", what, ", ".join(affected), exc_info=error)
    message = f"the step running this request failed: {error}"
    return [out for rid in affected if (out := abort(rid, message)) is not None]
