"""What the device side hands back to the host loop per step (NumPy only: host modules import it freely)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One step's sampled tokens, one row per scheduled sequence in plan order.

    ``logprobs`` and the top-n arrays are present when a sequence in the step asked for logprobs; a sequence's
    top-n row holds ``MAX_TOP_LOGPROBS`` entries of which it reads its first ``logprobs``.
    """

    token_ids: np.ndarray  # i32[N]
    logprobs: np.ndarray | None = None  # f32[N]  log-probability of each sampled token
    top_ids: np.ndarray | None = None  # i32[N, K]
    top_logprobs: np.ndarray | None = None  # f32[N, K]
    # seq_id -> [(prompt position, its ``jaxserve.outputs.TokenRecord``)] of the prompt tokens scored this step
    prompt_logprobs: dict[int, list[tuple[int, object]]] | None = None
    # speculation: plan index -> the tokens a verified entry emits (accepted drafts, then ``token_ids[i]``), and
    # their ``jaxserve.outputs.TokenRecord``s where the request asked for logprobs
    spec_tokens: dict[int, list[int]] | None = None
    spec_logprobs: dict[int, list] | None = None


class StepFailed(RuntimeError):
    """A step raised; its sequences got no token. ``cache_lost`` says whether the KV cache went with it (it had
    been donated to the step): a fresh cache is then in place and every sequence's KV must be recomputed."""

    def __init__(self, message: str, *, cache_lost: bool):
        super().__init__(message)
        self.cache_lost = cache_lost
