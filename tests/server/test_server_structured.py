"""Structured output over HTTP with the official ``openai`` client: ``response_format`` on chat and completions,
vLLM's ``structured_outputs`` and ``guided_*`` fields; every output (sampled at temperature 1) validates."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from server_harness import API_KEY, MODEL_NAME, pages_idle, shared_server
from test_structured_output import PERSON

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "Describe a person."}]


@pytest.fixture(scope="module")
def server(request):
    return shared_server(request)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.http + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http, headers=AUTH, timeout=120) as c:
        yield c


def test_chat_json_schema_outputs_validate(client):
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=1.0, n=3, max_tokens=80, seed=11,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})  # random weights love whitespace
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_completion_json_object_and_streaming_chat_choice(client):
    resp = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", temperature=1.0, n=2,
                                     max_tokens=100, seed=3, extra_body={"response_format": {"type": "json_object"},
                                                 "structured_outputs": {"disable_any_whitespace": True}})
    for choice in resp.choices:
        assert isinstance(json.loads(choice.text), dict)
    chunks = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=1.0, max_tokens=10,
                                            stream=True, extra_body={"guided_choice": ["alpha", "beta"]})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text in ("alpha", "beta")


@pytest.mark.parametrize("field, value, check", [
    ("guided_regex", r"\d{3}-[a-z]{2}", lambda t: re.fullmatch(r"\d{3}-[a-z]{2}", t)),
    ("guided_json", PERSON, lambda t: jsonschema.validate(json.loads(t), PERSON) or True),
    ("guided_grammar", 'start: "x" ("+" "x")*', lambda t: re.fullmatch(r"x(\+x)*", t)),
    ("structured_outputs", {"choice": ["left", "right"]}, lambda t: t in ("left", "right")),
])
def test_vllm_fields_on_completions(client, field, value, check):
    resp = client.completions.create(model=MODEL_NAME, prompt="Paged attention", temperature=1.0, n=2,
                                     max_tokens=100, seed=5,
                                     extra_body={field: value, "guided_whitespace_pattern": " ?"})
    for choice in resp.choices:
        assert check(choice.text), (field, choice.text)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "hi", "guided_json": {"type": "nonsense"}}, None),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "(("}, None),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "structured_outputs": {"colour": "red"}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),
])
def test_invalid_constraints_are_400(server, http, path, body, param):
    resp = http.post(path, json={"model": MODEL_NAME, **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param or param is None, err
    assert server.wait_metrics(pages_idle)["jaxserve_kv_pages_used"] == 0


# Tool calling -----------------------------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "user", "content": "And the time?"},
]


def test_forced_tool_choice_returns_valid_tool_calls(client):
    named = client.chat.completions.create(
        model=MODEL_NAME, messages=HISTORY, tools=[WEATHER, TIME], temperature=1.0, n=2, max_tokens=40, seed=2,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    for choice in named.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_time" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
    required = client.chat.completions.create(
        model=MODEL_NAME, messages=HISTORY[-1:], tools=[WEATHER, TIME], temperature=1.0, n=2, max_tokens=100, seed=3,
        tool_choice="required", parallel_tool_calls=False,  # random weights would call on and on
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=HISTORY, tools=[WEATHER], temperature=1.0, max_tokens=40, seed=2, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}}))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or ())]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


@pytest.mark.parametrize("body, needle", [
    ({"tools": [WEATHER]}, "--enable-auto-tool-choice"),  # tool_choice 'auto' by default
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0]"),
    ({"tool_choice": "required"}, "needs tools"),
])
def test_bad_tool_requests_are_400(http, body, needle):
    resp = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": HISTORY, **body})
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"]


def test_tool_choice_none_keeps_plain_text(client):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=HISTORY, tools=[WEATHER], tool_choice="none",
                                          max_tokens=4, temperature=0)
    assert resp.choices[0].message.tool_calls is None and resp.choices[0].message.content is not None


# Chat-template options --------------------------------------------------------------------------------------------
def test_chat_template_options(http):
    def prompt_tokens(**body):
        resp = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 1, **body})
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens"]

    msgs = [{"role": "user", "content": "hi"}]
    templated = http.post("/tokenize", json={"messages": msgs}).json()["count"]
    bare = http.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()["count"]
    assert bare < templated
    assert prompt_tokens(messages=msgs) == templated
    assert prompt_tokens(messages=msgs, add_generation_prompt=False) == bare
    cont = msgs + [{"role": "assistant", "content": "The quick"}]
    assert prompt_tokens(messages=cont, add_generation_prompt=False, continue_final_message=True) > bare
    # text parts are joined with newlines, as vLLM does
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    joined = [{"role": "user", "content": "a\nb"}]
    assert (http.post("/tokenize", json={"messages": parts}).json()["tokens"]
            == http.post("/tokenize", json={"messages": joined}).json()["tokens"])
    for body, needle in ((dict(messages=cont, continue_final_message=True), "continue_final_message"),
                         (dict(messages=msgs, chat_template="{{ 1 }}"), "--chat-template"),
                         (dict(messages=msgs, chat_template_kwargs={"tokenize": False}), "tokenize")):
        resp = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 1, **body})
        assert resp.status_code == 400 and needle in resp.json()["error"]["message"], resp.text
