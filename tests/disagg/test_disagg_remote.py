"""Prefill/decode disaggregation across processes (jaxserve/disagg/remote.py): two prefill processes and a decode
process (the front door) started once for the module; the ``openai`` client and gRPC talk to the front door."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import grpc
import httpx
import openai
import pytest

from jaxserve.disagg.wire import STATS_METHOD
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.protos import jaxserve_pb2 as pb
from jaxserve.server.protos import jaxserve_pb2_grpc as pb_grpc

from server_harness import (
    MODEL_NAME,
    REPO,
    SMALL_ENGINE,
    compile_cache,
    free_port,
    pages_idle,
    reference_llm,
    server_env,
    start_server,
    tiny_model,
)

PROMPT_IDS = [0, 17, 23, 99, 41, 5, 77, 120, 8, 64, 33, 2, 19, 250, 7, 3, 91, 14, 66, 200, 45]


class PrefillProcess:
    def __init__(self, request, name: str, port: int | None = None):
        self.port = port or free_port()
        log = request.getfixturevalue("tmp_path_factory").mktemp("prefill-logs") / f"{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.serve", "--model", str(tiny_model(request)), "--role", "prefill",
             "--kv-port", str(self.port), "--http-port", "0", *SMALL_ENGINE, "--compilation-cache-dir",
             compile_cache(request)],
            cwd=REPO, env=server_env(), stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
        self.url = f"127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        line = self.proc.stdout.readline()
        assert re.search(r"jaxserve prefill ready: kv=grpc://", line), line
        self.ready_line = line
        self.http = re.search(r" http=(\S+)", line).group(1)

    def stats(self) -> dict:
        with grpc.insecure_channel(self.url) as ch:
            call = ch.unary_unary(STATS_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            return json.loads(call(b"", timeout=10))

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def cluster(request):
    # The first prefill process compiles into the shared compilation cache before the others start, so they load
    # its programs instead of compiling the same ones at the same time.
    prefills = [PrefillProcess(request, "prefill0")]
    decode = None
    try:
        prefills[0].wait_ready()
        prefills.append(PrefillProcess(request, "prefill1"))
        decode = start_server(request, "decode", ["--role", "decode", "--prefill-url",
                                                  ",".join(p.url for p in prefills)], wait=False)
        prefills[1].wait_ready()
        decode.wait_ready()
        yield prefills, decode
    finally:
        if decode is not None:
            decode.terminate()
        for p in prefills:
            p.kill()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster[1].http + "/v1", api_key="unused", max_retries=0)


def test_openai_greedy_and_seeded_match_colocated(request, cluster, client):
    llm = reference_llm(request)
    for sp, extra in ((SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), {}),
                      (SamplingParams(max_tokens=10, temperature=0.8, seed=11, ignore_eos=True), {"seed": 11})):
        want = llm.generate([PROMPT_IDS, PROMPT_IDS[:7]], sp)
        for prompt, ref in zip([PROMPT_IDS, PROMPT_IDS[:7]], want):
            got = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=sp.max_tokens,
                                            temperature=sp.temperature, extra_body={"ignore_eos": True}, **extra)
            assert got.choices[0].text == ref.outputs[0].text
    chunks = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=6, temperature=0, stream=True)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content is not None]) >= 1
    m = cluster[1].metrics()
    assert m["jaxserve_kv_transfers_total"] >= 5 and m["jaxserve_kv_transfer_bytes_total"] > 0
    assert m["jaxserve_kv_transfer_seconds_total"] > 0 and "jaxserve_kv_transfer_queue_seconds_total" in m
    # Both prefill processes took requests (round robin) and gave every page back; on this platform (CPU, jax
    # 0.10) the pages moved through JAX's transfer server, the gRPC stream carrying only the headers.
    stats = [p.stats() for p in cluster[0]]
    assert all(s["prompt_tokens"] > 0 and s["pages_used"] == 0 for s in stats)
    assert sum(s["kv_transfer_offers"] for s in stats) == m["jaxserve_kv_transfers_total"]
    assert all("transfer=jax://" in p.ready_line for p in cluster[0])


def test_grpc_front_door(request, cluster):
    ref = reference_llm(request).generate(PROMPT_IDS, SamplingParams(max_tokens=8, temperature=0.0,
                                                                     ignore_eos=True))[0]
    with grpc.insecure_channel(cluster[1].grpc) as ch:
        msgs = list(pb_grpc.JaxServeStub(ch).Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=PROMPT_IDS),
            sampling_params=pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)), timeout=60))
    assert [t for m in msgs for t in m.token_ids] == ref.outputs[0].token_ids


def test_n_and_prompt_logprobs_across_processes(request, cluster, client):
    """n > 1 (each output prefilled by its own call, with the seed it samples with here) and prompt logprobs
    (computed where the prompt runs, sent with the first token) match the colocated engine."""
    llm = reference_llm(request)
    prompt = PROMPT_IDS[:13]
    for sp in (SamplingParams(n=3, max_tokens=6, temperature=0.9, seed=7, ignore_eos=True),
               SamplingParams(n=2, max_tokens=5, temperature=0.0, ignore_eos=True, prompt_logprobs=2)):
        want = llm.generate(prompt, sp)[0]
        r = httpx.post(cluster[1].http + "/v1/completions", timeout=60, json=dict(
            model=MODEL_NAME, prompt=prompt, n=sp.n, max_tokens=sp.max_tokens, temperature=sp.temperature,
            seed=sp.seed, ignore_eos=True, prompt_logprobs=sp.prompt_logprobs))
        assert r.status_code == 200, r.text
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        assert [c["text"] for c in choices] == [o.text for o in want.outputs]
        if sp.prompt_logprobs is None:
            assert len({c["text"] for c in choices}) > 1  # the n samples differ
            continue
        got = choices[0]["prompt_logprobs"]
        assert got[0] is None and len(got) == len(prompt) == len(want.prompt_logprobs)
        for entry, ref in zip(got[1:], want.prompt_logprobs[1:]):
            assert {int(t) for t in entry} == set(ref)
            assert all(abs(entry[str(t)]["logprob"] - v.logprob) < 1e-5 and entry[str(t)]["rank"] == v.rank
                       for t, v in ref.items())
    # Streamed: the first chunk carries the prompt's logprobs even when another output's prefill lands first.
    with httpx.stream("POST", cluster[1].http + "/v1/completions", timeout=60, json=dict(
            model=MODEL_NAME, prompt=prompt, n=3, max_tokens=3, temperature=0, stream=True,
            prompt_logprobs=1)) as r:
        first = next(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))
    assert first["choices"][0]["prompt_logprobs"][1] is not None


def test_cancelled_requests_free_pages_on_both_sides(cluster, client):
    prefills, decode = cluster
    long_prompt = PROMPT_IDS * 4  # several prefill chunks: cancels land during prefill, transfer and decode
    for delay in (0.0, 0.3, 1.0):
        with httpx.stream("POST", decode.http + "/v1/completions", timeout=60, json=dict(
                model=MODEL_NAME, prompt=long_prompt, max_tokens=40, stream=True, ignore_eos=True)) as r:
            deadline = time.monotonic() + delay
            for _ in r.iter_lines():
                if time.monotonic() >= deadline:
                    break
    m = decode.wait_metrics(lambda m: pages_idle(m) and m.get("jaxserve_kv_transfers_pending") == 0, timeout=30)
    assert pages_idle(m)
    deadline = time.monotonic() + 30
    while any(p.stats()["pages_used"] or p.stats()["num_running"] for p in prefills) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(p.stats()["pages_used"] == 0 for p in prefills)


def test_prefill_processes_answer_probes_and_scrapes(cluster):
    """/health, /live and /metrics over HTTP and gRPC health, so Kubernetes probes a prefill process as any
    other (before, it could only be TCP-probed); nothing else is served there."""
    decode = cluster[1]
    for _ in range(2):  # served by either prefill process (or both)
        r = httpx.post(decode.http + "/v1/completions", timeout=60,
                       json={"model": MODEL_NAME, "prompt": PROMPT_IDS, "max_tokens": 2})
        assert r.status_code == 200, r.text
    # the decode process looks nothing up in a prefix cache (it counted every adopted prompt as a query, 0 hits)
    assert decode.metrics()["jaxserve_prefix_cache_queries_total"] == 0
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from server_harness import parse_metrics

    queries = 0
    for p in cluster[0]:
        assert p.http.startswith("http://127.0.0.1:")  # on --host, whose default is the loopback only
        assert httpx.get(p.http + "/health", timeout=10).json() == {"status": "ok"}
        assert httpx.get(p.http + "/live", timeout=10).json() == {"status": "live"}
        metrics = parse_metrics(httpx.get(p.http + "/metrics", timeout=10).text)
        def value(name: str) -> float:
            return next(v for k, v in metrics.items() if k.startswith(name + "{") and "model_name=" in k)

        assert value("vllm:num_requests_running") == 0 and value("vllm:num_requests_waiting") == 0
        queries += value("vllm:prefix_cache_queries_total")
        assert 0 <= value("vllm:kv_cache_usage_perc") <= 1
        assert httpx.get(p.http + "/v1/models", timeout=10).status_code == 404
        assert httpx.post(p.http + "/health", timeout=10).status_code == 405
        with grpc.insecure_channel(p.url) as ch:
            answer = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    assert queries >= 2 * len(PROMPT_IDS)  # the prompts above were looked up where the cache is


def test_dead_prefill_process_keeps_serving_then_503(cluster, client):
    prefills, decode = cluster
    prefills[0].kill()
    for _ in range(3):  # the survivor serves (a request sent to the dead one is retried on it)
        out = client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=4, temperature=0)
        assert out.choices[0].finish_reason == "length"
    prefills[1].kill()
    with pytest.raises((openai.APIStatusError, openai.InternalServerError)) as e:
        for _ in range(3):
            client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=4, temperature=0)
    # In flight to the process just killed: an error (500, the log says why); after that: 503 with the reason.
    assert e.value.status_code == 500 or (e.value.status_code == 503 and "prefill server" in str(e.value))
    # The front door itself keeps answering, says why it cannot serve, and reports itself not ready.
    time.sleep(0.5)
    r = httpx.post(decode.http + "/v1/completions", timeout=30,
                   json=dict(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=4))
    assert r.status_code == 503 and "no prefill server is reachable" in r.text
    health = httpx.get(decode.http + "/health", timeout=10)
    assert health.status_code == 503 and "no prefill server is reachable" in health.json()["status"]
