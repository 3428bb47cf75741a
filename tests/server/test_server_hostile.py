"""Hostile and careless clients against both front ends, over a stand-in engine (the point is the server): bad
Unicode, deep or odd JSON, out-of-range numbers, non-boolean booleans, over-limit requests, internal failures.
Every client error is a 400 (gRPC INVALID_ARGUMENT) with a one-line message; an internal failure is a 500 with
an id and nothing of the failure, logged once."""

from __future__ import annotations

import json
import logging

import grpc
import httpx
import pytest

from fake_server import MODEL, FakeServer
from jaxserve.server.protos import jaxserve_pb2 as pb
from jaxserve.server.protos import jaxserve_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def server():
    with FakeServer(max_num_seqs=4) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc) as channel:
        yield pb_grpc.JaxServeStub(channel)


def _post(http, path: str, raw: str | bytes) -> httpx.Response:
    return http.post(path, content=raw, headers={"content-type": "application/json"})


def _error(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and "\n" not in err["message"] and err["code"] == status, err
    return err


DEEP = "[" * 100_000 + "]" * 100_000
BAD_COMPLETIONS = [
    ('{"prompt": "\\ud800 hi"}', "lone surrogate", "prompt"),
    ('{"prompt": ["ok", "\\udfff"]}', "lone surrogate", "prompt"),
    ('{"prompt": "hi", "stop": ["\\ud800"]}', "lone surrogate", "stop"),
    ('{"prompt": "hi", "seed": 1180591620717411303424}', "seed", "seed"),  # 2**70
    ('{"prompt": "hi", "temperature": NaN}', "NaN", None),
    ('{"prompt": "hi", "temperature": 1e999}', "temperature", "temperature"),
    ('{"prompt": "hi", "top_k": 1180591620717411303424}', "top_k", "top_k"),
    ('{"prompt": "hi", "stream": "yes"}', "stream", "stream"),
    ('{"prompt": "hi", "stream": 1}', "stream", "stream"),
    ('{"prompt": "hi", "ignore_eos": "true"}', "ignore_eos", "ignore_eos"),
    ('{"prompt": "hi", "max_tokens": "many"}', "max_tokens", "max_tokens"),
    ('{"prompt": {"a": 1}}', "prompt", "prompt"),
    ('{"prompt": [[1, 2], "x"]}', "prompt", "prompt"),
    ('{"prompt": "hi", "stop_token_ids": [-1]}', "stop_token_ids", "stop_token_ids"),
    ('{"prompt": [1, 2, 3000000000]}', "prompt", "prompt"),
    ('{"prompt": "hi", "n": 1000}', "--max-n", "n"),
    ('{"prompt": "hi", "n": 2, "best_of": 1000}', "--max-n", "best_of"),
    (json.dumps({"prompt": ["p"] * 1000}), "--max-prompts-per-request", "prompt"),
    (json.dumps({"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}), "--max-stop-strings", "stop"),
    (json.dumps({"prompt": "hi", "stop": ["x" * 257]}), "--max-stop-string-chars", "stop"),
    ('{"prompt": "hi", "logprobs": 21}', "logprobs", "logprobs"),
    (json.dumps({"prompt": "x" * 100_000}), "cannot fit max_model_len", "prompt"),
    (DEEP, "nested too deeply", None),
    ('{"prompt": "hi", "user": ' + "[" * 40 + "]" * 40 + "}", "nested too deeply", None),
    ('"just a string"', "JSON object", None),
    ("{\"prompt\": \"hi\"", "not valid JSON", None),
    (b'{"prompt": "\xff\xfe"}', "not valid JSON", None),
]


@pytest.mark.parametrize("raw, needle, param", BAD_COMPLETIONS, ids=range(len(BAD_COMPLETIONS)))
def test_bad_completions_get_a_one_line_400(http, raw, needle, param):
    err = _error(_post(http, "/v1/completions", raw))
    assert needle in err["message"], err
    if param is not None:
        assert err["param"] == param, err


BAD_CHATS = [
    ('{"messages": [{"role": "user", "content": "\\ud800"}]}', "lone surrogate", "messages"),
    ('{"messages": [{"role": "\\udc00", "content": "hi"}]}', "lone surrogate", "messages"),
    ('{"messages": [{"role": "user", "content": "hi"}], "logprobs": "yes"}', "logprobs", "logprobs"),
    ('{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}', "--max-logprobs",
     "top_logprobs"),
    ('{"messages": [{"role": "user", "content": "hi"}], "n": 17}', "--max-n", "n"),
    ('{"messages": [{"role": "user", "content": "hi"}], "seed": -9223372036854775809}', "seed", "seed"),
    ('{"messages": "hi"}', "messages", "messages"),
]


@pytest.mark.parametrize("raw, needle, param", BAD_CHATS, ids=range(len(BAD_CHATS)))
def test_bad_chats_get_a_one_line_400(http, raw, needle, param):
    err = _error(_post(http, "/v1/chat/completions", raw))
    assert needle in err["message"], err
    assert err["param"] == param, err


def test_the_server_still_serves_after_hostile_input(server, http):
    for raw, _, _ in BAD_COMPLETIONS[:5]:
        _post(http, "/v1/completions", raw)
    resp = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "length"
    assert server.wait_idle()


def test_an_internal_failure_is_a_500_with_an_id_and_one_traceback(server, http, caplog, monkeypatch):
    async def broken(*args, **kwargs):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(server.engine, "tokenize_prompt", broken)
    with caplog.at_level(logging.ERROR):
        err = _error(http.post("/tokenize", json={"prompt": "hi"}), 500)
    assert "secret" not in err["message"] and "RuntimeError" not in err["message"]
    error_id = err["message"].split("(id ")[1].split(")")[0]
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1 and error_id in tracebacks[0].getMessage()


def test_tokenize_and_detokenize(http):
    body = http.post("/tokenize", json={"model": MODEL, "prompt": "abc", "return_token_strs": True}).json()
    assert body["tokens"] == [97 % 100, 98 % 100, 99 % 100] and body["count"] == 3 and body["max_model_len"] == 64
    assert body["token_strs"] == ["<97>", "<98>", "<99>"]
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "abcd"}]}).json()
    assert chat["tokens"] == [4]  # the stand-in template: one id per message, its length
    assert http.post("/detokenize", json={"tokens": [1, 2]}).json() == {"prompt": "<1><2>"}
    assert "vocabulary" in _error(http.post("/detokenize", json={"tokens": [1, 100]}))["message"]
    assert "exactly one" in _error(http.post("/tokenize", json={"model": MODEL}))["message"]


def _raw_generate(server, raw: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(server.grpc) as channel:
        call = channel.unary_stream("/jaxserve.v1.JaxServe/Generate", request_serializer=lambda b: b,
                                    response_deserializer=pb.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as e:
            list(call(raw, timeout=30))
    return e.value


def test_grpc_refuses_bad_input_with_invalid_argument(server, stub):
    e = _raw_generate(server, b"\x12\x02\xed\xa0")  # text = a lone surrogate's UTF-8-like bytes
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in e.details()
    e = _raw_generate(server, b"\x12\xff\xff\xff")  # truncated message
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    for params, needle in [(pb.SamplingParams(n=1000), "--max-n"), (pb.SamplingParams(logprobs=21), "logprobs"),
                           (pb.SamplingParams(stop=["s"] * 17), "--max-stop-strings"),
                           (pb.SamplingParams(temperature=float("nan")), "temperature")]:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(text="hi", sampling_params=params), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details(), e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 1000)), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in e.value.details()
    ok = list(stub.Generate(pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(max_tokens=2)),
                            timeout=30))
    assert ok[-1].finish_reason == pb.FINISH_REASON_LENGTH
