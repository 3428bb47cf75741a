"""Start-up, overload and graceful shutdown of a real server subprocess (its own server: it gets SIGTERM)."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.protos import jaxserve_pb2 as pb
from jaxserve.protos import jaxserve_pb2_grpc as pb_grpc
from server_harness import free_port, start_server

MAX_WAITING = 40
# The flood below is ~600 batched steps of work and the short stream ~24 steps, so at a few ms per step a
# half-second grace period sits well between the two.
GRACE = 0.5
LONG = {"prompt": "Continuous batching admits new requests", "max_tokens": 100, "ignore_eos": True}


def _health(channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service="jaxserve.v1.JaxServe"), timeout=5).status


@pytest.fixture(scope="module")
def server(request):
    """Checks the start-up states on the way: health 503 / NOT_SERVING and requests refused until warm."""
    http_port, grpc_port = free_port(), free_port()
    srv = start_server(request, "lifecycle", ["--max-waiting-requests", str(MAX_WAITING), "--shutdown-grace-period",
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
        assert "max_waiting_requests=40" in err["message"] and err["code"] == 429
    assert max(t for _, t in rejected) < min(t for _, t in served)  # refused at once, not after waiting
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r, _ in served)
    assert grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED and "overloaded" in grpc_details
    m = server.metrics()
    assert m['jaxserve_requests_rejected_total{api="http",reason="overloaded"}'] == len(rejected)


def test_sigterm_drains_then_exits_zero(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.http, timeout=60,
                                     limits=httpx.Limits(max_connections=100)) as client, \
                grpc.aio.insecure_channel(server.grpc) as channel:
            stub = pb_grpc.JaxServeStub(channel)
            # A: a short stream, in flight when SIGTERM arrives; it must complete.
            async with client.stream("POST", "/v1/completions", json={
                    "prompt": "The quick brown fox", "max_tokens": 24, "ignore_eos": True, "stream": True}) as a:
                lines = a.aiter_lines()
                first = await anext(lines)
                assert first.startswith("data: ")
                # B: more work than the grace period allows, over both front ends.
                flood = [asyncio.ensure_future(client.post("/v1/completions", json=LONG))
                         for _ in range(MAX_WAITING - 2)]
                grpc_call = stub.Generate(pb.GenerateRequest(text=LONG["prompt"], sampling_params=pb.SamplingParams(
                    max_tokens=100, ignore_eos=True)))
                first_msg = await grpc_call.read()
                assert first_msg.token_ids
                await asyncio.sleep(0.1)
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
            grpc_msgs = [first_msg]
            while (msg := await grpc_call.read()) != grpc.aio.EOF:
                grpc_msgs.append(msg)
            flood_results = await asyncio.gather(*flood)
        return events, grpc_msgs, flood_results, signalled

    events, grpc_msgs, flood_results, signalled = asyncio.run(asyncio.wait_for(main(), 120))
    code = server.wait(timeout=60)
    exited = time.monotonic() - signalled
    assert code == 0, server.log()
    # A completed normally.
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # What could not finish within the grace period was aborted, with a proper final answer.
    reasons = [r.json()["choices"][0]["finish_reason"] for r in flood_results]
    assert all(r.status_code == 200 for r in flood_results)
    assert set(reasons) <= {"length", "abort"} and "abort" in reasons, reasons
    assert grpc_msgs[-1].finish_reason in (pb.FINISH_REASON_ABORT, pb.FINISH_REASON_LENGTH)
    assert grpc_msgs[-1].HasField("usage")
    assert GRACE <= exited < GRACE + 20
