"""Streaming token-to-text conversion with stop strings.

Each step decodes only a short window of recent tokens: ``ids[prefix:read]`` is text already emitted (context
that fixes spacing, e.g. SentencePiece's word-start "▁" whose space the decoder strips at the start of a
decode) and ``ids[read:]`` is new; the delta is ``decode(ids[prefix:])`` minus ``decode(ids[prefix:read])``.
Text is held back while it may still change:

* the window's text ends with U+FFFD: a multi-byte character is split across tokens;
* the last token is a byte-fallback token (``<0xE4>``): the ByteFallback decoder turns a whole run of byte
  tokens into U+FFFDs if any byte in it is invalid, so a later byte can still rewrite the run;
* the text's tail could be the start of a stop string (unless the stop string is to be included).

With those holds the deltas concatenate to ``tokenizer.decode(output_ids, skip_special_tokens=...,
clean_up_tokenization_spaces=False)`` once ``finish`` has released the tail (clean-up rewrites spaces around
punctuation after the fact, so it cannot be streamed). Fast (Rust-backed) tokenizers are the target.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence

_REPLACEMENT = "\ufffd"
# Prompt tokens that seed the window when decoding in the prompt's context; a handful is enough for any
# decoder's look-behind (word-start spaces, a split character).
_PROMPT_CONTEXT_TOKENS = 6
# Token ids before the window are dropped once this many pile up, so memory stays O(window).
_TRIM_AT = 256

_facts_cache: "weakref.WeakKeyDictionary[object, _TokenizerFacts]" = weakref.WeakKeyDictionary()


class _TokenizerFacts:
    """What the detokenizer needs from a tokenizer, computed once per tokenizer object."""

    def __init__(self, tokenizer):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self.decode: Callable[[list[int]], str] = lambda ids: backend.decode(ids, skip_special_tokens=False)
            added = backend.get_added_tokens_decoder()
            self.special_ids = frozenset(i for i, tok in added.items() if tok.special)
            decoder = backend.decoder
            uses_fallback = decoder is not None and b'"ByteFallback"' in decoder.__getstate__()
            byte_ids = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256)) if uses_fallback else ()
            self.byte_ids = frozenset(i for i in byte_ids if i is not None)
        else:
            self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            self.special_ids = frozenset(tokenizer.all_special_ids)
            self.byte_ids = frozenset()


def _facts(tokenizer) -> _TokenizerFacts:
    try:
        facts = _facts_cache.get(tokenizer)
        if facts is None:
            facts = _facts_cache[tokenizer] = _TokenizerFacts(tokenizer)
        return facts
    except TypeError:  # not weak-referenceable or not hashable: no caching
        return _TokenizerFacts(tokenizer)


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas and watches for stop strings.

    After a stop string matches, ``finished`` is True, ``stop_reason`` names it, and the emitted text ends
    before it (or after it, with ``include_stop_str_in_output``); the engine then finishes the request with
    reason "stop". Otherwise the engine calls ``finish`` when the request ends (EOS, stop token, length) to
    release text still held back.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        prompt_context: bool = False,
    ):
        """
        Args:
          tokenizer: a ``transformers`` tokenizer (fast ones are decoded through their Rust backend).
          prompt_token_ids: the request's prompt; only read with ``prompt_context``.
          skip_special_tokens: drop special tokens from the text, as ``tokenizer.decode`` does.
          stop: strings that end the request when they appear in the output text.
          include_stop_str_in_output: keep the matched stop string at the end of the text.
          prompt_context: decode the first output tokens after the prompt's last tokens, so a word-start token
            keeps the space it has mid-sentence ("Hello" + "▁world" streams " world"). The deltas then add up
            to ``decode(prompt + output)`` minus ``decode(prompt)``, instead of ``decode(output)``.
        Raises:
          ValueError: if a stop string is empty or not a string.
        """
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop={stop!r} must be non-empty strings")
        facts = _facts(tokenizer)
        self._decode = facts.decode
        self._skip = facts.special_ids if skip_special_tokens else frozenset()
        self._byte_ids = facts.byte_ids
        self._stops = stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self._include_stop = include_stop_str_in_output
        self._ids: list[int] = []  # window tokens (prompt context, then output), special tokens already skipped
        self._prefix = 0  # ids[prefix:read] decode to text already emitted: the window's context
        self._read = 0
        self._prefix_text: str | None = ""  # decode(ids[prefix:read]); None = not computed yet
        if prompt_context:
            self._ids = [t for t in prompt_token_ids if t not in self._skip][-_PROMPT_CONTEXT_TOKENS:]
            self._read = len(self._ids)
            self._prefix_text = None
        self._text = ""  # decoded output text that no longer changes (cut at a stop string)
        self._sent = 0  # characters of _text returned so far
        self.stop_reason: str | None = None
        self.finished = False

    @classmethod
    def for_request(cls, tokenizer, prompt_token_ids: Sequence[int], params, **kw) -> "IncrementalDetokenizer":
        """Configured from a request's ``SamplingParams`` (stop, skip_special_tokens, include_stop_str_in_output);
        with no tokenizer (``skip_tokenizer_init``) one that releases no text."""
        if tokenizer is None:
            return NoTextDetokenizer()
        return cls(tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                   include_stop_str_in_output=params.include_stop_str_in_output, **kw)

    @property
    def output_text(self) -> str:
        """All text returned so far."""
        return self._text[: self._sent]

    def add(self, token_ids: Iterable[int]) -> str:
        """Take newly generated tokens and return the text they release (often "" while text is held back).

        Tokens after a matched stop string are ignored.
        """
        parts = []
        for token in token_ids:
            if self.finished:
                break
            parts.append(self._add_one(int(token)))
        return "".join(parts)

    def finish(self) -> str:
        """Release everything held back (the request ended for another reason); later tokens are ignored.

        Returns:
          The remaining text delta, itself cut at a stop string if one completes in it.
        """
        if self.finished:
            return ""
        delta = ""
        if self._read < len(self._ids):
            window_text = self._decode(self._ids[self._prefix :])
            delta = window_text[len(self._window_prefix_text()) :]
            self._advance()
        out = self._accept(delta, final=True)
        self.finished = True
        return out

    def _add_one(self, token: int) -> str:
        if token in self._skip:
            return ""
        self._ids.append(token)
        if token in self._byte_ids:
            return ""
        window_text = self._decode(self._ids[self._prefix :])
        if window_text.endswith(_REPLACEMENT):
            return ""
        delta = window_text[len(self._window_prefix_text()) :]
        self._advance()
        return self._accept(delta, final=False)

    def _window_prefix_text(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        return self._prefix_text

    def _advance(self) -> None:
        # The tokens just emitted become the context of the next window.
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = None
        if self._prefix >= _TRIM_AT:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0

    def _accept(self, delta: str, *, final: bool) -> str:
        """Append stable text, cut it at the first stop string, and return what may be shown now."""
        search_from = max(0, len(self._text) - self._max_stop + 1)  # a match must end in the new text
        self._text += delta
        if self._stops:
            # The stop string that completes first when reading left to right (the longest if several end
            # at the same character), so the cut depends on the text alone, not on how tokens chunk it.
            hit = None
            for s in self._stops:
                i = self._text.find(s, search_from)
                if i >= 0 and (hit is None or (i + len(s), -len(s)) < (hit[0] + len(hit[1]), -len(hit[1]))):
                    hit = (i, s)
            if hit is not None:
                i, s = hit
                self._text = self._text[: i + len(s) if self._include_stop else i]
                self.stop_reason, self.finished = s, True
                out, self._sent = self._text[self._sent :], len(self._text)
                return out
        end = len(self._text) - (0 if final or self._include_stop else self._stop_prefix_len())
        out, self._sent = self._text[self._sent : end], end
        return out

    def _stop_prefix_len(self) -> int:
        """Length of the longest unsent tail of the text that is a proper prefix of a stop string."""
        tail = self._text[max(self._sent, len(self._text) - self._max_stop + 1) :]
        for n in range(len(tail), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self._stops):
                return n
        return 0


class NoTextDetokenizer:
    """The detokenizer of an engine without a tokenizer: outputs carry token ids only."""

    finished = False
    stop_reason = None
    output_text = ""

    def add(self, token_ids: Iterable[int]) -> str:
        return ""

    def finish(self) -> str:
        return ""
