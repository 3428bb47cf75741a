"""Per-request sampling parameters, validated on construction (ValueError names the field)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request; field names and defaults follow vLLM.

    temperature 0 means greedy. ``top_k`` 0 or -1 disables top-k. ``stop`` strings are matched on the
    detokenized text and removed from it. ``logprobs`` asks for the chosen token's logprob plus the top-n.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        checks = [
            ("n", isinstance(self.n, int) and self.n >= 1, "must be an integer >= 1"),
            ("max_tokens", self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             "must be an integer >= 1 or None"),
            ("temperature", self.temperature >= 0.0, "must be >= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= -1, "must be -1, 0 (disabled) or a positive integer"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "must be > 0"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("seed", self.seed is None or isinstance(self.seed, int), "must be an integer or None"),
            ("logprobs", self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             "must be an integer in [0, 20] or None"),
            ("min_tokens", isinstance(self.min_tokens, int) and self.min_tokens >= 0, "must be an integer >= 0"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "must be non-negative token ids"),
            ("include_stop_str_in_output", isinstance(self.include_stop_str_in_output, bool), "must be a bool"),
            ("skip_special_tokens", isinstance(self.skip_special_tokens, bool), "must be a bool"),
        ]
        for field, ok, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{field}={getattr(self, field)!r} {why}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


_MASK64 = (1 << 64) - 1


def sequence_seed(params: SamplingParams, *, engine_seed: int, request_index: int, sample_index: int = 0) -> int:
    """The 64-bit seed a sequence keeps for its whole life.

    A request's own ``seed`` is used as is, offset by ``sample_index`` so the ``n`` samples of one request
    differ; otherwise the seed comes from the engine seed and the request's arrival counter, so runs of the
    engine are reproducible but requests do not share streams.
    """
    if params.seed is not None:
        return (params.seed + sample_index) & _MASK64
    words = np.random.SeedSequence([engine_seed & _MASK64, request_index, sample_index]).generate_state(2)
    return (int(words[0]) << 32) | int(words[1])
