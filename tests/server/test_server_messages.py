"""Anthropic's Messages API end to end, through the official ``anthropic`` client against one server (an API key,
--reasoning-parser qwen3, --tool-call-parser qwen3_coder and a Qwen3.5-style thinking template): the greedy
answer is the chat completions answer for the same conversation, in thinking and text blocks; stop reasons;
the stream accumulates to the same message; a forced tool call and its result; errors in Anthropic's shape;
count_tokens."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import jsonschema
import openai
import pytest

from jaxserve.server.intake import RequestError
from jaxserve.server.openai.chat_output import OutputDelta
from jaxserve.server.openai.message_content import MessageContent
from jaxserve.server.openai.messages import MessagesRequest, chat_request
from server_harness import MODEL_NAME, PARSER_FLAGS, start_server

KEY = "messages-key"
USER = [{"role": "user", "content": "Oslo?"}]
OFF = {"type": "disabled"}  # the template's empty think block: the answer is all text
ZONE = {"name": "get_time", "description": "the time in a zone", "input_schema": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}


# The translation, without a server ----------------------------------------------------------------------------
@pytest.mark.quick
def test_a_conversation_becomes_a_chat_request():
    req = chat_request(MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "stop_sequences": ["END"], "metadata": {"user_id": "u"}, "unknown_field": 1, "thinking": OFF,
        "tools": [ZONE], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": USER + [
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "tool_use", "id": "t1", "name": "get_time",
                                               "input": {"zone": "UTC"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "9"},
                                         {"type": "text", "text": "and"}, {"type": "text", "text": "CET?"}]}]}))
    assert [(m["role"], m["content"]) for m in req.template_messages()] == [
        ("system", "Be brief."), ("user", "Oslo?"), ("assistant", ""), ("tool", "9"), ("user", "and\nCET?")]
    assistant = req.template_messages()[2]
    assert assistant["reasoning_content"] == "hm" and assistant["tool_calls"][0]["id"] == "t1"
    assert assistant["tool_calls"][0]["function"] == {"name": "get_time", "arguments": {"zone": "UTC"}}
    assert req.template_messages()[3]["tool_call_id"] == "t1"
    assert req.tool_choice == "required" and req.parallel_tool_calls is False
    assert req.tools[0]["function"]["parameters"] == ZONE["input_schema"]
    assert req.chat_template_kwargs == {"enable_thinking": False, "thinking": False}
    params = req.sampling_params()
    assert params.max_tokens == 5 and params.stop == ("END",)


@pytest.mark.quick
@pytest.mark.parametrize("body, needle", [
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content is empty"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]},
     "cannot hold a block of type 'tool_use'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": [
        {"type": "image", "source": {}}]}]}]}, "only text blocks"),
    ({"messages": USER, "thinking": {"type": "enabled"}}, "budget_tokens is required"),
    ({"messages": USER, "tools": [ZONE], "tool_choice": {"type": "tool"}}, "tool_choice.name is required"),
])
def test_refused_conversations(body, needle):
    with pytest.raises(RequestError, match=re.escape(needle)):
        chat_request(MessagesRequest.model_validate({"model": "m", "max_tokens": 5, **body}))


@pytest.mark.quick
def test_content_blocks_from_deltas():
    content = MessageContent()
    events = content.add(OutputDelta(reasoning="a")) + content.add(OutputDelta(reasoning="b", content="c"))
    events += content.add(OutputDelta(tool_calls=[{"index": 0, "id": "t", "type": "function",
                                                   "function": {"name": "f"}}]))
    events += content.add(OutputDelta(tool_calls=[{"index": 0, "function": {"arguments": '{"x": '}}]))
    events += content.add(OutputDelta(tool_calls=[{"index": 0, "function": {"arguments": "1}"}}]))
    events += content.close()
    signature = content.blocks[0]["signature"]
    assert signature and content.blocks == [{"type": "thinking", "thinking": "ab", "signature": signature},
                                            {"type": "text", "text": "c"},
                                            {"type": "tool_use", "id": "t", "name": "f", "input": {"x": 1}}]
    assert [(e["type"], e.get("index"), e.get("delta", {}).get("type")) for e in events] == [
        ("content_block_start", 0, None), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None), ("content_block_start", 1, None), ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None), ("content_block_start", 2, None),
        ("content_block_delta", 2, "input_json_delta"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None)]
    assert events[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}


# Through the server ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(request):
    # A server of its own, the shared one's flags (server_harness.parsers_server): the stream test below counts
    # one delta per token, which a server whose prefix cache already holds the prompt does not promise.
    s = start_server(request, "messages", ["--api-key", KEY, *PARSER_FLAGS])
    try:
        yield s
    finally:
        s.terminate()


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.http, api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def chat(server):
    with openai.OpenAI(base_url=server.http + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


GREEDY = {"temperature": 0}  # the client (2.x) has no sampling arguments: the field goes as an extra


def create(client, **kw):
    kw.setdefault("max_tokens", 12)
    return client.messages.create(model=MODEL_NAME, messages=kw.pop("messages", USER), extra_body=GREEDY, **kw)


def shape(message) -> dict:
    """A message as compared across calls: everything but the ids (its own, its tool calls') and the thinking
    blocks' signatures; fields left null (the client's stream sets some of them) count as absent."""
    out = message.to_dict(exclude_none=True)
    out.pop("id")
    for block in out["content"]:
        block.pop("signature", None)
        if block["type"] == "tool_use":
            assert block.pop("id")
    return out


def test_greedy_answer_is_the_chat_answer(client, chat):
    for kwargs, thinking in (({"enable_thinking": False}, OFF), ({}, None)):
        want = chat.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=12, temperature=0,
                                            extra_body={"chat_template_kwargs": kwargs}).choices[0]
        got = create(client, **({"thinking": thinking} if thinking else {}))
        assert got.type == "message" and got.role == "assistant" and got.id.startswith("msg_")
        blocks = [(b.type, b.thinking if b.type == "thinking" else b.text) for b in got.content]
        reasoning = getattr(want.message, "reasoning", None)
        expected = ([("thinking", reasoning)] if reasoning else []) + (
            [("text", want.message.content)] if want.message.content else [])
        assert blocks == expected and expected, (kwargs, blocks)
        assert (kwargs == {}) == (blocks[0][0] == "thinking")  # the reasoning parser split it off
        assert got.stop_reason == "max_tokens" and got.stop_sequence is None
        assert got.usage.output_tokens == 12 and got.usage.input_tokens > 0


def test_stop_sequence(client):
    text = create(client, thinking=OFF, max_tokens=12).content[0].text
    stop = next(text[k:k + 2] for k in range(2, len(text)) if text[k:k + 2].strip())
    got = create(client, thinking=OFF, max_tokens=12, stop_sequences=["never-written", stop])
    assert got.stop_reason == "stop_sequence" and got.stop_sequence == stop
    before = text[:text.index(stop)]
    assert [b.text for b in got.content] == ([before] if before else [])


def test_stream_events_are_named(server):
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 3, "stream": True, "thinking": OFF}
    with httpx.stream("POST", server.http + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        text = r.read().decode()
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e.split("\n") for e in text.strip().split("\n\n")]
    for name, data in events:  # an event: line, then its data, whose type is the event's name
        assert name.startswith("event: ") and json.loads(data.removeprefix("data: "))["type"] == name[7:]
    assert [e[0][7:] for e in events] == ["message_start", "content_block_start"] + ["content_block_delta"] * 3 + [
        "content_block_stop", "message_delta", "message_stop"] and "[DONE]" not in text


@pytest.mark.parametrize("thinking", [OFF, None])
def test_stream_accumulates_to_the_message(client, thinking):
    kw = {"thinking": thinking} if thinking else {}
    whole = create(client, max_tokens=10, **kw)
    with client.messages.stream(model=MODEL_NAME, messages=USER, max_tokens=10, extra_body=GREEDY, **kw) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert shape(streamed) == shape(whole)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    if thinking is None:  # a thinking block is signed when it ends
        assert streamed.content[0].type == "thinking" and streamed.content[0].signature


def test_forced_tool_call_and_its_result(client):
    # 50: the rest of the context after the tools' prompt; random weights pad the JSON with whitespace
    got = create(client, thinking=OFF, tools=[ZONE], tool_choice={"type": "tool", "name": "get_time"},
                 max_tokens=50)
    assert got.stop_reason == "tool_use", got
    (call,) = [b for b in got.content if b.type == "tool_use"]
    assert call.name == "get_time" and call.id
    jsonschema.validate(call.input, ZONE["input_schema"])
    with client.messages.stream(model=MODEL_NAME, messages=USER, max_tokens=50, extra_body=GREEDY, thinking=OFF,
                                tools=[ZONE], tool_choice={"type": "tool", "name": "get_time"}) as stream:
        streamed = stream.get_final_message()
    assert shape(streamed) == shape(got)
    history = USER + [{"role": "assistant", "content": [b.to_dict() for b in got.content]},
                      {"role": "user", "content": [
                          {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "9"}]},
                          {"type": "text", "text": "And in Bergen?"}]}]
    plain = create(client, messages=history, thinking=OFF, max_tokens=4)  # no tools: their prompt fills the context
    assert plain.stop_reason == "max_tokens" and [b.type for b in plain.content] == ["text"]
    turn = client.messages.count_tokens(model=MODEL_NAME, messages=history[:1], thinking=OFF).input_tokens
    whole = client.messages.count_tokens(model=MODEL_NAME, messages=history, thinking=OFF).input_tokens
    assert plain.usage.input_tokens == whole > turn + 10  # the call and its result are in the prompt


def test_count_tokens_is_the_prompt(client, chat):
    want = chat.chat.completions.create(model=MODEL_NAME, messages=[{"role": "system", "content": "Be brief."}] + USER,
                                        max_tokens=1).usage.prompt_tokens
    got = client.messages.count_tokens(model=MODEL_NAME, system="Be brief.", messages=USER)
    assert got.input_tokens == want


@pytest.mark.parametrize("body, status, kind, needle", [
    ({"messages": USER}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": "hi"}, 400, "invalid_request_error", "messages"),
    ({"max_tokens": 0, "messages": USER}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     400, "invalid_request_error", "image"),
    ({"max_tokens": 4, "messages": USER, "model": "nope"}, 404, "not_found_error", "nope"),
])
def test_errors_in_anthropic_shape(server, body, status, kind, needle):
    resp = httpx.post(server.http + "/v1/messages", json={"model": MODEL_NAME, **body},
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}, timeout=60)
    assert resp.status_code == status, resp.text
    err = resp.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and needle in err["error"]["message"], err


def test_api_key(server, client):
    with anthropic.Anthropic(base_url=server.http, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            bad.messages.create(model=MODEL_NAME, messages=USER, max_tokens=1)
    assert caught.value.body["error"]["type"] == "authentication_error"
    none = httpx.post(server.http + "/v1/messages", json={"model": MODEL_NAME, "messages": USER, "max_tokens": 1})
    assert none.status_code == 401 and none.json()["error"]["type"] == "authentication_error"
    bearer = httpx.post(server.http + "/v1/messages", json={"model": MODEL_NAME, "messages": USER, "max_tokens": 1},
                        headers={"authorization": f"Bearer {KEY}"}, timeout=60)
    assert bearer.status_code == 200 and bearer.json()["usage"]["output_tokens"] == 1
    chat = httpx.post(server.http + "/v1/chat/completions", json={"messages": USER, "max_tokens": 1},
                      headers={"x-api-key": KEY})
    assert chat.status_code == 401  # x-api-key is the Messages API's header only
    assert json.loads(chat.text)["error"]["type"] == "authentication_error"
