"""What the engine and ``LLM.generate`` return, shaped like vLLM's outputs."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    """One of a request's ``n`` outputs. ``text``/``token_ids`` are cumulative; ``delta_*`` are this step's."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or "error"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any
    logprobs: list[dict[int, float]] | None = None  # per token: chosen token first, then the top-n
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    delta_logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Times from ``time.monotonic()``; ``first_token_time`` is None until a token exists."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: RequestMetrics | None = None
    error: str | None = None  # why a request finished with reason "error" (a failed step), for logs and callers
    # With SamplingParams.prompt_logprobs: per prompt token {token: logprob, then the top-n}, None for the first
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
