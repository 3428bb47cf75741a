"""Auto tool choice end to end: a server with --enable-auto-tool-choice --tool-call-parser hermes turns the
model's output into tool_calls, streamed or not. The random-weight model is steered to write a call with a
guided_choice, so the parser sees exactly what a tool-calling model writes."""

from __future__ import annotations

import json

import openai
import pytest

from server_harness import MODEL_NAME, start_server
from test_server_structured import WEATHER

CALL = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
MESSAGES = [{"role": "user", "content": "Oslo?"}]


@pytest.fixture(scope="module")
def client(request):
    server = start_server(request, "tools", ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    try:
        with openai.OpenAI(base_url=server.http + "/v1", api_key="none", max_retries=0, timeout=120) as c:
            yield c
    finally:
        server.terminate()


def test_auto_tool_calls_are_parsed(client):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], max_tokens=90,
                                          temperature=1.0, extra_body={"guided_choice": [CALL]})
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}


def test_auto_tool_calls_stream(client):
    chunks = [c for c in client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], max_tokens=90, temperature=1.0, stream=True,
        extra_body={"guided_choice": [CALL]}) if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or ())]
    # vLLM's streaming deltas: the first names the call (id, type, name), the ones after add argument text
    assert content == "Sure." and {tc.index for tc in calls} == {0}
    assert calls[0].id and calls[0].function.name == "get_weather"
    assert all(tc.id is None and tc.function.name is None for tc in calls[1:])
    arguments = "".join(tc.function.arguments or "" for tc in calls)
    assert json.loads(arguments) == {"city": "Oslo"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], max_tokens=30,
                                           temperature=1.0, extra_body={"guided_choice": ["no tools needed"]})
    assert plain.choices[0].message.content == "no tools needed" and plain.choices[0].message.tool_calls is None
