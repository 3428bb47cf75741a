"""Reasoning parsers: each family's split of a whole output and of the same output streamed in pieces that cut
its markers, and the template switches (``enable_thinking`` / ``thinking``) that turn the reasoning off."""

import pytest

from jaxserve.text.reasoning import REASONING_PARSERS, make_reasoning_parser

pytestmark = pytest.mark.quick

GPT_OSS = ("<|channel|>analysis<|message|>The user wants Oslo.<|end|><|start|>assistant<|channel|>final"
           "<|message|>Oslo is sunny.")


def streamed(parser, text, size):
    s = parser.stream()
    reasoning = content = ""
    for i in range(0, len(text), size):
        d = s.feed(text[i:i + size])
        reasoning, content = reasoning + d.reasoning, content + d.content
    d = s.finish()
    return reasoning + d.reasoning, content + d.content


@pytest.mark.parametrize("name, kwargs, text, reasoning, content", [
    ("deepseek_r1", None, "Let me think.\n</think>\n\nOslo.", "Let me think.\n", "\n\nOslo."),
    ("deepseek_r1", None, "<think>Hmm</think>Oslo.", "Hmm", "Oslo."),
    ("deepseek_r1", None, "cut short while thinking", "cut short while thinking", None),
    ("deepseek_v3", None, "Hmm</think>Oslo.", None, "Hmm</think>Oslo."),
    ("deepseek_v3", {"thinking": True}, "Hmm</think>Oslo.", "Hmm", "Oslo."),
    ("qwen3", None, "<think>\nHmm\n</think>\n\nOslo.", "\nHmm\n", "\n\nOslo."),
    ("qwen3", {"enable_thinking": False}, "Oslo.", None, "Oslo."),
    ("qwen3", None, "Hmm<tool_call>\n{}</tool_call>", "Hmm", "<tool_call>\n{}</tool_call>"),
    ("glm45", None, "Hmm</think>Oslo.", "Hmm", "Oslo."),
    ("glm45", {"enable_thinking": False}, "Oslo.", None, "Oslo."),
    ("kimi_k2", None, "Hmm</think>Oslo.", "Hmm", "Oslo."),
    ("kimi_k2", {"thinking": False}, "Oslo.", None, "Oslo."),
    ("kimi_k2", None, "Hmm<|tool_calls_section_begin|>x", "Hmm", "<|tool_calls_section_begin|>x"),
    ("mistral", None, "[THINK]Hmm[/THINK]Oslo.", "Hmm", "Oslo."),
    ("mistral", None, "Oslo, no [THINK] here", None, "Oslo, no [THINK] here"),
    ("openai_gptoss", None, GPT_OSS, "The user wants Oslo.", "Oslo is sunny."),
])
def test_split_whole_and_streamed(name, kwargs, text, reasoning, content):
    parser = make_reasoning_parser(name, kwargs)
    assert parser.split(text) == (reasoning, content)
    for size in (1, 2, 5):  # pieces that cut every marker somewhere
        assert streamed(parser, text, size) == (reasoning or "", content or "")


def test_streamed_pieces_are_final():
    """A marker's first characters are held, never sent as reasoning and then taken back."""
    s = make_reasoning_parser("deepseek_r1").stream()
    assert s.feed("Hmm </thi").reasoning == "Hmm "
    d = s.feed("nk>Oslo")
    assert (d.reasoning, d.content) == ("", "Oslo")


def test_names_are_vllms():
    assert {"deepseek_r1", "deepseek_v3", "qwen3", "openai_gptoss", "mistral", "kimi_k2", "glm45"} <= set(
        REASONING_PARSERS)
    with pytest.raises(ValueError, match="reasoning_parser"):
        make_reasoning_parser("nope")
