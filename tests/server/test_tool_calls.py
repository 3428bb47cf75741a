"""Tool calling: the parsers (hermes, llama3_json, mistral), streamed content before a call, forced tool_choice
schemas, history messages, and the tools reaching the chat template."""

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
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("parser, text, content, calls", [
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
])
def test_parsers(parser, text, content, calls):
    got_content, got = make_parser(parser).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    # streamed in small pieces: the content before the call goes out as it arrives, never a marker's prefix
    stream = ToolCallStream(make_parser(parser), False, None)
    sent = "".join(stream.feed(text[i:i + 3]) for i in range(0, len(text), 3))
    rest, streamed = stream.finish()
    assert [(c.name, json.loads(c.arguments)) for c in streamed] == calls
    if calls:
        assert "<tool_call" not in sent and "[TOOL_" not in sent and (sent + rest).strip() == (content or "")
    else:
        assert sent + rest == text


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
