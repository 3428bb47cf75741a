"""The OpenAI-compatible HTTP API of a real server subprocess, through the official ``openai`` client and raw
HTTP: completions and chat (streaming or not), logprobs, n, seed, stop, batches, errors, auth, disconnects."""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import openai
import pytest

from jaxserve.sampling_params import SamplingParams
from server_harness import API_KEY, MAX_MODEL_LEN, MODEL_NAME, pages_idle, reference_llm, shared_server, tiny_model

PROMPT = "The quick brown fox"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(request):
    return shared_server(request)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.http + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http, headers=AUTH, timeout=60) as c:
        yield c


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body["error"]) >= {"message", "type", "code"}, body
    return body["error"]


# Basics ---------------------------------------------------------------------------------------------------------
def test_models_health_and_metrics_are_served(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].max_model_len == MAX_MODEL_LEN
    assert httpx.get(server.http + "/health").status_code == 200  # open without the key
    from importlib.metadata import version  # vLLM's GET /version, open too, with jaxserve's version

    got = httpx.get(server.http + "/version")
    assert got.status_code == 200 and got.json() == {"version": version("jaxserve")}, got.text
    metrics = httpx.get(server.http + "/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    for name in ("jaxserve_time_to_first_token_seconds_bucket", "jaxserve_time_per_output_token_seconds_bucket",
                 "jaxserve_inter_token_latency_seconds_bucket", "jaxserve_e2e_request_latency_seconds_bucket",
                 "jaxserve_num_requests_running", "jaxserve_num_requests_waiting", "jaxserve_kv_cache_usage_ratio",
                 "jaxserve_prefix_cache_hit_rate", "jaxserve_prompt_tokens_total", "jaxserve_generation_tokens_total",
                 "jaxserve_num_preemptions_total", 'jaxserve_requests_finished_total{finish_reason="stop"}',
                 "jaxserve_kv_pages_used", "jaxserve_intake_queue_length"):
        assert name in metrics.text, name


def test_start_up_explains_itself(request, server):
    assert server.ready_line.endswith(f"path={tiny_model(request)}")  # the folder outside tools can load
    log = server.log_path.read_text()
    # A first start compiles; a start after another test's server filled the shared cache loads what it stored.
    assert re.search(r"compiling \d+ |loading \d+ .* stored by an earlier start", log), log[-3000:]
    assert "warm-up done: " in log and "compilation cache" in log
    assert re.search(r"engine ready: .* in [0-9.]+s: loading [0-9.]+s, warm-up [0-9.]+s \(compilation cache: "
                     r"\d+ hits, \d+ misses; step executables: \d+ loaded, \d+ compiled\)", log), log[-3000:]
    assert "Unable to initialize backend" not in log and "PyTorch was not found" not in log


def test_greedy_completion_matches_llm_generate(request, client):
    llm = reference_llm(request)
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == ref.outputs[0].text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == 12 and resp.usage.total_tokens == 12 + len(ref.prompt_token_ids)
    # the same prompt as token ids gives the same text
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ref.prompt_token_ids, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == ref.outputs[0].text


def test_streaming_completion_concatenates_to_the_full_text(client):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_sse_ends_with_done(http):
    with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_chat_matches_llm_chat_streaming_or_not(request, client):
    llm = reference_llm(request)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paged attention?"}]
    ref = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    resp = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids) and resp.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_completion_logprobs(client):
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    if "\ufffd" not in "".join(lp.tokens):  # tokens decoded one by one split multi-byte characters
        assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and chosen <= 0 and token in top
        # greedy picks the most likely token (tokens decoding to the same text share one key in top_logprobs)
        assert chosen >= max(top.values()) - 1e-5
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                              logprobs=3, stream=True, extra_body={"ignore_eos": True}))
    tokens = [t for c in streamed for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in streamed for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_chat_logprobs(client):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == 4
    if "\ufffd" not in "".join(t.token for t in content):
        assert "".join(t.token for t in content) == resp.choices[0].message.content
    # each token's raw bytes, even one that holds part of a character (its text is then U+FFFD)
    assert bytes(b for t in content for b in t.bytes).decode("utf-8", "replace") == resp.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2
        if "\ufffd" not in t.token:
            assert t.bytes == list(t.token.encode())
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5)  # greedy: the most likely one
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob


def test_n_and_seed_are_reproducible(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.95, n=3, seed=1234,
              extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # the n samples differ from each other
    assert a.usage.completion_tokens == 24
    streamed = list(client.completions.create(stream=True, **kw))
    texts = {i: "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i)
             for i in range(3)}
    assert [texts[i] for i in range(3)] == [c.text for c in sorted(a.choices, key=lambda c: c.index)]


def test_stop_strings(client):
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[5:8]
    assert stop and stop.strip()
    cut = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[: base.index(stop)]
    assert cut.model_extra["stop_reason"] == stop
    single = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                       extra_body={"ignore_eos": True}).choices[0]
    assert single.text == cut.text
    kept = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True}).choices[0]
    assert kept.text == base[: base.index(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(request, client):
    llm = reference_llm(request)
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].outputs[0]
    third = ref.token_ids[2]
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True, "stop_token_ids": [third]})
    first_hit = ref.token_ids.index(third)
    assert resp.choices[0].finish_reason == "stop" and resp.usage.completion_tokens == first_hit + 1
    assert resp.choices[0].model_extra["stop_reason"] == third


