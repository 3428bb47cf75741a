"""OpenAI's Responses API end to end, through the official ``openai`` client against one server (an API key,
--reasoning-parser qwen3, --tool-call-parser qwen3_coder and a Qwen3.5-style thinking template): the greedy
answer is the chat completions answer for the same conversation, as a reasoning item and a message item;
instructions are the system message; a cut-off answer is incomplete; the stream accumulates to the same
response, its events in the order the client reads; a forced function call and its output; text.format;
errors naming the field; the API key."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

from jaxserve.server.intake import RequestError
from jaxserve.server.openai.chat_output import OutputDelta
from jaxserve.server.openai.response_output import ResponseOutput
from jaxserve.server.openai.responses import ResponseStore, ResponsesRequest, chat_request
from server_harness import MODEL_NAME, PARSERS_KEY, parsers_server

KEY = PARSERS_KEY
USER = [{"role": "user", "content": "Oslo?"}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}  # the template's empty think block: all text
GREEDY = {"temperature": 0}
ZONE = {"type": "function", "name": "get_time", "description": "the time in a zone", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}
CITY = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Bergen"]}}, "required": ["city"],
        "additionalProperties": False}


# The translation, without a server ----------------------------------------------------------------------------
@pytest.mark.quick
def test_input_becomes_a_chat_request():
    req = chat_request(ResponsesRequest.model_validate({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 5, "seed": 3, "unknown_field": 1,
        "store": True, "metadata": {"k": "v"}, "reasoning": {"effort": "low"},
        "tools": [ZONE], "tool_choice": {"type": "function", "name": "get_time"}, "parallel_tool_calls": False,
        "input": [
            {"role": "developer", "content": "Use UTC."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Time"},
                                                            {"type": "input_text", "text": "now?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                            "text": "hm"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see.",
                                                                  "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": '{"zone": "UTC"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "9"}]}))
    messages = req.template_messages()
    assert [(m["role"], m["content"]) for m in messages] == [
        ("system", "Be brief."), ("system", "Use UTC."), ("user", "Time\nnow?"), ("assistant", "Let me see."),
        ("tool", "9")]
    assert messages[3]["reasoning_content"] == "hm"  # the reasoning item and what follows are one turn
    assert messages[3]["tool_calls"] == [{"id": "c1", "type": "function",
                                          "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]
    assert messages[4]["tool_call_id"] == "c1"
    assert req.tool_choice == {"type": "function", "function": {"name": "get_time"}}
    assert req.parallel_tool_calls is False and req.tools[0]["function"]["parameters"] == ZONE["parameters"]
    assert req.chat_template_kwargs == {"reasoning_effort": "low"}
    params = req.sampling_params()
    assert params.max_tokens == 5 and params.seed == 3
    assert json.loads(params.structured_outputs.json) == ZONE["parameters"]  # the forced call's schema
    plain = chat_request(ResponsesRequest.model_validate({"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "city", "schema": CITY, "strict": True}}}))
    assert plain.template_messages() == [{"role": "user", "content": "hi"}]
    assert json.loads(plain.sampling_params().structured_outputs.json) == CITY


@pytest.mark.quick
@pytest.mark.parametrize("body, param, needle", [
    ({"background": True}, "background", "background is not supported"),
    ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"input": []}, "input", "input is empty"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "'item_reference' are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "'input_image' is not supported"),
    ({"tool_choice": "required"}, "tool_choice", "no tools are given"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "schema is required"),
    ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
])
def test_refused_requests(body, param, needle):
    with pytest.raises(RequestError, match=re.escape(needle)) as caught:
        chat_request(ResponsesRequest.model_validate({"model": "m", "input": "hi", **body}))
    assert caught.value.param == param


@pytest.mark.quick
def test_items_from_deltas():
    output = ResponseOutput()
    events = output.add(OutputDelta(reasoning="a")) + output.add(OutputDelta(reasoning="b", content="c"))
    events += output.add(OutputDelta(content=" d"))
    events += output.add(OutputDelta(tool_calls=[{"index": 0, "id": "call_1", "type": "function",
                                                  "function": {"name": "f"}}]))
    events += output.add(OutputDelta(tool_calls=[{"index": 0, "function": {"arguments": '{"x": '}}]))
    events += output.add(OutputDelta(tool_calls=[{"index": 0, "function": {"arguments": "1}"}}]))
    events += output.close("incomplete")
    rs, msg, fc = output.items
    assert rs == {"id": rs["id"], "type": "reasoning", "summary": [], "status": "completed",
                  "content": [{"type": "reasoning_text", "text": "ab"}]}
    assert msg == {"id": msg["id"], "type": "message", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": "c d", "annotations": []}]}
    assert fc == {"id": fc["id"], "type": "function_call", "call_id": "call_1", "name": "f",
                  "arguments": '{"x": 1}', "status": "incomplete"}  # the item cut off
    assert [(e["type"], e["output_index"]) for e in events] == [
        ("response.output_item.added", 0), ("response.content_part.added", 0),
        ("response.reasoning_text.delta", 0), ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0), ("response.content_part.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.content_part.added", 1),
        ("response.output_text.delta", 1), ("response.output_text.delta", 1), ("response.output_text.done", 1),
        ("response.content_part.done", 1), ("response.output_item.done", 1),
        ("response.output_item.added", 2), ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.delta", 2), ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2)]
    assert events[0]["item"]["status"] == "in_progress" and events[0]["item"]["content"] == []
    assert events[6]["item"] == rs and events[13]["item"] == msg and events[-1]["item"] == fc
    assert output.text == "c d"


@pytest.mark.quick
@pytest.mark.parametrize("then, kinds", [
    ([OutputDelta(tool_calls=[{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": "{}"}}])],
     ["reasoning", "function_call"]),  # whitespace before a call: dropped, as vLLM drops it
    ([], ["reasoning", "message"]),
    ([OutputDelta(content="e")], ["reasoning", "message"])])
def test_whitespace_after_the_reasoning(then, kinds):
    output = ResponseOutput()
    for delta in [OutputDelta(reasoning="a", content="\n\n")] + then:
        output.add(delta)
    output.close()
    assert [i["type"] for i in output.items] == kinds
    if kinds[-1] == "message":
        assert output.text == "\n\n" + "".join(d.content for d in then)


# Through the server ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(request):
    return parsers_server(request)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.http + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def create(client, extra=OFF, **kw):
    kw.setdefault("max_output_tokens", 12)
    return client.responses.create(model=MODEL_NAME, input=kw.pop("input", USER), temperature=0,
                                   extra_body=extra, **kw)


def shape(response) -> dict:
    """A response as compared across calls: everything but the ids (its own, its items', its calls'), its time
    and how much of its prompt the prefix cache held."""
    out = response.to_dict(exclude_none=True)
    for key in ("id", "created_at"):
        out.pop(key)
    for item in out["output"]:
        assert item.pop("id") and (item["type"] != "function_call" or item.pop("call_id"))
    out["usage"]["input_tokens_details"].pop("cached_tokens")
    return out


def test_greedy_answer_is_the_chat_answer(client):
    for extra in (OFF, None):
        want = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=12, temperature=0,
                                              extra_body=extra).choices[0]
        got = create(client, extra=extra)
        assert got.object == "response" and got.id.startswith("resp_") and got.model == MODEL_NAME
        reasoning = getattr(want.message, "reasoning", None)
        items = [(i.type, i.content[0].text) for i in got.output]
        expected = ([("reasoning", reasoning)] if reasoning else []) + (
            [("message", want.message.content)] if want.message.content else [])
        assert items == expected and expected, (extra, items)
        assert (extra is None) == (items[0][0] == "reasoning")  # the reasoning parser split it off
        assert got.output_text == (want.message.content or "")
        # cut off by max_output_tokens, as the chat answer is by max_tokens
        assert want.finish_reason == "length" and got.status == "incomplete"
        assert got.incomplete_details.reason == "max_output_tokens" and got.output[-1].status == "incomplete"
        assert got.usage.output_tokens == 12 and got.usage.total_tokens == got.usage.input_tokens + 12
        reasoning_tokens = got.usage.output_tokens_details.reasoning_tokens
        assert reasoning_tokens == (12 if reasoning and not want.message.content else 0), reasoning_tokens
        assert got.max_output_tokens == 12 and got.temperature == 0


def test_reasoning_tokens_count_the_reasoning_only(client):
    thought = "Oslo is in Norway.\n</think>\n\nIt is sunny."  # steered (the server constrains the reasoning too)
    got = create(client, extra={"structured_outputs": {"choice": [thought]}}, max_output_tokens=60)
    assert [i.type for i in got.output] == ["reasoning", "message"] and got.output_text == "\n\nIt is sunny."
    reasoning_tokens = got.usage.output_tokens_details.reasoning_tokens
    assert 0 < reasoning_tokens < got.usage.output_tokens, (reasoning_tokens, got.usage.output_tokens)


def test_instructions_are_the_system_message(client):
    system = [{"role": "system", "content": "Be brief."}] + USER
    want = client.chat.completions.create(model=MODEL_NAME, messages=system, max_tokens=6, temperature=0,
                                          extra_body=OFF)
    got = create(client, instructions="Be brief.", max_output_tokens=6)
    assert got.instructions == "Be brief." and got.output_text == want.choices[0].message.content
    assert got.usage.input_tokens == want.usage.prompt_tokens > create(client, max_output_tokens=1).usage.input_tokens


def test_a_finished_answer_is_completed(client):
    text = create(client, max_output_tokens=8).output_text
    stop = next(text[k:k + 2] for k in range(2, len(text)) if text[k:k + 2].strip())
    got = create(client, max_output_tokens=8, extra={**OFF, "stop": [stop]})  # vLLM's extra
    assert got.status == "completed" and got.incomplete_details is None
    assert got.output_text == text[:text.index(stop)]


@pytest.mark.parametrize("extra", [OFF, None])
def test_stream_accumulates_to_the_response(client, extra):
    whole = create(client, extra=extra, max_output_tokens=10)
    with client.responses.stream(model=MODEL_NAME, input=USER, max_output_tokens=10, temperature=0,
                                 extra_body=extra) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert shape(streamed) == shape(whole)
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    delta = "response.reasoning_text.delta" if extra is None else "response.output_text.delta"
    assert kinds.count(delta) >= 2  # streamed, not sent at the end


def test_raw_stream_events(server):
    body = {"model": MODEL_NAME, "input": "Oslo?", "max_output_tokens": 3, "stream": True, **OFF}
    with httpx.stream("POST", server.http + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as r:
        text = r.read().decode()
    assert r.headers["content-type"].startswith("text/event-stream") and "[DONE]" not in text
    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {events[-1]['type']}"
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"] + [
        "response.output_text.delta"] * deltas + ["response.output_text.done", "response.content_part.done",
                                                  "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    done = events[-1]["response"]
    assert done["status"] == "incomplete" and done["output"] == [events[-2]["item"]]
    assert done["output"][0]["content"][0]["text"] == "".join(e["delta"] for e in events[4:4 + deltas])
    stream_event = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)
    for event in events:  # every field the client's types require, in every event
        stream_event.validate_python(event)
    openai.types.responses.Response.model_validate(done)


def test_forced_function_call_and_its_output(client):
    # 50: the rest of the context after the tools' prompt; random weights pad the JSON with whitespace
    kw = {"tools": [ZONE], "tool_choice": {"type": "function", "name": "get_time"}, "max_output_tokens": 50}
    got = create(client, **kw)
    assert got.status == "completed", got
    (call,) = [i for i in got.output if i.type == "function_call"]
    assert call.name == "get_time" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), ZONE["parameters"])
    with client.responses.stream(model=MODEL_NAME, input=USER, temperature=0, extra_body=OFF, **kw) as stream:
        streamed = stream.get_final_response()
    assert shape(streamed) == shape(got)
    history = USER + [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                       "arguments": call.arguments},
                      {"type": "function_call_output", "call_id": call.call_id, "output": "9"},
                      {"role": "user", "content": "And in Bergen?"}]
    plain = create(client, input=history, max_output_tokens=4)  # no tools: their prompt fills the context
    assert [i.type for i in plain.output] == ["message"] and plain.usage.output_tokens == 4
    assert plain.usage.input_tokens > create(client, max_output_tokens=1).usage.input_tokens + 10


def test_previous_response_id_continues_a_stored_conversation(client, server):
    """A stored response (store, the default) is continued by previous_response_id: the answer is the one to the
    whole conversation sent in input (the first turn's input and output, then the new input); its instructions
    are not carried over. GET reads it back; one stored with store=false, or never, is a 404 naming the field."""
    first = create(client, max_output_tokens=4, instructions="Be brief.")
    assert first.store is True and client.responses.retrieve(first.id).output_text == first.output_text
    follow = [{"role": "user", "content": "And Bergen?"}]
    got = create(client, input=follow, previous_response_id=first.id, max_output_tokens=5)
    assert got.previous_response_id == first.id
    whole = USER + [{"role": "assistant", "content": first.output_text}] + follow
    assert got.output_text == create(client, input=whole, max_output_tokens=5).output_text
    assert got.usage.input_tokens > first.usage.input_tokens  # the earlier turn is in the prompt
    # a chain: the third turn sees both earlier ones
    third = create(client, input=[{"role": "user", "content": "Thanks"}], previous_response_id=got.id,
                   max_output_tokens=3)
    assert third.usage.input_tokens > got.usage.input_tokens
    unstored = create(client, max_output_tokens=2, store=False)
    for rid in (unstored.id, "resp_never"):
        resp = httpx.post(server.http + "/v1/responses", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                          json={"model": MODEL_NAME, "input": "hi", "previous_response_id": rid})
        assert resp.status_code == 404 and resp.json()["error"]["param"] == "previous_response_id", resp.text
        assert httpx.get(server.http + f"/v1/responses/{rid}", headers={"Authorization": f"Bearer {KEY}"},
                         timeout=60).status_code == 404


@pytest.mark.quick
def test_the_store_keeps_the_most_recent():
    store = ResponseStore(limit=2)
    for i in range(3):
        store.put(f"r{i}", [{"type": "message", "role": "user", "content": str(i)}], {"id": f"r{i}"})
    assert store.get("r2")[1] == {"id": "r2"} and store.get("r1")[0][0]["content"] == "1"
    with pytest.raises(RequestError, match="'r0' not found") as caught:
        store.get("r0")
    assert caught.value.status == 404 and caught.value.param == "previous_response_id"


def test_text_format_json_schema(client):
    got = create(client, max_output_tokens=40, text={"format": {"type": "json_schema", "name": "city",
                                                                "schema": CITY, "strict": True}},
                 extra={**OFF, "structured_outputs": {"disable_any_whitespace": True}})
    assert got.status == "completed" and got.text.format.type == "json_schema"
    jsonschema.validate(json.loads(got.output_text), CITY)


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "temperature": "hot"}, "temperature"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    ({}, "input"),
])
def test_bad_fields_are_named(server, body, param):
    resp = httpx.post(server.http + "/v1/responses", json={"model": MODEL_NAME, **body},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and param in err["message"], err


def test_api_key(server):
    with openai.OpenAI(base_url=server.http + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=1)
    none = httpx.post(server.http + "/v1/responses", json={"model": MODEL_NAME, "input": "hi"})
    assert none.status_code == 401
