"""Prompt tokenization for the servers, off the engine thread.

The engine thread must never spend its time on one request's text: a multi-megabyte prompt or a long chat would
stall every other stream for as long as it takes to tokenize. ``PromptTokenizer`` does that work in a small
pool of worker threads, each with its own copy of the tokenizer (Hugging Face fast tokenizers release the GIL
while they encode, so the engine keeps stepping meanwhile), and refuses before any tokenization a prompt whose
size alone shows it cannot fit ``max_model_len``: a token covers at most ``chars_per_token`` characters, a
generous bound taken from the longest entry of the vocabulary (special tokens included). Text under
``INLINE_CHARS`` characters is tokenized in the calling (event loop) thread with that thread's own copy: it
takes microseconds, less than the hop to a worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import re
import threading
from collections.abc import Sequence
from typing import Any

from jaxserve.text.request_checks import RequestChecks
from jaxserve.text.tokenizer import chat_template_ids

logger = logging.getLogger(__name__)

MIN_CHARS_PER_TOKEN = 16
INLINE_CHARS = 512  # text this short is tokenized in the caller's thread: microseconds, less than a thread hop


def first_invalid_char(text: str) -> int | None:
    """Index of the first character that is not valid Unicode text (a lone surrogate), or None."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's characters (GPT-2's scheme): printable bytes stand for themselves, the others are
    numbered from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in chars.values()]
    chars.update({chr(256 + i): b for i, b in enumerate(others)})
    return chars


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer, token_id: int, text: str) -> bytes:
    """The raw bytes of one token. ``text`` (the token decoded on its own) is exact unless the token holds only
    part of a UTF-8 character (it then decodes to U+FFFD); such tokens are read from the vocabulary: a
    byte-fallback piece ``<0xE2>``, or a byte-level BPE piece."""
    if "\ufffd" not in text:
        return text.encode("utf-8")
    try:
        piece = tokenizer.convert_ids_to_tokens(int(token_id))
    except Exception:  # noqa: BLE001 - a tokenizer without the lookup keeps the decoded text
        return text.encode("utf-8")
    if isinstance(piece, str):
        match = _BYTE_FALLBACK.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if piece and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
    return text.encode("utf-8")


def chars_per_token_bound(tokenizer) -> int:
    """Most characters of prompt text one token can stand for, generously: twice the longest vocabulary entry
    (normalizers can fold a few characters into one), and at least ``MIN_CHARS_PER_TOKEN``."""
    try:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=0)
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary gets the floor times 4
        longest = 2 * MIN_CHARS_PER_TOKEN
    return max(MIN_CHARS_PER_TOKEN, 2 * longest)


