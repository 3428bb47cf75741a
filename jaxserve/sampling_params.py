"""Per-request sampling parameters, validated on construction (ValueError names the field): ``SamplingParams``
and the ``StructuredOutputsParams`` that may ride on it (as in vLLM; ``jaxserve.text.structured_output`` compiles
them)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import numpy as np

_INT32_MAX = 2**31 - 1
MAX_LOGIT_BIAS = 300  # entries per request: the sampler's fixed width
_INT64 = (-(2**63), 2**63 - 1)


def _int(value, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _float(value, lo: float = -math.inf, hi: float = math.inf) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and lo <= value <= hi)


_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match; exactly one of ``json`` (a JSON schema, dict or text), ``regex``, ``choice``
    (one of these strings), ``grammar`` (Lark or GBNF), ``json_object`` (any JSON object). Field names follow
    vLLM's ``StructuredOutputsParams``. ``disable_any_whitespace`` forbids whitespace between JSON tokens;
    ``whitespace_pattern`` replaces the default ``[\\x20\\x0A\\x0D\\x09]+``."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False  # accepted for vLLM's clients: there is one backend, with nothing to fall back to

    def __post_init__(self):
        if isinstance(self.json, (dict, bool)):
            object.__setattr__(self, "json", json.dumps(self.json, sort_keys=True))
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice={self.choice!r} must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice:
                raise ValueError("structured_outputs.choice must not be empty")
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of {', '.join(_KINDS)} (got "
                             f"{', '.join(given) or 'none'})")
        for name in ("json", "regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {type(value).__name__}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A canonical text of everything that shapes the grammar (the compile cache's key)."""
        return json.dumps([self.kind, getattr(self, self.kind), self.disable_any_whitespace,
                           self.disable_additional_properties, self.whitespace_pattern])


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request; field names and defaults follow vLLM.

    temperature 0 means greedy. ``top_k`` 0 or -1 disables top-k. ``stop`` strings are matched on the
    detokenized text and removed from it. ``logprobs`` asks for the chosen token's logprob plus the top-n;
    ``prompt_logprobs`` the same for every prompt token after the first (the model's raw log-probabilities;
    such a prompt is computed whole, without prefix-cache hits). ``logit_bias`` adds to chosen tokens' logits.
    ``cache_salt`` is not a sampling knob but travels with the request here: prefix-cache pages are shared
    only between requests with the same salt (vLLM's field of the same name), so tenants with different
    salts cannot learn from cache hits what the others sent. ``structured_outputs`` constrains the output to a
    JSON schema, regex, choice or grammar (``StructuredOutputsParams``, or a dict of its fields);
    ``reasoning_end`` (a thinking model's end-of-reasoning marker, e.g. ``"</think>"``) holds that constraint back
    until the output has written the marker, so the reasoning is free and the answer constrained (the chat API
    sets it under ``--reasoning-parser``, as vLLM applies structured output after the reasoning). Numbers must be
    finite and integers fit int32 (``seed``: int64).
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
    cache_salt: str | None = None
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: int | None = None
    speculative: bool = True  # False: this request's tokens are never proposed/verified ahead (engine speculation)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (clamped to [-100, 100])
    reasoning_end: str | None = None  # structured_outputs applies once the output has written this marker

    def __post_init__(self):
        if self.logit_bias is not None:
            try:
                bias = {int(k): float(v) for k, v in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                raise ValueError(f"SamplingParams.logit_bias={self.logit_bias!r} must map token ids to numbers") \
                    from None
            if len(bias) > MAX_LOGIT_BIAS or not all(k >= 0 and math.isfinite(v) for k, v in bias.items()):
                raise ValueError(f"SamplingParams.logit_bias must map at most {MAX_LOGIT_BIAS} token ids (>= 0) to "
                                 "finite numbers")
            object.__setattr__(self, "logit_bias", {k: min(100.0, max(-100.0, v)) for k, v in bias.items()} or None)
        if isinstance(self.structured_outputs, dict):
            try:
                object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**self.structured_outputs))
            except TypeError as e:
                raise ValueError(f"SamplingParams.structured_outputs: {e}") from None
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        checks = [
            ("n", _int(self.n, 1, _INT32_MAX), "must be an integer >= 1"),
            ("max_tokens", self.max_tokens is None or _int(self.max_tokens, 1, _INT32_MAX),
             "must be an integer in [1, 2**31) or None"),
            ("temperature", _float(self.temperature, 0.0), "must be >= 0 and finite"),
            ("top_p", _float(self.top_p) and 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", _int(self.top_k, -1, _INT32_MAX), "must be -1, 0 (disabled) or a positive integer"),
            ("min_p", _float(self.min_p, 0.0, 1.0), "must be in [0, 1]"),
            ("repetition_penalty", _float(self.repetition_penalty) and self.repetition_penalty > 0.0,
             "must be > 0 and finite"),
            ("presence_penalty", _float(self.presence_penalty, -2.0, 2.0), "must be in [-2, 2]"),
            ("frequency_penalty", _float(self.frequency_penalty, -2.0, 2.0), "must be in [-2, 2]"),
            ("seed", self.seed is None or _int(self.seed, *_INT64), "must be an integer in [-2**63, 2**63) or None"),
            ("logprobs", self.logprobs is None or _int(self.logprobs, 0, 20), "must be an integer in [0, 20] or None"),
            ("prompt_logprobs", self.prompt_logprobs is None or _int(self.prompt_logprobs, 0, 20),
             "must be an integer in [0, 20] or None"),
            ("min_tokens", _int(self.min_tokens, 0, _INT32_MAX), "must be an integer in [0, 2**31)"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(0 <= t <= _INT32_MAX for t in self.stop_token_ids),
             "must be token ids in [0, 2**31)"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "must be a bool"),
            ("include_stop_str_in_output", isinstance(self.include_stop_str_in_output, bool), "must be a bool"),
            ("skip_special_tokens", isinstance(self.skip_special_tokens, bool), "must be a bool"),
            ("speculative", isinstance(self.speculative, bool), "must be a bool"),
            ("reasoning_end", self.reasoning_end is None or (isinstance(self.reasoning_end, str)
                                                             and self.reasoning_end != ""),
             "must be a non-empty string or None"),
            ("cache_salt", self.cache_salt is None or isinstance(self.cache_salt, str), "must be a string or None"),
            ("structured_outputs", self.structured_outputs is None
             or isinstance(self.structured_outputs, StructuredOutputsParams),
             "must be a StructuredOutputsParams, a dict of its fields, or None"),
        ]
        for field, ok, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{field}={getattr(self, field)!r} {why}")

    @functools.cached_property
    def greedy(self) -> bool:
        """Temperature 0: the argmax. Computed once (the parameters are frozen); a step reads it per sequence."""
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
