"""One choice's output read for the chat API: reasoning split off first, tool calls read from the answer after
it, streamed in pieces or whole; gpt-oss's harmony channels (analysis, a commentary call, final)."""

import json

import pytest

from jaxserve.sampling_params import SamplingParams
from jaxserve.server.openai.chat_output import ChoiceOutput
from jaxserve.server.openai.tool_calls import ToolCallStream, make_parser
from jaxserve.text.reasoning import make_reasoning_parser, reasoning_first

pytestmark = pytest.mark.quick

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


def reader(reasoning, tools):
    return ChoiceOutput(make_reasoning_parser(reasoning),
                        ToolCallStream(make_parser(tools), False, None, TOOLS) if tools else None)


def run(reasoning, tools, text, size):
    r = reader(reasoning, tools)
    deltas = [r.feed(text[i:i + size]) for i in range(0, len(text), size)] + [r.finish()]
    return r, deltas


QWEN = ("<think>\nOslo, so get_weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
        "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("size", [1, 4, len(QWEN)])
def test_reasoning_then_a_call(size):
    r, deltas = run("qwen3", "qwen3_coder", QWEN, size)
    assert "".join(d.reasoning for d in deltas) == "\nOslo, so get_weather.\n"
    assert "".join(d.content for d in deltas).strip() == ""
    calls = [c for d in deltas for c in d.tool_calls]
    assert calls[0]["function"] == {"name": "get_weather"}
    assert json.loads("".join(c["function"].get("arguments", "") for c in calls)) == {"city": "Oslo", "days": 2}
    message = r.message()
    assert message["reasoning"] == "\nOslo, so get_weather.\n" and message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo", "days": 2}
    assert "reasoning" not in r.message(include_reasoning=False)


def test_a_tool_marker_inside_the_reasoning_is_not_a_call():
    text = "<think>I could write <tool_call> here</think>Just text."
    r, _ = run("deepseek_r1", "hermes", text, 3)
    assert r.message() == {"role": "assistant", "content": "Just text.", "reasoning": "I could write <tool_call> here"}


def test_no_parser_leaves_the_text_alone():
    r, _ = run(None, None, "<think>x</think>y", 2)
    assert r.message() == {"role": "assistant", "content": "<think>x</think>y"}


HARMONY = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
           "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}")


@pytest.mark.parametrize("size", [3, len(HARMONY)])
def test_harmony_analysis_and_a_commentary_call(size):
    r, deltas = run("openai_gptoss", "openai", HARMONY, size)  # <|call|> is a stop token: not in the text
    assert "".join(d.reasoning for d in deltas) == "Need weather."
    calls = [c for d in deltas for c in d.tool_calls]
    assert calls[0]["function"] == {"name": "get_weather"}
    assert json.loads("".join(c["function"].get("arguments", "") for c in calls)) == {"city": "Oslo"}
    message = r.message()
    assert message["content"] is None and message["reasoning"] == "Need weather."
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_harmony_final_answer():
    r, _ = run("openai_gptoss", None, "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant"
               "<|channel|>final<|message|>Sunny.", 2)
    assert r.message() == {"role": "assistant", "content": "Sunny.", "reasoning": "Easy."}


def test_structured_output_waits_for_the_reasoning_end_where_the_output_starts_in_reasoning():
    so = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert reasoning_first(so, make_reasoning_parser("qwen3")).reasoning_end == "</think>"
    assert reasoning_first(so, make_reasoning_parser("deepseek_r1")).reasoning_end == "</think>"
    # constrained from the first token: enable_in_reasoning, thinking off, no reasoning parser, a family whose
    # output starts in content, gpt-oss's channels, or no constraint at all
    assert reasoning_first(so, make_reasoning_parser("qwen3"), in_reasoning=True).reasoning_end is None
    assert reasoning_first(so, make_reasoning_parser("qwen3", {"enable_thinking": False})).reasoning_end is None
    assert reasoning_first(so, None).reasoning_end is None
    assert reasoning_first(so, make_reasoning_parser("mistral")).reasoning_end is None
    assert reasoning_first(so, make_reasoning_parser("openai_gptoss")).reasoning_end is None
    assert reasoning_first(SamplingParams(), make_reasoning_parser("qwen3")).reasoning_end is None
