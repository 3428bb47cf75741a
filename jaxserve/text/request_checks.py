"""Request validation at intake: every check of a request's prompt and parameters against what this engine
serves, each written once.

Both ways in call it before the request reaches the engine's queue: ``Engine.add_request`` (``LLM.generate``,
tests, the disaggregated engines) and the servers' ``AsyncEngine.add_request``, which checks in the event loop,
off the engine thread, and hands the engine requests it need not check again. ``SamplingParams`` checks its
own fields on construction; what is checked here is what needs the engine: its ``max_model_len``, vocabulary,
tokenizer and grammar compiler. Each refusal is a ValueError naming the field, which the servers answer with
400 / INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxserve.sampling_params import SamplingParams
from jaxserve.text.structured_output import GrammarCompiler


def check_fits(prompt_len: int, max_tokens: int | None, max_model_len: int, field: str = "prompt") -> None:
    """A prompt of ``prompt_len`` tokens (``field``) must leave room for output in ``max_model_len``, and so must
    ``max_tokens`` with it. The scheduler guards its pages with this too (O(1)): its callers may skip intake."""
    if prompt_len >= max_model_len:
        raise ValueError(f"{field} has {prompt_len} tokens; max_model_len={max_model_len} leaves no room for output")
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise ValueError(f"SamplingParams.max_tokens={max_tokens} with a {prompt_len}-token prompt exceeds "
                         f"max_model_len={max_model_len}")


@dataclasses.dataclass(frozen=True)
class RequestChecks:
    """The checks of one engine: ``has_tokenizer`` is False with ``skip_tokenizer_init``; ``grammars`` is the
    engine's ``GrammarCompiler`` (None without a tokenizer)."""

    max_model_len: int
    vocab_size: int
    has_tokenizer: bool = True
    grammars: GrammarCompiler | None = None

    @classmethod
    def of(cls, engine) -> "RequestChecks":
        """The checks of an engine (anything with ``max_model_len``, ``model_config.vocab_size``, ``tokenizer``
        and ``grammars``)."""
        return cls(int(engine.max_model_len), int(engine.model_config.vocab_size), engine.tokenizer is not None,
                   engine.grammars)

    def prompt(self, ids: Sequence[int], field: str = "prompt") -> None:
        """Token ids of a prompt: not empty, inside the vocabulary, leaving room for output in max_model_len."""
        if not ids:
            raise ValueError(f"{field} is empty")
        check_fits(len(ids), None, self.max_model_len, field)
        vocab = self.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"{field} token id {bad} is outside the vocabulary [0, {vocab})")

    def params(self, params: SamplingParams, prompt_len: int) -> None:
        """Sampling parameters for a prompt of ``prompt_len`` tokens. A structured-output grammar is compiled
        (and cached for the engine's steps): ValueError naming the field if it is invalid."""
        check_fits(prompt_len, params.max_tokens, self.max_model_len)
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(f"logit_bias: token id {max(params.logit_bias)} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if not self.has_tokenizer and params.stop:
            raise ValueError("stop strings need a tokenizer; this engine runs with skip_tokenizer_init (use "
                             "stop_token_ids)")
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError("structured_outputs needs a tokenizer; this engine runs with skip_tokenizer_init")
            self.grammars.prepare(params.structured_outputs)  # ValueError for an invalid grammar; cached

    def request(self, ids: Sequence[int], params: SamplingParams) -> None:
        """``prompt`` then ``params``: everything a request is checked for."""
        self.prompt(ids)
        self.params(params, len(ids))
