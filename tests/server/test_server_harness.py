"""Evaluation-harness features over HTTP: ``echo`` with ``logprobs`` (a loglikelihood request, max_tokens 0 or
1) returns transformers' log-probabilities; ``prompt_logprobs`` on both APIs; ``best_of`` > n."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch

from server_harness import API_KEY, MODEL_NAME, shared_server, tiny_model
from tiny import hf_model

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CONTEXT, CONTINUATION = "The quick brown fox", " jumps over the lazy dog."


@pytest.fixture(scope="module")
def server(request):
    return shared_server(request)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(request):
    """transformers' log-probabilities of each token given the ones before it, and the tokenizer."""
    path = tiny_model(request)
    model = hf_model(path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)

    @torch.no_grad()
    def logprobs(ids: list[int]) -> np.ndarray:
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()

    return tok, logprobs


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_loglikelihood_request_matches_transformers(http, reference, max_tokens):
    tok, logprobs = reference
    text = CONTEXT + CONTINUATION
    resp = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": text, "echo": True, "logprobs": 1,
                                                "max_tokens": max_tokens, "temperature": 0})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    choice = body["choices"][0]
    ids = tok(text)["input_ids"]
    lp = choice["logprobs"]
    assert choice["text"].startswith(text) and (max_tokens or choice["text"] == text)
    assert len(lp["tokens"]) == len(ids) + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = logprobs(ids)
    got = np.array(lp["token_logprobs"][1: len(ids)], np.float64)
    np.testing.assert_allclose(got, [ref[i - 1, ids[i]] for i in range(1, len(ids))], atol=1e-4)
    # is_greedy, as harnesses read it: the top alternative at each position
    for i in range(1, len(ids)):
        best = max(lp["top_logprobs"][i].values())
        np.testing.assert_allclose(best, ref[i - 1].max(), atol=1e-4)
    assert "".join(lp["tokens"][: len(ids)]) == tok.decode(ids)  # each token's own text, BOS included
    assert body["usage"]["completion_tokens"] == max_tokens


def test_prompt_logprobs_on_both_apis(http, reference):
    tok, logprobs = reference
    ids = tok(CONTEXT)["input_ids"]
    ref = logprobs(ids)
    resp = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 2,
                                                "prompt_logprobs": 2})
    assert resp.status_code == 200, resp.text
    plp = resp.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for i in range(1, len(ids)):
        entry = plp[i][str(ids[i])]
        np.testing.assert_allclose(entry["logprob"], ref[i - 1, ids[i]], atol=1e-4)
        ranked = {int(t): v for t, v in plp[i].items() if v["rank"] is not None}
        assert {v["rank"] for v in ranked.values()} <= {1, 2} and 1 in {v["rank"] for v in ranked.values()}
    chat = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 2, "prompt_logprobs": 0,
                                                     "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200, chat.text
    plp = chat.json()["prompt_logprobs"]
    assert plp[0] is None and all(len(e) == 1 for e in plp[1:])


def test_best_of_keeps_the_most_likely_samples(http):
    body = {"model": MODEL_NAME, "prompt": CONTEXT, "max_tokens": 6, "temperature": 1.0, "seed": 4,
            "ignore_eos": True}
    all3 = http.post("/v1/completions", json={**body, "n": 3, "logprobs": 0}).json()["choices"]
    best = http.post("/v1/completions", json={**body, "n": 1, "best_of": 3})
    assert best.status_code == 200, best.text
    choices = best.json()["choices"]
    assert len(choices) == 1 and choices[0]["logprobs"] is None
    top = max(all3, key=lambda c: sum(c["logprobs"]["token_logprobs"]))
    assert choices[0]["text"] == top["text"]


def test_logit_bias(http):
    resp = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": CONTEXT, "max_tokens": 3,
                                                "temperature": 0, "ignore_eos": True, "logit_bias": {"17": 100}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == http.post("/detokenize", json={"tokens": [17] * 3}).json()["prompt"]


def test_streamed_echo_matches_the_whole_response(http):
    body = {"model": MODEL_NAME, "prompt": CONTEXT, "echo": True, "logprobs": 1, "max_tokens": 3,
            "temperature": 0, "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    chunks = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0])
    assert "".join(c["text"] for c in chunks) == whole["text"]
    streamed = [v for c in chunks for v in c["logprobs"]["token_logprobs"]]
    assert streamed == whole["logprobs"]["token_logprobs"]
    assert [o for c in chunks for o in c["logprobs"]["text_offset"]] == whole["logprobs"]["text_offset"]
    prompt_only = http.post("/v1/completions", json={**body, "max_tokens": 0, "stream": True})
    texts = [json.loads(l[6:])["choices"][0]["text"] for l in prompt_only.text.splitlines()
             if l.startswith("data: {")]
    assert "".join(texts) == CONTEXT
    streamed = http.post("/v1/completions", json={**body, "echo": False, "logprobs": None, "prompt_logprobs": 1,
                                                   "stream": True})
    firsts = [json.loads(l[6:])["choices"][0] for l in streamed.text.splitlines() if l.startswith("data: {")]
    assert firsts[0]["prompt_logprobs"][0] is None and len(firsts[0]["prompt_logprobs"]) > 1
    assert all("prompt_logprobs" not in c for c in firsts[1:])
    chat = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 2, "prompt_logprobs": 0,
                                                     "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    events = [json.loads(l[6:]) for l in chat.text.splitlines() if l.startswith("data: {")]
    with_plp = [e for e in events if "prompt_logprobs" in e]
    assert len(with_plp) == 1 and with_plp[0]["prompt_logprobs"][0] is None and not with_plp[0]["choices"]
