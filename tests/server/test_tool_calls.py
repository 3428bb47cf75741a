"""Tool calling: every family's parser, whole and streamed in pieces that split its markers and its calls (vLLM's
deltas: id, type and name first, then argument fragments), forced tool_choice schemas, history messages, and the
tools reaching the chat template."""

import json

import jsonschema
import pytest

from jaxserve.server.intake import RequestError
from jaxserve.server.openai.tool_calls import (ToolCallStream, check_tools, forced_calls, forced_schema, make_parser,
                                        template_message)

pytestmark = pytest.mark.quick

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}
WEATHER_DAYS = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


PARSER_CASES = [
    ("hermes", 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
               '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     "Let me check.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("hermes", "no calls here", "no calls here", []),
    ("hermes", "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                    '{"name": "get_time", "parameters": {}}',
     None, [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    ("llama3_json", "It is sunny.", "It is sunny.", []),
    ("mistral", 'Sure [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Bern"}}]',
     "Sure", [("get_weather", {"city": "Bern"})]),
    ("qwen3_coder", "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                    "<function=get_time>\n</function>\n</tool_call>",
     "Checking.", [("get_weather", {"city": "Oslo", "days": 3}), ("get_time", {})]),
    ("qwen3_coder", "x < y, no calls", "x < y, no calls", []),
    ("glm45", "Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call><tool_call>get_time\n</tool_call>",
     "Sure.", [("get_weather", {"city": "Oslo", "days": 3}), ("get_time", {})]),
    ("deepseek_v3", "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Oslo",\n "days": 3}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                    "get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "Sure.", [("get_weather", {"city": "Oslo", "days": 3}), ("get_time", {})]),
    ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo", "days": 3}'
                     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     None, [("get_weather", {"city": "Oslo", "days": 3})]),
    ("kimi_k2", "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                '<|tool_call_argument_begin|>{"city": "Oslo", "days": 3}<|tool_call_end|><|tool_call_begin|>'
                "functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
     "Sure.", [("get_weather", {"city": "Oslo", "days": 3}), ("get_time", {})]),
    ("pythonic", "[get_weather(city='Oslo', days=3), get_time()]",
     None, [("get_weather", {"city": "Oslo", "days": 3}), ("get_time", {})]),
    ("pythonic", "<|python_start|>[get_time()]<|python_end|>", None, [("get_time", {})]),
    ("pythonic", "Sunny [maybe]", "Sunny [maybe]", []),
]


def streamed(parser, text, size=3, tools=(WEATHER_DAYS, TIME)):
    """(content, calls rebuilt from the deltas, the deltas, the final calls) of ``text`` fed ``size`` characters
    at a time."""
    stream = ToolCallStream(make_parser(parser), False, None, list(tools))
    content, deltas = "", []
    for i in range(0, len(text), size):
        c, d = stream.feed(text[i:i + size])
        content, deltas = content + c, deltas + d
    c, d = stream.finish()
    content, deltas = content + c, deltas + d
    calls: dict[int, dict] = {}
    for d in deltas:
        if d["index"] not in calls:  # vLLM's first delta of a call: its id, type and name
            assert d["type"] == "function" and d["id"] and set(d["function"]) == {"name"}
            calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, [calls[k] for k in sorted(calls)], deltas, stream.calls


@pytest.mark.parametrize("parser, text, content, calls", PARSER_CASES)
def test_parsers(parser, text, content, calls):
    got_content, got = make_parser(parser).parse(text, [WEATHER_DAYS, TIME])
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    # streamed in small pieces: the content before the call goes out as it arrives, never a marker's prefix
    sent, rebuilt, _, final = streamed(parser, text)
    assert [(c["name"], json.loads(c["arguments"])) for c in rebuilt] == calls
    assert [(c.name, c.arguments) for c in final] == [(c["name"], c["arguments"]) for c in rebuilt]
    if calls:
        assert sent.strip() == (content or "") and "<" not in sent.strip()[-1:]
    else:
        assert sent == text


@pytest.mark.parametrize("parser", ["deepseek_v3", "deepseek_v31", "kimi_k2", "qwen3_coder", "glm45"])
def test_arguments_stream_in_fragments(parser):
    """A call whose arguments span many chunks goes out in several argument deltas, each final."""
    text = next(t for p, t, _, c in PARSER_CASES if p == parser and c)
    _, rebuilt, deltas, _ = streamed(parser, text, size=2)
    fragments = [d for d in deltas if d["index"] == 0 and "arguments" in d["function"]]
    assert len(fragments) >= 2 and json.loads(rebuilt[0]["arguments"]) == {"city": "Oslo", "days": 3}
    assert all(d["function"]["arguments"] for d in fragments)


def test_kimi_k2_keeps_its_call_ids():
    (call,) = make_parser("kimi_k2").parse("<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{}"
                                           "<|tool_call_end|>")[1]
    assert call.id == "functions.get_time:0" and call.name == "get_time"


def test_unfinished_calls_are_not_returned_whole():
    text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Os"
    assert make_parser("deepseek_v31").parse(text) == (text, [])


def test_forced_tool_choice_schemas():
    tools = check_tools([WEATHER, TIME])
    schema, name = forced_schema(tools, {"type": "function", "function": {"name": "get_weather"}})
    assert name == "get_weather" and schema == WEATHER["function"]["parameters"]
    assert [c.name for c in forced_calls('{"city": "Oslo"}', name)] == ["get_weather"]
    schema, name = forced_schema(tools, "required")
    good = [{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], schema)
    assert [c.name for c in forced_calls(json.dumps(good), None)] == ["get_time", "get_weather"]
    assert forced_schema(tools, "auto") == (None, None) and forced_schema(tools, "none") == (None, None)
    for bad in ({"type": "function", "function": {"name": "nope"}}, "sometimes"):
        with pytest.raises(RequestError):
            forced_schema(tools, bad)
    with pytest.raises(RequestError, match="tools"):
        check_tools([{"type": "function"}])


def test_history_tool_calls_reach_the_template_as_objects():
    msg = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    assert template_message(msg)["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
