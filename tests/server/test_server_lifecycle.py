"""Start-up, overload and graceful shutdown of a real server subprocess (its own server: it gets SIGTERM)."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.server.protos import jaxserve_pb2 as pb
from jaxserve.server.protos import jaxserve_pb2_grpc as pb_grpc
from server_harness import free_port, parse_metrics, start_server

MAX_WAITING = 64
FLOOD_GRPC, FLOOD_HTTP = 50, 8
# One sequence runs at a time. At SIGTERM the stream A has at most 100 steps left and the flood below holds 50+
# queued sequences of 100 tokens (5,000+ steps), so from a fraction of a ms to 15 ms per step the grace period
# sits well between the two.
GRACE = 1.5
LONG = {"prompt": "Continuous batching admits new requests", "max_tokens": 100, "ignore_eos": True}


def _health(channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service="jaxserve.v1.JaxServe"), timeout=5).status


@pytest.fixture(scope="module")
def server(request):
    """Checks the start-up states on the way: health 503 / NOT_SERVING and requests refused until warm."""
    http_port, grpc_port = free_port(), free_port()
    srv = start_server(request, "lifecycle", ["--max-num-seqs", "1", "--max-waiting-requests", str(MAX_WAITING),
                                              "--shutdown-grace-period",
                                              str(GRACE)], http_port=http_port, grpc_port=grpc_port, wait=False)
    try:
        deadline = time.monotonic() + 120
        while True:  # until the HTTP socket answers (it listens before the engine is built)
            try:
                health = httpx.get(srv.http + "/health", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and srv.proc.poll() is None, srv.log()
                time.sleep(0.05)
        if health.status_code == 503:  # still warming up (the usual case: the warm-up takes seconds)
            assert health.json()["status"] == "starting"
            r = httpx.post(srv.http + "/v1/completions", json={"prompt": "hi"}, timeout=5)
            assert r.status_code == 503 and "starting up" in r.json()["error"]["message"]
            with grpc.insecure_channel(srv.grpc) as ch:
                status = _health(ch)
            assert status in (health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING)
        srv.wait_ready()
        assert httpx.get(srv.http + "/health", timeout=5).status_code == 200
        with grpc.insecure_channel(srv.grpc) as ch:
            assert _health(ch) == health_pb2.HealthCheckResponse.SERVING
        yield srv
    finally:
        srv.terminate()


def test_overload_gets_429_and_resource_exhausted_at_once(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.http, timeout=60,
                                     limits=httpx.Limits(max_connections=100)) as client, \
                grpc.aio.insecure_channel(server.grpc) as channel:
            stub = pb_grpc.JaxServeStub(channel)

            async def post():
                start = time.monotonic()
                r = await client.post("/v1/completions", json=LONG)
                return r, time.monotonic() - start

            tasks = [asyncio.ensure_future(post()) for _ in range(MAX_WAITING + 24)]
            grpc_code = grpc_details = None
            for next_done in asyncio.as_completed(tasks):
                r, _ = await next_done
                if r.status_code == 429 and grpc_code is None:  # the queue is full right now
                    try:
                        async for _ in stub.Generate(pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(
                                max_tokens=2))):
                            pass
                    except grpc.aio.AioRpcError as e:
                        grpc_code, grpc_details = e.code(), e.details()
            return [t.result() for t in tasks], grpc_code, grpc_details

    results, grpc_code, grpc_details = asyncio.run(asyncio.wait_for(main(), 120))
    statuses = [r.status_code for r, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    rejected = [(r, t) for r, t in results if r.status_code == 429]
    served = [(r, t) for r, t in results if r.status_code == 200]
    assert rejected and len(served) >= MAX_WAITING
    for r, t in rejected:
        err = r.json()["error"]
        assert f"max_waiting_requests={MAX_WAITING}" in err["message"] and err["code"] == 429
    assert max(t for _, t in rejected) < min(t for _, t in served)  # refused at once, not after waiting
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r, _ in served)
    assert grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED and "overloaded" in grpc_details
    m = server.metrics()
    assert m['jaxserve_requests_rejected_total{api="http",reason="overloaded"}'] == len(rejected)


def test_sigterm_drains_then_exits_zero(server):
    def finished(m):
        return sum(v for k, v in m.items() if k.startswith("jaxserve_requests_finished_total"))

    async def main():
        async with httpx.AsyncClient(base_url=server.http, timeout=60,
                                     limits=httpx.Limits(max_connections=100)) as client, \
                grpc.aio.insecure_channel(server.grpc) as channel:
            stub = pb_grpc.JaxServeStub(channel)
            done_before = finished(server.metrics())
            # A: a stream in flight when SIGTERM arrives; it must complete. Its 115 tokens are about the most the
            # server's max_model_len of 128 leaves its 9-token prompt, so it still runs once the flood is queued.
            async with client.stream("POST", "/v1/completions", json={
                    "prompt": "The quick brown fox", "max_tokens": 115, "ignore_eos": True, "stream": True}) as a:
                # A is admitted (its headers came back), so it holds the one batch slot. B: far more work than
                # the grace period allows, mostly over gRPC (one connection: it queues within milliseconds), some
                # over HTTP, sent before A's first token is read.
                calls = [stub.Generate(pb.GenerateRequest(text=LONG["prompt"], sampling_params=pb.SamplingParams(
                    max_tokens=LONG["max_tokens"], ignore_eos=True))) for _ in range(FLOOD_GRPC)]
                grpc_results = [asyncio.ensure_future(_collect(c)) for c in calls]
                http_results = [asyncio.ensure_future(client.post("/v1/completions", json=LONG))
                                for _ in range(FLOOD_HTTP)]
                lines = a.aiter_lines()
                first = await anext(lines)
                assert first.startswith("data: ")
                while True:  # until the flood is queued
                    m = parse_metrics((await client.get("/metrics")).text)
                    if m["jaxserve_num_requests_waiting"] >= FLOOD_GRPC:
                        break
                    await asyncio.sleep(0.005)
                assert finished(m) == done_before  # A is still running
                server.signal()
                signalled = time.monotonic()

                # Draining: health says so and new requests are refused, on both front ends.
                health = health_pb2_grpc.HealthStub(channel)
                while (await health.Check(health_pb2.HealthCheckRequest(service=""))).status \
                        != health_pb2.HealthCheckResponse.NOT_SERVING:
                    assert time.monotonic() - signalled < 2
                    await asyncio.sleep(0.005)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Generate(pb.GenerateRequest(text="hi")):
                        pass
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details()
                health_http = await client.get("/health")
                assert health_http.status_code == 503 and health_http.json()["status"] == "draining"
                refused = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]

                events = [first] + [line async for line in lines if line]
            return events, await asyncio.gather(*grpc_results), await asyncio.gather(*http_results), signalled

    events, grpc_results, http_results, signalled = asyncio.run(asyncio.wait_for(main(), 120))
    code = server.wait(timeout=60)
    exited = time.monotonic() - signalled
    assert code == 0, server.log()
    # A completed normally.
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len("".join(c["choices"][0]["text"] for c in chunks)) > 0
    # What could not finish within the grace period was aborted, each with a proper final answer.
    assert all(r.status_code == 200 for r in http_results)
    reasons = [r.json()["choices"][0]["finish_reason"] for r in http_results] + grpc_results
    assert set(reasons) <= {"length", "abort"} and reasons.count("abort") >= FLOOD_GRPC // 2, reasons
    assert GRACE <= exited < GRACE + 20


async def _collect(call) -> str:
    """The finish reason of a gRPC Generate call ("length", "abort", ...)."""
    last = None
    async for msg in call:
        last = msg
    assert last is not None and last.HasField("usage")
    return pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
