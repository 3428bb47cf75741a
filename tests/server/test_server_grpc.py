"""The gRPC API of a real server subprocess: JaxServe (Generate, Tokenize, GetModelInfo), health, reflection,
errors, auth and cancellation."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from jaxserve.server.protos import jaxserve_pb2 as pb
from jaxserve.server.protos import jaxserve_pb2_grpc as pb_grpc
from jaxserve.sampling_params import SamplingParams
from server_harness import API_KEY, MAX_MODEL_LEN, MODEL_NAME, pages_idle, reference_llm, shared_server

PROMPT = "Paged attention keeps the KV cache"
AUTH = (("authorization", f"Bearer {API_KEY}"),)


@pytest.fixture(scope="module")
def server(request):
    return shared_server(request)


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.grpc) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.JaxServeStub(channel)


def generate(stub, timeout=60, **kw) -> list[pb.GenerateResponse]:
    sampling = kw.pop("sampling", {})
    return list(stub.Generate(pb.GenerateRequest(sampling_params=pb.SamplingParams(**sampling), **kw),
                              metadata=AUTH, timeout=timeout))


def test_model_info_and_tokenize(request, stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH)
    llm = reference_llm(request)
    assert list(info.served_model_names) == [MODEL_NAME]
    assert info.architecture == "LlamaForCausalLM" and info.family == "llama"
    assert info.vocab_size == llm.model_config.vocab_size and info.max_model_len == MAX_MODEL_LEN
    assert info.page_size == 8 and info.max_num_seqs == 8 and info.has_chat_template
    assert info.dtype == "float32" and list(info.eos_token_ids) == [1]
    tok = stub.Tokenize(pb.TokenizeRequest(text=PROMPT), metadata=AUTH)
    assert list(tok.token_ids) == llm.tokenizer.encode(PROMPT)
    assert len(tok.tokens) == len(tok.token_ids)


def test_greedy_generate_matches_llm_generate(request, stub):
    ref = reference_llm(request).generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    msgs = generate(stub, request_id="mine", text=PROMPT, sampling=dict(max_tokens=10, temperature=0.0,
                                                                        ignore_eos=True))
    assert all(m.request_id == "mine" and m.index == 0 for m in msgs)
    assert [t for m in msgs for t in m.token_ids] == ref.outputs[0].token_ids
    assert "".join(m.text for m in msgs) == ref.outputs[0].text
    assert [m.finish_reason for m in msgs][-1] == pb.FINISH_REASON_LENGTH
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    assert msgs[-1].HasField("usage") and not any(m.HasField("usage") for m in msgs[:-1])
    assert msgs[-1].usage.prompt_tokens == len(ref.prompt_token_ids) and msgs[-1].usage.completion_tokens == 10
    by_ids = generate(stub, token_ids=pb.TokenIds(ids=ref.prompt_token_ids),
                      sampling=dict(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert [t for m in by_ids for t in m.token_ids] == ref.outputs[0].token_ids


def test_n_logprobs_and_seed(stub):
    sampling = dict(n=2, max_tokens=6, temperature=1.0, seed=42, logprobs=2, ignore_eos=True, top_k=40, min_p=0.01,
                    repetition_penalty=1.05, presence_penalty=0.1, frequency_penalty=0.1)
    a, b = generate(stub, text=PROMPT, sampling=sampling), generate(stub, text=PROMPT, sampling=sampling)
    for msgs in (a, b):
        assert {m.index for m in msgs} == {0, 1}
        for i in (0, 1):
            mine = [m for m in msgs if m.index == i]
            assert sum(m.finish_reason == pb.FINISH_REASON_LENGTH for m in mine) == 1
            lps = [lp for m in mine for lp in m.logprobs]
            assert [lp.token_id for lp in lps] == [t for m in mine for t in m.token_ids]
            assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in lps)
    assert [(m.index, list(m.token_ids)) for m in a] == [(m.index, list(m.token_ids)) for m in b]
    assert a[-1].usage.completion_tokens == 12


def test_stop_string_and_stop_token(stub):
    base = generate(stub, text=PROMPT, sampling=dict(max_tokens=12, temperature=0.0, ignore_eos=True))
    text = "".join(m.text for m in base)
    ids = [t for m in base for t in m.token_ids]
    stop = text[4:7]
    cut = generate(stub, text=PROMPT, sampling=dict(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]))
    assert "".join(m.text for m in cut) == text[: text.index(stop)]
    assert cut[-1].finish_reason == pb.FINISH_REASON_STOP and cut[-1].stop_string == stop
    tok = generate(stub, text=PROMPT, sampling=dict(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                    stop_token_ids=[ids[3]]))
    assert [t for m in tok for t in m.token_ids] == ids[: ids.index(ids[3]) + 1]
    assert tok[-1].finish_reason == pb.FINISH_REASON_STOP and tok[-1].stop_token_id == ids[3]
    assert generate(stub, text=PROMPT, sampling=dict(max_tokens=5, temperature=0.0, min_tokens=5))[-1].usage \
        .completion_tokens == 5


def test_unset_max_tokens_runs_to_the_length_limit(stub):
    msgs = generate(stub, text=PROMPT, sampling=dict(temperature=0.0, ignore_eos=True))
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert msgs[-1].usage.prompt_tokens + msgs[-1].usage.completion_tokens == MAX_MODEL_LEN


@pytest.mark.parametrize("request_kw, needle", [
    (dict(text=""), "prompt is empty"),
    (dict(), "prompt is empty"),
    (dict(token_ids=pb.TokenIds(ids=[])), "prompt is empty"),
    (dict(token_ids=pb.TokenIds(ids=[1, 2, 999_999])), "outside the vocabulary"),
    (dict(token_ids=pb.TokenIds(ids=[-1])), "outside the vocabulary"),
    (dict(token_ids=pb.TokenIds(ids=[5] * (MAX_MODEL_LEN - 4)), sampling=dict(max_tokens=10)), "max_model_len"),
    (dict(text="hi", sampling=dict(temperature=-1.0)), "temperature=-1.0 must be >= 0"),
    (dict(text="hi", sampling=dict(top_p=0.0)), "top_p=0.0 must be in (0, 1]"),
    (dict(text="hi", sampling=dict(top_p=1.01)), "top_p=1.01"),
    (dict(text="hi", sampling=dict(max_tokens=0)), "max_tokens=0"),
    (dict(text="hi", sampling=dict(logprobs=21)), "logprobs=21"),
    (dict(text="hi", sampling=dict(n=0)), "n=0"),
    (dict(text="hi", parse_tool_calls=True), "parse_tool_calls needs a server started with --tool-call-parser"),
    (dict(text="hi", separate_reasoning=True), "separate_reasoning needs a server started with --reasoning-parser"),
    (dict(text="hi", sampling=dict(structured_outputs=pb.StructuredOutputs())), "structured_outputs: set one of"),
    (dict(text="hi", sampling=dict(structured_outputs=pb.StructuredOutputs(choice=pb.Choices()))),
     "structured_outputs.choice must not be empty"),
    (dict(text="hi", sampling=dict(structured_outputs=pb.StructuredOutputs(json="{not json"))), "json"),
])
def test_bad_requests_get_invalid_argument(stub, request_kw, needle):
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, **request_kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in e.value.details()


def test_structured_outputs_constrain_the_text(stub):
    choices = ["paged attention", "ragged kernels"]
    msgs = generate(stub, text=PROMPT, sampling=dict(temperature=1.0, seed=3, max_tokens=20, structured_outputs=(
        pb.StructuredOutputs(choice=pb.Choices(choices=choices)))))
    assert "".join(m.text for m in msgs) in choices
    msgs = generate(stub, text=PROMPT, sampling=dict(temperature=1.0, seed=3, max_tokens=8, structured_outputs=(
        pb.StructuredOutputs(regex="[0-9]{3}"))))
    text = "".join(m.text for m in msgs)
    assert len(text) == 3 and text.isdigit()
    assert not any(m.reasoning or m.tool_calls for m in msgs)  # no parser on this server


def test_auth_is_required_but_health_and_reflection_are_open(channel, stub):
    for metadata in ((), (("authorization", "Bearer nope"),), (("authorization", API_KEY),)):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(text="hi"), metadata=metadata, timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "jaxserve.v1.JaxServe"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                             timeout=10))
    names = {s.name for s in answers[0].list_services_response.service}
    assert {"jaxserve.v1.JaxServe", "grpc.health.v1.Health"} <= names
    answers = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="jaxserve.v1.JaxServe")]), timeout=10))
    assert answers[0].file_descriptor_response.file_descriptor_proto


def test_cancel_aborts_and_frees_pages(server, stub):
    def aborted(m):
        return m.get('jaxserve_requests_finished_total{finish_reason="abort"}', 0.0)

    before = server.metrics()
    call = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling_params=pb.SamplingParams(
        n=3, temperature=0.0, ignore_eos=True)), metadata=AUTH, timeout=60)
    first = next(call)
    assert first.token_ids
    assert server.metrics()["jaxserve_kv_pages_used"] > 0
    call.cancel()
    after = server.wait_metrics(lambda m: pages_idle(m) and aborted(m) > aborted(before))
    assert pages_idle(after), after
    assert aborted(after) == aborted(before) + 1
    # the server is fine afterwards
    assert generate(stub, text="hi", sampling=dict(max_tokens=2))[-1].usage.completion_tokens >= 1