def test_prompt_batches(client):
    resp = client.completions.create(model=MODEL_NAME, prompt=["Hello there", "Continuous batching"], max_tokens=4,
                                     temperature=0, n=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    one = client.completions.create(model=MODEL_NAME, prompt="Continuous batching", max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert {c.text for c in resp.choices if c.index >= 2} == {one.choices[0].text}
    assert resp.usage.completion_tokens == 16
    ids = client.completions.create(model=MODEL_NAME, prompt=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5


def test_concurrent_requests_all_complete(server, client):
    def one(i):
        if i % 2:
            return client.completions.create(model=MODEL_NAME, prompt=f"{PROMPT} {i}", max_tokens=5 + i,
                                              temperature=0.7, extra_body={"ignore_eos": True}).usage.completion_tokens
        chunks = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": str(i)}],
                                                max_tokens=5 + i, stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
        return list(chunks)[-1].usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        assert list(pool.map(one, range(12))) == [5 + i for i in range(12)]
    assert pages_idle(server.wait_metrics(pages_idle))


# Errors ---------------------------------------------------------------------------------------------------------
LONG_PROMPT = [5] * (MAX_MODEL_LEN - 4)


@pytest.mark.parametrize("body, needle, param", [
    ({"prompt": ""}, "prompt is empty", "prompt"),
    ({"prompt": []}, "prompt is empty", "prompt"),
    ({"prompt": LONG_PROMPT, "max_tokens": 10}, "max_model_len", "max_tokens"),
    ({"prompt": [5] * MAX_MODEL_LEN}, "max_model_len", "prompt"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature=-0.5 must be >= 0", "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p=0", "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p=1.5", "top_p"),
    ({"prompt": [1, 2, 100000]}, "token id 100000 is outside the vocabulary", "prompt"),
    ({"prompt": [1, -3]}, "outside the vocabulary", "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"prompt": "hi", "n": 0}, "n=0", "n"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs", "logprobs"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty", "presence_penalty"),
    ({"max_tokens": 3}, "prompt: Field required", "prompt"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens", "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens=0 needs echo", "max_tokens"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias keys must be token ids", "logit_bias"),
    ({"prompt": "hi", "n": 3, "best_of": 2}, "best_of=2 must be >= n=3", "best_of"),
    ({"prompt": "hi", "prompt_logprobs": 30}, "prompt_logprobs=30 is over the limit", "prompt_logprobs"),
    ({"prompt": ["ok", ""]}, "prompt[1]: prompt is empty", "prompt"),
])
def test_bad_completion_requests_get_400_naming_the_problem(http, body, needle, param):
    err = _error(http.post("/v1/completions", json={"model": MODEL_NAME, **body}), 400)
    assert needle in err["message"], err
    assert err["param"] == param and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/tokenize", {"prompt": "hi"}),
    ("/detokenize", {"tokens": [5]}),
])
def test_an_unknown_model_is_vllms_404(http, path, body):
    """vLLM's answer to a ``model`` it does not serve (``OpenAIServing._check_model``), body and all."""
    resp = http.post(path, json={"model": "nope", **body})
    assert resp.status_code == 404, resp.text
    assert resp.json() == {"error": {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                                     "param": "model", "code": 404}}


@pytest.mark.parametrize("body, needle", [
    ({"messages": []}, "messages is empty"),
    ({"messages": [{"content": "hi"}]}, "messages.0.role: Field required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "only parts of type"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs requires logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 500}, "max_model_len"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools[0] must be"),
])
def test_bad_chat_requests_get_400(http, body, needle):
    err = _error(http.post("/v1/chat/completions", json={"model": MODEL_NAME, **body}), 400)
    assert needle in err["message"], err


def test_lone_surrogates_get_400_not_500(http):
    for path, raw, param in [
        ("/v1/completions", '{"prompt": "a \\ud800 b", "max_tokens": 2}', "prompt"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
         "messages"),
    ]:
        err = _error(http.post(path, content=raw, headers={"content-type": "application/json"}), 400)
        assert "lone surrogate" in err["message"] and err["param"] == param, err
        assert "template" not in err["message"] and "TypeError" not in err["message"]


def test_cache_salt_keeps_prefix_cache_hits_within_a_tenant(http):
    prompt = "Tenants share nothing they should not, not even a cached page of a prompt like this one " * 2

    def cached(salt):
        body = {"prompt": prompt, "max_tokens": 1, **({"cache_salt": salt} if salt else {})}
        resp = http.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0  # first sight of the prompt
    assert cached("tenant-a") > 0  # the same tenant hits its own pages
    assert cached("tenant-b") == 0  # another tenant does not: no hit, so no timing difference to observe
    assert cached(None) == 0  # nor an unsalted request
    assert cached("tenant-b") > 0 and cached(None) > 0


def test_tokenize_and_detokenize_agree_with_generation(http):
    tok = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": PROMPT, "return_token_strs": True}).json()
    gen = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).json()
    assert tok["count"] == len(tok["tokens"]) == gen["usage"]["prompt_tokens"]
    assert tok["max_model_len"] == MAX_MODEL_LEN and len(tok["token_strs"]) == tok["count"]
    by_ids = http.post("/v1/completions", json={"prompt": tok["tokens"], "max_tokens": 1}).json()
    assert by_ids["usage"]["prompt_tokens"] == tok["count"]
    text = http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert PROMPT in text
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 1
    assert "outside the vocabulary" in _error(http.post("/detokenize", json={"tokens": [10**6]}), 400)["message"]


def test_malformed_and_oversized_bodies_get_400(server, http):
    json_header = {"content-type": "application/json"}
    err = _error(http.post("/v1/completions", content=b'{"prompt": "hi",', headers=json_header), 400)
    assert "not valid JSON" in err["message"]
    err = _error(http.post("/v1/completions", content=b"[1, 2]"), 400)
    assert "JSON object" in err["message"]
    big = b'{"prompt": "' + b"a" * (4 * 2**20) + b'"}'
    err = _error(http.post("/v1/completions", content=big), 400)
    assert "over the limit" in err["message"]
    err = _error(http.get("/v1/nothing"), 404)
    assert "no route" in err["message"]
    # and the server keeps serving
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert server.proc.poll() is None


def test_openai_client_sees_bad_request_errors(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL_NAME, prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="The model `other` does not exist."):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])


