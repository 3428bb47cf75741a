"""What the engine and ``LLM.generate`` return, shaped like vLLM's outputs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class Logprob:
    """One entry of a token's logprobs, as vLLM's ``Logprob``: ``logprob`` of the token; ``rank`` its place in
    the distribution (1 = most likely; the top-n are ranks 1..n; None for a chosen token outside the top-n,
    whose exact rank the engine does not compute); ``decoded_token`` the token's text decoded on its own (None
    without a tokenizer, ``skip_tokenizer_init``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class TokenRecord:
    """One generated token with its logprobs, as the engine hands it to the servers: built once per token, from
    the step's arrays, so that nothing downstream has to reconstruct the top entries from a dict.

    ``top`` is the request's top-n (``SamplingParams.logprobs`` of them), most likely first; ``rank`` is the
    chosen token's place among them (1 = most likely), None when it is not among them. ``logprob`` is None when
    the step reported none for the token (the servers then show vLLM's filler, -9999).
    """

    id: int
    logprob: float | None
    rank: int | None
    top: tuple[tuple[int, float], ...]

    @classmethod
    def of(cls, token: int, logprob: float, top_ids: Sequence[int], top_logprobs: Sequence[float]) -> "TokenRecord":
        """From one row of a step's outputs (Python numbers), ``top_ids`` already cut to the request's n; ids
        below 0 (past a vocabulary smaller than n) are no entries."""
        top = tuple((t, v) for t, v in zip(top_ids, top_logprobs) if t >= 0)
        for i, (t, v) in enumerate(top):
            if t == token:  # one value per token id: the top entry's, as the vLLM-shaped dict holds it
                return cls(token, v, i + 1, top)
        return cls(token, logprob, None, top)

    def entry(self, decode: Callable[[int], str | None] | None = None) -> dict[int, Logprob]:
        """vLLM's shape: {chosen token: its ``Logprob``, then the top-n's (ranks 1..n)}; empty when the logprob is
        not known. ``decode`` gives a token id's text (``decoded_token``); without it, None."""
        if self.logprob is None:
            return {}
        text = decode or (lambda _: None)
        out = {self.id: Logprob(self.logprob, self.rank, text(self.id))}
        for rank, (t, v) in enumerate(self.top, 1):
            if t not in out:
                out[t] = Logprob(v, rank, text(t))
        return out

    def to_json(self) -> list:
        """A JSON-able form (``from_json`` reads it back), for records that cross processes."""
        return [self.id, self.logprob, self.rank, [list(e) for e in self.top]]

    @classmethod
    def from_json(cls, value: list) -> "TokenRecord":
        token, logprob, rank, top = value
        return cls(int(token), logprob, rank, tuple((int(t), float(v)) for t, v in top))


@dataclasses.dataclass
class CompletionOutput:
    """One of a request's ``n`` outputs. ``text``/``token_ids`` are cumulative; ``delta_*`` are this step's."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or "error"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any
    logprobs: list[dict[int, Logprob]] | None = None  # per token: chosen token first, then the top-n
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    delta_logprobs: list[dict[int, Logprob]] | None = None
    # The same logprobs as records (None without SamplingParams.logprobs): every token's, and this step's
    records: list[TokenRecord] | None = None
    delta_records: list[TokenRecord] | None = None
    # LLM.chat with a reasoning parser: the text split into the reasoning and the answer (None where none)
    reasoning: str | None = None
    content: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True, slots=True)
class CompletionDelta:
    """What one of a running request's ``n`` outputs gained since its previous output: the servers' per-step
    view (``CompletionOutput`` holds a whole output, built once when the request finishes)."""

    index: int
    delta_text: str
    delta_token_ids: list[int]
    delta_records: list[TokenRecord] | None  # None without SamplingParams.logprobs
    finish_reason: str | None  # set when this output finished in the step (its siblings run on)
    stop_reason: int | str | None = None

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
    # With SamplingParams.prompt_logprobs: per prompt token {token: Logprob, then the top-n's}, None for the first
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_records: list[TokenRecord | None] | None = None  # the same as records (the prompt token as ``id``)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


@dataclasses.dataclass(frozen=True, slots=True)
class RequestDelta:
    """One step's news of a running request (``Engine.step`` returns a ``RequestOutput`` once it finishes).

    ``prompt_token_ids`` and ``metrics`` are the request's own (not copies); ``prompt_records`` (with
    SamplingParams.prompt_logprobs) ride in the request's first output only (the prompt is scored whole before
    its first token is sampled).
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionDelta]
    metrics: RequestMetrics | None = None
    prompt_records: list[TokenRecord | None] | None = None

    finished = False  # a class constant: the last output of a request is a RequestOutput
    error = None
