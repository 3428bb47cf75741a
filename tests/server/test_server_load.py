"""A bounded mixed load on one server: 200 requests, 16 at a time, over both front ends, random lengths, a
quarter cancelled mid-stream. Every request completes or is cancelled, none errors, and the KV page pool is
whole again afterwards."""

from __future__ import annotations

import asyncio
import json
import random
import time

import grpc
import httpx
import pytest

from jaxserve.server.protos import jaxserve_pb2 as pb
from jaxserve.server.protos import jaxserve_pb2_grpc as pb_grpc
from server_harness import API_KEY, pages_idle, shared_server
from tiny import CORPUS

NUM_REQUESTS = 200
CONCURRENCY = 16
TIME_LIMIT = 150.0


@pytest.fixture(scope="module")
def server(request):
    return shared_server(request)


def _finished(m: dict, reason: str) -> float:
    return m.get(f'jaxserve_requests_finished_total{{finish_reason="{reason}"}}', 0.0)


async def _http_stream(client: httpx.AsyncClient, body: dict, cancel: bool) -> tuple[str, int]:
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        reason, text = None, ""
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            choice = chunk["choices"][0]
            text += choice["text"]
            reason = choice["finish_reason"] or reason
            if cancel:
                return "cancelled", 0
        return reason, len(text)


async def _http_plain(client: httpx.AsyncClient, body: dict) -> tuple[str, int]:
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    return data["choices"][0]["finish_reason"], data["usage"]["completion_tokens"]


async def _grpc_stream(stub, body: dict, cancel: bool) -> tuple[str, int]:
    call = stub.Generate(pb.GenerateRequest(text=body["prompt"], sampling_params=pb.SamplingParams(
        max_tokens=body["max_tokens"], temperature=body["temperature"], ignore_eos=body["ignore_eos"])),
        metadata=(("authorization", f"Bearer {API_KEY}"),))
    tokens, reason = 0, None
    async for msg in call:
        tokens += len(msg.token_ids)
        if msg.finish_reason:
            reason = pb.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_").lower()
        if cancel:
            call.cancel()
            return "cancelled", 0
    return reason, tokens


def test_mixed_load_with_cancellations(server):
    rng = random.Random(0)
    before = server.metrics()
    jobs = []
    for i in range(NUM_REQUESTS):
        words = " ".join(rng.choice(CORPUS).split()[: rng.randint(1, 12)])
        body = {"prompt": words, "max_tokens": rng.randint(1, 32), "temperature": rng.choice([0.0, 0.8]),
                "ignore_eos": rng.random() < 0.5}
        kind = ("http-stream", "http-plain", "grpc")[i % 3]
        cancel = i % 4 == 0 and kind != "http-plain"
        if i % 4 == 0 and kind == "http-plain":
            kind, cancel = "grpc", True
        jobs.append((kind, body, cancel))
    assert sum(c for _, _, c in jobs) == NUM_REQUESTS // 4

    async def main():
        sem = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(base_url=server.http, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=60, limits=httpx.Limits(max_connections=CONCURRENCY)) as client, \
                grpc.aio.insecure_channel(server.grpc) as channel:
            stub = pb_grpc.JaxServeStub(channel)

            async def run(kind, body, cancel):
                async with sem:
                    if kind == "http-stream":
                        return await _http_stream(client, body, cancel)
                    if kind == "http-plain":
                        return await _http_plain(client, body)
                    return await _grpc_stream(stub, body, cancel)

            return await asyncio.gather(*(run(*job) for job in jobs))

    start = time.monotonic()
    results = asyncio.run(asyncio.wait_for(main(), TIME_LIMIT))
    elapsed = time.monotonic() - start

    for (kind, body, cancel), (reason, count) in zip(jobs, results):
        if cancel:
            assert reason == "cancelled"
        else:
            assert reason in ("stop", "length"), (kind, body, reason)
            if kind != "http-stream":  # (streamed text length is characters, not tokens)
                assert 1 <= count <= body["max_tokens"]
                assert reason == "stop" or count == body["max_tokens"]

    after = server.wait_metrics(lambda m: pages_idle(m) and sum(_finished(m, r) for r in ("stop", "length", "abort"))
                                >= sum(_finished(before, r) for r in ("stop", "length", "abort")) + NUM_REQUESTS)
    assert pages_idle(after), after
    assert after["jaxserve_kv_pages_free"] == after["jaxserve_kv_pages_total"]
    assert _finished(after, "error") == _finished(before, "error")
    done = sum(_finished(after, r) - _finished(before, r) for r in ("stop", "length", "abort"))
    assert done == NUM_REQUESTS
    assert _finished(after, "abort") - _finished(before, "abort") <= NUM_REQUESTS // 4
    # One shared batch: far fewer engine steps than generated tokens.
    steps = after["jaxserve_engine_steps_total"] - before["jaxserve_engine_steps_total"]
    tokens = after["jaxserve_generation_tokens_total"] - before["jaxserve_generation_tokens_total"]
    assert steps < tokens / 2, (steps, tokens)
    ttft = "jaxserve_time_to_first_token_seconds_count"
    assert after[ttft] - before[ttft] >= NUM_REQUESTS - NUM_REQUESTS // 4
    print(f"{NUM_REQUESTS} requests in {elapsed:.1f}s, {tokens:.0f} tokens in {steps:.0f} steps")