def test_api_key_is_required_on_v1_only(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(server.http + "/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert _error(r, 401)["type"] == "authentication_error"
        assert _error(httpx.get(server.http + "/v1/models", headers=headers), 401)
    with openai.OpenAI(base_url=server.http + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    assert httpx.get(server.http + "/health").status_code == 200
    assert httpx.get(server.http + "/metrics").status_code == 200
    # vLLM guards only /v1: its /tokenize and /detokenize need no key (and it serves no /v1/tokenize).
    tokens = httpx.post(server.http + "/tokenize", json={"prompt": "hi"})
    assert tokens.status_code == 200 and tokens.json()["count"] >= 1, tokens.text
    text = httpx.post(server.http + "/detokenize", json={"tokens": tokens.json()["tokens"]})
    assert text.status_code == 200 and "hi" in text.json()["prompt"], text.text
    for path in ("/v1/tokenize", "/v1/detokenize"):
        assert httpx.post(server.http + path, json={"prompt": "hi"}, headers=AUTH).status_code == 404


# Disconnects ----------------------------------------------------------------------------------------------------
def _finished(m, reason):
    return m.get(f'jaxserve_requests_finished_total{{finish_reason="{reason}"}}', 0.0)


def test_stream_disconnect_aborts_and_frees_pages(server, http):
    before = server.metrics()
    body = {"prompt": PROMPT, "max_tokens": MAX_MODEL_LEN - 20, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert got[0].startswith("data: ")
        during = server.metrics()
        assert during["jaxserve_kv_pages_used"] > 0
    after = server.wait_metrics(lambda m: pages_idle(m) and _finished(m, "abort") > _finished(before, "abort"))
    assert pages_idle(after), after
    assert _finished(after, "abort") == _finished(before, "abort") + 1


def test_non_streaming_disconnect_aborts(server):
    before = server.metrics()
    body = {"prompt": PROMPT, "max_tokens": MAX_MODEL_LEN - 20, "n": 4, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.http + "/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(10, read=0.05))
    after = server.wait_metrics(lambda m: pages_idle(m) and _finished(m, "abort") > _finished(before, "abort"))
    assert pages_idle(after)
    assert _finished(after, "abort") == _finished(before, "abort") + 1


def test_echo_shows_a_prompt_token_that_is_its_own_top_logprob(http):
    """With echo, logprobs=1 and prompt_logprobs=3, a prompt token that is the most likely at its position is
    its own top-1 entry (and has rank 1 in prompt_logprobs): the records say so, no count of entries does."""
    ids = [5, 6, 7, 8, 9, 10]
    first = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 1,
                                                 "prompt_logprobs": 1})
    assert first.status_code == 200, first.text
    last = first.json()["choices"][0]["prompt_logprobs"][-1]
    best = next(int(t) for t, v in last.items() if v["rank"] == 1)
    ids = ids[:-1] + [best]  # the model's most likely token at the last position (causal: still the most likely)
    resp = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 1, "echo": True,
                                                "logprobs": 1, "prompt_logprobs": 3})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    lp, p = choice["logprobs"], len(ids) - 1
    assert lp["top_logprobs"][p] == {lp["tokens"][p]: lp["token_logprobs"][p]}
    assert choice["prompt_logprobs"][p][str(best)]["rank"] == 1
