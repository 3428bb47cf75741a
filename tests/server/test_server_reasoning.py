"""Reasoning and family tool calls end to end: a server with --reasoning-parser qwen3 --tool-call-parser
qwen3_coder and a Qwen3.5-style chat template (tests/data) answers through the openai client with
message.reasoning apart from content, whole and streamed, and the XML calls after the reasoning as tool_calls.
The random-weight model is steered with a guided_choice to write what a thinking model writes."""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from jaxserve.server.protos import jaxserve_pb2 as pb
from jaxserve.server.protos import jaxserve_pb2_grpc as pb_grpc
from server_harness import MODEL_NAME, PARSERS_KEY, parsers_server

WEATHER = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}}}}
MESSAGES = [{"role": "user", "content": "Oslo?"}]
THOUGHT = "Oslo is in Norway.\n</think>\n\nIt is sunny."
CALL = "W\n</think>\n\n<tool_call>\n<function=f>\n<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>"


@pytest.fixture(scope="module")
def client(request):
    server = parsers_server(request)
    with openai.OpenAI(base_url=server.http + "/v1", api_key=PARSERS_KEY, max_retries=0, timeout=120) as c:
        yield c


def ask(client, choice, **kw):
    kw.setdefault("max_tokens", 100)
    return client.chat.completions.create(model=MODEL_NAME, messages=kw.pop("messages", MESSAGES),
                                          temperature=1.0, extra_body={"guided_choice": [choice], **kw.pop(
                                              "extra", {})}, **kw)


@pytest.mark.quick
def test_reasoning_apart_from_content(client):
    message = ask(client, THOUGHT).choices[0].message
    assert message.reasoning == "Oslo is in Norway.\n" and message.content == "\n\nIt is sunny."
    chunks = [c for c in ask(client, THOUGHT, stream=True) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == "Oslo is in Norway.\n"
    assert "".join(d.content or "" for d in deltas) == "\n\nIt is sunny."
    assert sum(1 for d in deltas if getattr(d, "reasoning", None)) >= 2  # streamed, not sent at the end
    hidden = ask(client, THOUGHT, extra={"include_reasoning": False}).choices[0].message
    assert getattr(hidden, "reasoning", None) is None and hidden.content == "\n\nIt is sunny."


def test_thinking_off_is_all_content(client):
    out = ask(client, "It is sunny.", extra={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.choices[0].message.content == "It is sunny."
    assert getattr(out.choices[0].message, "reasoning", None) is None


def test_a_call_after_the_reasoning(client):
    out = ask(client, CALL, tools=[WEATHER], max_tokens=None).choices[0]  # the rest of the 256-token context
    assert out.finish_reason == "tool_calls" and out.message.reasoning == "W\n"
    (call,) = out.message.tool_calls
    assert call.function.name == "f" and json.loads(call.function.arguments) == {"n": 2}
    chunks = [c for c in ask(client, CALL, tools=[WEATHER], stream=True, max_tokens=None) if c.choices]
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or ())]
    assert deltas[0].id and deltas[0].function.name == "f"
    args = [d.function.arguments for d in deltas[1:]]
    assert len(args) >= 2 and json.loads("".join(args)) == {"n": 2}  # spans chunks
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.fixture(scope="module")
def stub(request):
    with grpc.insecure_channel(parsers_server(request).grpc) as channel:
        yield pb_grpc.JaxServeStub(channel)


def generate(stub, choice, **kw) -> list[pb.GenerateResponse]:
    limit = {"max_tokens": kw.pop("max_tokens", 100)}  # None: the rest of the 256-token context
    sampling = pb.SamplingParams(temperature=1.0, **{k: v for k, v in limit.items() if v is not None},
                                 **kw.pop("sampling", {}),
                                 structured_outputs=pb.StructuredOutputs(choice=pb.Choices(choices=[choice])))
    request = pb.GenerateRequest(text="<|im_start|>user\nOslo?<|im_end|>\n<|im_start|>assistant\n<think>\n",
                                 sampling_params=sampling, **kw)
    return list(stub.Generate(request, metadata=(("authorization", f"Bearer {PARSERS_KEY}"),), timeout=120))


def test_grpc_generate_streams_the_reasoning_apart_from_the_text(stub):
    msgs = generate(stub, THOUGHT)
    assert "".join(m.reasoning for m in msgs) == "Oslo is in Norway.\n"
    assert "".join(m.text for m in msgs) == "\n\nIt is sunny."
    assert sum(1 for m in msgs if m.reasoning) >= 2  # streamed, not sent at the end
    assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP and not msgs[-1].tool_calls
    raw = generate(stub, THOUGHT, separate_reasoning=False, sampling=dict(skip_special_tokens=False))
    assert "".join(m.text for m in raw) == THOUGHT and not any(m.reasoning for m in raw)
    off = generate(stub, "It is sunny.", enable_thinking=False)
    assert "".join(m.text for m in off) == "It is sunny." and not any(m.reasoning for m in off)


@pytest.mark.parametrize("kw, needle", [
    (dict(tools="[{"), "tools is not JSON"),
    (dict(tools='{"a": 1}'), "tools must be a JSON list"),
    (dict(tools='[{"type": "function"}]'), "tools[0] must be"),
    (dict(tools="[]", parse_tool_calls=False), "tools is read only with parse_tool_calls"),
])
def test_grpc_bad_tools_get_invalid_argument(stub, kw, needle):
    kw.setdefault("parse_tool_calls", True)
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, THOUGHT, **kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()


def test_grpc_generate_returns_the_call_after_the_reasoning(stub):
    msgs = generate(stub, CALL, parse_tool_calls=True, tools=json.dumps([WEATHER]), max_tokens=None)
    assert "".join(m.reasoning for m in msgs) == "W\n"
    assert "".join(m.text for m in msgs).strip() == "" and "<tool_call>" not in "".join(m.text for m in msgs)
    (call,) = msgs[-1].tool_calls
    assert call.name == "f" and json.loads(call.arguments) == {"n": 2} and call.id.startswith("call_")
    assert not any(m.tool_calls for m in msgs[:-1])
    untyped = generate(stub, CALL, parse_tool_calls=True, max_tokens=None)[-1].tool_calls[0]
    assert json.loads(untyped.arguments) == {"n": "2"}  # no schema: the XML value stays text
    # without parse_tool_calls the call stays in the text
    plain = generate(stub, CALL, max_tokens=None)
    assert "<tool_call>" in "".join(m.text for m in plain) and not plain[-1].tool_calls
