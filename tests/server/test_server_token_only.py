"""Token-only models over HTTP: ``--skip-tokenizer-init`` serves a folder with no tokenizer on token-id prompts
(outputs carry token ids, no text); without it the server stops at start-up with one line naming the folder and
the flag."""

from __future__ import annotations

import shutil

import httpx
import pytest

from server_harness import MODEL_NAME, ServerProcess, compile_cache, reference_llm, tiny_model
from jaxserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def bare_model(request, tmp_path_factory):
    bare = tmp_path_factory.mktemp("token-only") / "bare"
    shutil.copytree(tiny_model(request), bare, ignore=shutil.ignore_patterns(
        "tokenizer*", "special_tokens_map.json", "chat_template.jinja"))
    return bare


def test_no_tokenizer_is_one_line_naming_the_flag(bare_model, tmp_path):
    server = ServerProcess(bare_model, cache_dir="", log_path=tmp_path / "fail.log", wait=False)
    assert server.wait(120) == 2  # a user error: exit code 2, as every command's
    log = (tmp_path / "fail.log").read_text()
    assert "Traceback" not in log and "sentencepiece" not in log.lower()
    lines = [l for l in log.splitlines() if "no tokenizer" in l]  # said once, as the command's one error line
    assert len(lines) == 1 and lines[0].startswith("python -m jaxserve.serve: error: "), log[-2000:]
    assert str(bare_model) in lines[0] and "--skip-tokenizer-init" in lines[0]
    assert " ERROR " not in log, log[-2000:]
    server.terminate()


def test_skip_tokenizer_init_serves_token_ids(request, bare_model, tmp_path):
    # The same shapes as the shared server: the compiled steps come from the persistent cache.
    server = ServerProcess(bare_model, cache_dir=compile_cache(request), log_path=tmp_path / "ok.log",
                           extra=["--skip-tokenizer-init"])
    try:
        prompt = [0, 5, 9, 14, 3]
        want = reference_llm(request).generate(prompt, SamplingParams(max_tokens=6, temperature=0.0,
                                                                       ignore_eos=True))[0].outputs[0].token_ids
        with httpx.Client(base_url=server.http, timeout=120) as http:
            resp = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6,
                                                        "temperature": 0, "ignore_eos": True, "logprobs": 1})
            assert resp.status_code == 200, resp.text
            choice = resp.json()["choices"][0]
            assert choice["text"] == "" and len(choice["logprobs"]["token_logprobs"]) == 6
            text = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "some text"})
            assert text.status_code == 400 and "--skip-tokenizer-init" in text.json()["error"]["message"]
            assert http.post("/detokenize", json={"tokens": [1, 2]}).status_code == 400
        import grpc

        from jaxserve.server.protos import jaxserve_pb2 as pb, jaxserve_pb2_grpc as pb_grpc

        ids = []  # HTTP completions carry no token ids; gRPC's messages do
        with grpc.insecure_channel(server.grpc) as channel:
            stub = pb_grpc.JaxServeStub(channel)
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling_params=pb.SamplingParams(
                max_tokens=6, temperature=0, ignore_eos=True))
            for msg in stub.Generate(req, timeout=120):
                ids += list(msg.token_ids)
        assert ids == want
    finally:
        server.terminate()
