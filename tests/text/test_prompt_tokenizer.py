"""PromptTokenizer: the size bound checked before tokenizing, invalid text, raw token bytes."""

from __future__ import annotations

import asyncio

import pytest

from jaxserve.models.demo import byte_tokenizer
from jaxserve.text.prompt_tokenizer import MIN_CHARS_PER_TOKEN, PromptTokenizer, chars_per_token_bound, token_bytes

pytestmark = pytest.mark.quick


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_size_bound_refuses_before_tokenizing(tok):
    p = PromptTokenizer(tok, max_model_len=32, vocab_size=259)
    assert p.chars_per_token == chars_per_token_bound(tok) >= MIN_CHARS_PER_TOKEN
    with pytest.raises(ValueError, match="cannot fit max_model_len=32"):
        p.check_text("x" * (p.max_prompt_chars + 1))
    with pytest.raises(ValueError, match="lone surrogate"):
        p.check_text("ok \udc80")
    ids = asyncio.run(p.encode("hello"))
    assert ids == tok.encode("hello")
    with pytest.raises(ValueError, match="leaves no room for output"):
        asyncio.run(p.encode("y" * 40))  # short enough to tokenize, too many tokens to serve
    assert asyncio.run(p.encode("y" * 40, fit=False))[-1] == ord("y")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        asyncio.run(p.encode([1, 300]))
    assert asyncio.run(p.decode(tok.encode("hi", add_special_tokens=False))) == "hi"
    p.close()


def test_token_bytes_are_raw_even_for_part_of_a_character(tok):
    ids = tok.encode("é€", add_special_tokens=False)
    raw = [token_bytes(tok, t, tok.decode([t])) for t in ids]
    assert b"".join(raw) == "é€".encode() and all(len(r) == 1 for r in raw)
    assert token_bytes(tok, tok.encode("a", add_special_tokens=False)[0], "a") == b"a"