class PromptTokenizer:
    """Tokenizes prompts and chat conversations in worker threads.

    Args:
      tokenizer: the engine's tokenizer; each worker thread works on its own deep copy.
      max_model_len: the longest sequence the engine serves, in tokens.
      vocab_size: token ids must lie in [0, vocab_size).
      num_workers: worker threads.
      checks: the engine's request checks (by default those of max_model_len and vocab_size alone); ``encode``
        runs their prompt check.
    """

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int, *, num_workers: int = 2,
                 checks: RequestChecks | None = None):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.checks = checks or RequestChecks(max_model_len, vocab_size, tokenizer is not None)
        self.chars_per_token = chars_per_token_bound(tokenizer)
        self.max_prompt_chars = max_model_len * self.chars_per_token
        self._local = threading.local()
        self._pool = concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix="jaxserve-tokenize")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _own(self):
        """This worker thread's tokenizer."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            try:
                tok = copy.deepcopy(self.tokenizer)
            except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared (encode is read-only)
                tok = self.tokenizer
            self._local.tokenizer = tok
        return tok

    async def _run(self, fn, *args, chars: int | None = None) -> Any:
        """``fn(*args)`` in a worker thread, or right here for ``chars`` under ``INLINE_CHARS``."""
        if chars is not None and chars <= INLINE_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # Checks that need no tokenizer --------------------------------------------------------------------------
    def check_text(self, text: str, field: str = "prompt") -> None:
        """ValueError, naming ``field``, for text that is not valid Unicode or too long to ever fit."""
        bad = first_invalid_char(text)
        if bad is not None:
            raise ValueError(f"{field} is not valid Unicode text: a lone surrogate {text[bad]!r} at character {bad}")
        if len(text) > self.max_prompt_chars:
            raise ValueError(
                f"{field} has {len(text)} characters: at most {self.chars_per_token} characters per token, it "
                f"cannot fit max_model_len={self.max_model_len} tokens (longest accepted: {self.max_prompt_chars})")

    # Tokenization -------------------------------------------------------------------------------------------
    async def encode(self, prompt: str | Sequence[int] | None, messages: list[dict] | None = None,
                     add_generation_prompt: bool = True, *, fit: bool = True, template_options: dict | None = None,
                     add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text or token-id prompt, or of chat ``messages`` in the chat template; with ``fit``,
        the ids pass ``checks.prompt`` (inside the vocabulary, room for output in ``max_model_len``).

        Raises:
          ValueError: naming the problem (invalid text, too long to fit, a template that refuses the messages).
        """
        if self.tokenizer is None and (messages is not None or isinstance(prompt, str)):
            raise ValueError(f"{'messages' if messages is not None else 'prompt'}: this server runs with "
                             "--skip-tokenizer-init, so prompts must be token ids")
        if messages is not None:
            total = 0
            for i, m in enumerate(messages):
                for key, value in m.items():
                    if isinstance(value, str):
                        self.check_text(value, f"messages[{i}].{key}")
                        total += len(value)
            if total > self.max_prompt_chars:
                raise ValueError(f"messages have {total} characters in all: they cannot fit "
                                 f"max_model_len={self.max_model_len} tokens")
            ids = await self._run(self._template, messages, add_generation_prompt, template_options or {},
                                  chars=total)
        elif isinstance(prompt, str):
            self.check_text(prompt)
            ids = await self._run(self._encode, prompt, add_special_tokens, chars=len(prompt))
        else:
            ids = [int(t) for t in prompt or ()]
        if fit:
            self.checks.prompt(ids)  # not empty, inside the vocabulary, room for output
        elif not ids:
            raise ValueError("prompt is empty")
        return ids

    def _needs_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer; this server runs with --skip-tokenizer-init")

    async def tokens(self, text: str) -> tuple[list[int], list[str]]:
        """Token ids of ``text`` as a prompt, and each token decoded on its own."""
        self._needs_tokenizer("tokenizing text")
        self.check_text(text)
        return await self._run(self._tokens, text)

    async def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each token id decoded on its own."""
        self._needs_tokenizer("token texts")
        return await self._run(lambda: [self._own().decode([t]) for t in ids])

    async def token_pieces(self, ids: Sequence[int]) -> list[str]:
        """Each token id's entry in the vocabulary (``convert_ids_to_tokens``), as vLLM's ``token_strs``."""
        self._needs_tokenizer("token strings")
        return await self._run(lambda: [str(t) for t in self._own().convert_ids_to_tokens([int(i) for i in ids])])

    async def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of token ids (special tokens kept unless ``skip_special_tokens``); ValueError for an id
        outside the vocabulary."""
        ids = [int(t) for t in ids]
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"tokens: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        self._needs_tokenizer("detokenizing")
        return await self._run(self._decode, ids, skip_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(t) for t in self._own().encode(text, add_special_tokens=add_special_tokens)]

    def _template(self, messages: list[dict], add_generation_prompt: bool, options: dict) -> list[int]:
        return chat_template_ids(self._own(), messages, add_generation_prompt, **options)

    def _tokens(self, text: str) -> tuple[list[int], list[str]]:
        tok = self._own()
        ids = [int(t) for t in tok.encode(text)]
        return ids, [tok.decode([t]) for t in ids]

    def _decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        tok = self._own()
        return tok.decode(ids, skip_special_tokens=True) if skip_special_tokens else tok.decode(ids)
