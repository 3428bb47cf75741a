"""How much work one request may ask for, so no single client can queue thousands of sequences, megabytes of
stop strings or vocabulary-wide logprobs ahead of everyone else. Both front ends check every request against
the same ``RequestLimits``; each refusal is a 400 / INVALID_ARGUMENT that names the limit and its flag.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """Per-request caps; the defaults match the server's flags."""

    max_n: int = 16  # --max-n: outputs per prompt (n, best_of)
    max_prompts_per_request: int = 64  # --max-prompts-per-request: a completions batch
    max_stop_strings: int = 16  # --max-stop-strings
    max_stop_string_chars: int = 256  # --max-stop-string-chars: each one
    max_logprobs: int = 20  # --max-logprobs: top alternatives per token

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            low = 0 if field.name == "max_logprobs" else 1
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{field.name}={value!r} must be an integer >= {low}")
        if self.max_logprobs > 20:
            raise ValueError(f"max_logprobs={self.max_logprobs} must be <= 20 (the engine's own limit)")

    def check(self, *, n: int | None = 1, logprobs: int | None = None, stop: str | list[str] | tuple | None = None,
              stop_token_ids: list[int] | tuple | None = None, num_prompts: int = 1, best_of: int | None = None,
              logprobs_field: str = "logprobs") -> None:
        """RequestError (400 / INVALID_ARGUMENT) naming the field, the limit and its flag; run on the request's
        fields before they become ``SamplingParams``, so the refusal names the server's limit."""
        from jaxserve.server.intake import invalid  # here: the flags parser imports this module before logging
        if num_prompts > self.max_prompts_per_request:
            raise invalid(f"prompt: a batch of {num_prompts} prompts is over the limit of "
                          f"{self.max_prompts_per_request} per request (--max-prompts-per-request)", "prompt")
        for field, value in (("n", n), ("best_of", best_of)):
            if isinstance(value, int) and value > self.max_n:
                raise invalid(f"{field}={value} is over the limit of {self.max_n} (--max-n)", field)
        stop = [stop] if isinstance(stop, str) else list(stop or ())
        if len(stop) > self.max_stop_strings:
            raise invalid(f"stop: {len(stop)} stop strings are over the limit of {self.max_stop_strings} "
                          "(--max-stop-strings)", "stop")
        longest = max((len(s) for s in stop if isinstance(s, str)), default=0)
        if longest > self.max_stop_string_chars:
            raise invalid(f"stop: a stop string of {longest} characters is over the limit of "
                          f"{self.max_stop_string_chars} (--max-stop-string-chars)", "stop")
        if len(stop_token_ids or ()) > 4 * self.max_stop_strings:
            raise invalid(f"stop_token_ids: {len(stop_token_ids)} ids are over the limit of "
                          f"{4 * self.max_stop_strings} (4 x --max-stop-strings)", "stop_token_ids")
        if isinstance(logprobs, int) and logprobs > self.max_logprobs:
            raise invalid(f"{logprobs_field}={logprobs} is over the limit of {self.max_logprobs} "
                          "(--max-logprobs)", logprobs_field)
