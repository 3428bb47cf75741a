"""Structured output: grammars (JSON schema, regex, choice, Lark/GBNF) turned into per-step token masks.

Grammars are compiled and run by llguidance: it has no dependencies beyond its own wheel (xgrammar needs torch
and triton at install; outlines-core builds a whole-vocabulary index per schema up front), and it computes each
step's mask lazily from the parser state over a token trie, in tens of microseconds for JSON, so nothing has to
be precomputed per schema. Host-only: this module imports no jax.

The path of a constrained request:

- ``StructuredOutputsParams`` (vLLM's name and fields, defined beside ``SamplingParams`` as in vLLM) rides on
  ``SamplingParams.structured_outputs``; ``grammar_spec`` turns it into an llguidance grammar;
- ``GrammarCompiler.prepare`` compiles it once (cached by its canonical key) and raises ``ValueError`` for an
  invalid schema, regex or grammar; the servers call it in a worker thread before the engine sees the request;
- ``StructuredOutputs`` keeps one matcher per sequence: after the executor has dispatched a step to the device
  it fills the packed bitmask rows of the constrained slots (``fill_bitmask``, overlapping the forward pass),
  the sampler applies the bitmask on device, and after the step each matcher consumes its sampled token
  (``accept``).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from collections.abc import Iterable, Sequence

import numpy as np

from jaxserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_CACHE_SIZE = 256


def _close_objects(schema: dict) -> dict:
    """``schema`` with ``additionalProperties: false`` on every object that does not say otherwise."""
    def walk(node):
        if isinstance(node, dict):
            out = {k: walk(v) for k, v in node.items()}
            if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
                out["additionalProperties"] = False
            return out
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node
    return walk(schema)


def grammar_spec(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``params``; ValueError naming the field if it cannot be built."""
    from llguidance import LLMatcher, grammar_from

    kind = params.kind
    if kind in ("json", "json_object"):
        if kind == "json_object":
            schema = {"type": "object"}
        else:
            try:
                schema = json.loads(params.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            except RecursionError:
                raise ValueError("structured_outputs.json is nested too deeply") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
            if params.disable_additional_properties and isinstance(schema, dict):
                schema = _close_objects(schema)
        options: dict = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{kind}: {e}") from None
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return grammar_from("choice", list(params.choice))
    try:
        return grammar_from("grammar", params.grammar)
    except Exception as e:  # noqa: BLE001 - the GBNF converter raises assorted errors for bad input
        raise ValueError(f"structured_outputs.grammar could not be read: {e}") from None


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer and vocabulary; thread-safe.

    Args:
      tokenizer: the engine's Hugging Face tokenizer (a fast one: llguidance reads its ``tokenizer.json``).
      vocab_size: the model's logits width (the bitmask covers it; ids past the tokenizer's are never allowed).
      eos_token_ids: what ends a sequence; allowed once the grammar is complete.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self.hf_tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, object] = collections.OrderedDict()

    @property
    def bitmask_words(self) -> int:
        """Words of the masks the matchers write (their vocabulary may be larger than the model's)."""
        return (self._tokenizer().vocab_size + 31) // 32

    def _tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                from llguidance.hf import from_tokenizer

                eos = self.eos_token_ids or None
                try:
                    try:
                        self._ll_tokenizer = from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos)
                    except ValueError:  # the tokenizer counts more ids than the model has logits
                        self._ll_tokenizer = from_tokenizer(self.hf_tokenizer, eos_token=eos)
                except Exception as e:  # noqa: BLE001 - e.g. a slow (Python) tokenizer
                    raise ValueError(f"structured output needs a fast Hugging Face tokenizer: {e}") from None
            return self._ll_tokenizer

    def prepare(self, params: StructuredOutputsParams):
        """Compile (or take from the cache) the matcher template of ``params``; ValueError if invalid."""
        from llguidance import LLMatcher

        key = params.key()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template
        spec = grammar_spec(params)
        tokenizer = self._tokenizer()
        is_error, messages = LLMatcher.validate_grammar_with_warnings(spec, tokenizer)
        if is_error:
            raise ValueError(f"structured_outputs.{params.kind} is invalid: {messages[0] if messages else ''}")
        template = LLMatcher(tokenizer, spec, log_level=0)
        if template.is_error():
            raise ValueError(f"structured_outputs.{params.kind} is invalid: {template.get_error()}")
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return template

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher (at the grammar's start) for one sequence."""
        return self.prepare(params).deep_copy()


class StructuredOutputs:
    """The matchers of the engine's constrained sequences (by ``seq_id``) and the per-step masks."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self._matchers: dict[int, object] = {}
        # seq_id -> (end-of-reasoning marker, tokens to decode when looking for it): constrained sequences still
        # in their reasoning (``SamplingParams.reasoning_end``); their rows stay unmasked, their matchers unadvanced
        self._reasoning: dict[int, tuple[str, int]] = {}
        self._windows: dict[str, int] = {}  # marker -> its window (the marker tokenized once per engine)
        self._executor = None

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, seqs: Iterable) -> None:
        """Give each constrained sequence its matcher; ValueError if the grammar is invalid."""
        for seq in seqs:
            so = seq.sampling_params.structured_outputs
            if so is not None:
                self._matchers[seq.seq_id] = self.compiler.matcher(so)
                end = seq.sampling_params.reasoning_end
                if end is not None and not self._has_marker(seq.output_token_ids, end, None):
                    self._reasoning[seq.seq_id] = (end, self._window(end))

    def _window(self, marker: str) -> int:
        """How many of the last tokens to decode to see ``marker`` whole, however the output split it."""
        if marker not in self._windows:
            self._windows[marker] = 2 * len(self.compiler.hf_tokenizer.encode(marker, add_special_tokens=False)) + 4
        return self._windows[marker]

    def _has_marker(self, token_ids: Sequence[int], marker: str, window: int | None) -> bool:
        if not token_ids:
            return False
        tail = token_ids if window is None else token_ids[-window:]
        return marker in self.compiler.hf_tokenizer.decode(list(tail), skip_special_tokens=False)

    def fill_bitmask(self, entries: Sequence, bitmask: np.ndarray) -> bool:
        """Write the allowed-token bits of each constrained entry that samples this step into its row of
        ``bitmask`` (i32[S, W], rows in plan order); other rows are left as they are. True if any was written."""
        from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

        rows = [(m, slot) for slot, e in enumerate(entries)
                if e.needs_sample and (m := self._matchers.get(e.seq.seq_id)) is not None
                and e.seq.seq_id not in self._reasoning]
        if not rows:
            return False
        words = self.compiler.bitmask_words
        # The matchers write rows of their own width; one that differs from the model's goes through a scratch
        # array (ids past the model's vocabulary cannot be sampled; ids past the tokenizer's are never allowed).
        target = bitmask if words == bitmask.shape[1] else np.zeros((len(rows), words), np.int32)
        place = rows if target is bitmask else [(m, i) for i, (m, _) in enumerate(rows)]
        if len(place) == 1:
            fill_next_token_bitmask(place[0][0], target, place[0][1])
        else:
            if self._executor is None:
                from llguidance import LLExecutor

                self._executor = LLExecutor()
            fill_next_token_bitmask_par(self._executor, place, target)
        if target is not bitmask:
            width = min(words, bitmask.shape[1])
            for i, (_, slot) in enumerate(rows):
                bitmask[slot] = 0
                bitmask[slot, :width] = target[i, :width]
        return True

    def accept(self, seqs: Iterable) -> None:
        """Advance each constrained sequence's matcher by the token it just got."""
        for seq in seqs:
            m = self._matchers.get(seq.seq_id)
            waiting = self._reasoning.get(seq.seq_id)  # only constrained sequences wait
            if waiting is not None:
                # still reasoning: the matcher starts with the token after the one that completes the marker
                if self._has_marker(seq.output_token_ids, *waiting):
                    del self._reasoning[seq.seq_id]
                continue
            if m is not None and not m.is_stopped() and not m.consume_token(seq.last_token):
                # Cannot happen while masks are applied; logged so a mismatch shows.
                logger.warning("sequence %s of request %s: token %d does not match its grammar (%s)",
                               seq.index, seq.request_id, seq.last_token, m.get_error())

    def release(self, seqs: Iterable) -> None:
        for seq in seqs:
            self._matchers.pop(seq.seq_id, None)
            self._reasoning.pop(seq.seq_id, None)
