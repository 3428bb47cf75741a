"""What ``LLM.generate`` returns, shaped like vLLM's outputs."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any
    logprobs: list[dict[int, float]] | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
