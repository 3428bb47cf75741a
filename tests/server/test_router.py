"""The router (``--role router``, jaxserve/server/router.py) in front of two decode processes sharing one prefill process,
all started once for the module: answers match the colocated engine, cancellation reaches the decode server, a
decode process killed mid-stream fails only its own requests, and with none left the router answers 503."""

from __future__ import annotations

import re
import time

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.server.protos import jaxserve_pb2 as pb
from jaxserve.server.protos import jaxserve_pb2_grpc as pb_grpc
from jaxserve.disagg import remote
from jaxserve.server import router as router_module
from jaxserve.server.router import parse_decode_urls
from jaxserve.sampling_params import SamplingParams
from server_harness import MODEL_NAME, free_port, pages_idle, parse_metrics, reference_llm, start_server
from test_disagg_remote import PROMPT_IDS, PrefillProcess


@pytest.fixture(scope="module")
def cluster(request):
    prefill = PrefillProcess(request, "router-prefill")
    ports = [(free_port(), free_port()) for _ in range(2)]
    urls = ",".join(f"127.0.0.1:{h}:{g}" for h, g in ports)

    def decode(i: int):
        return start_server(request, f"decode{i}", ["--role", "decode", "--prefill-url", prefill.url], wait=False,
                            http_port=ports[i][0], grpc_port=ports[i][1])

    # The second decode process starts once the first has compiled its steps into the shared compilation cache,
    # so it loads them rather than compiling the same programs at the same time.
    decodes = [decode(0)]
    router = start_server(request, "router", ["--role", "router", "--decode-url", urls], wait=False)
    try:
        decodes[0].wait_ready()
        decodes.append(decode(1))
        prefill.wait_ready()
        decodes[1].wait_ready()
        router.wait_ready()
        router.wait_metrics(lambda m: m.get("jaxserve_router_servers_live") == 2, timeout=30)
        prefills = [prefill]  # a test that restarts the prefill process appends the new one
        yield prefills, decodes, router
    finally:
        router.terminate()
        for d in decodes:
            d.terminate(timeout=10)
        for p in prefills if "prefills" in locals() else [prefill]:
            p.kill()


def _name(server) -> str:
    return server.http.removeprefix("http://")


def test_parse_decode_urls():
    assert parse_decode_urls("a:1:2,[::1]:3:4") == [("http://a:1", "a:2"), ("http://[::1]:3", "[::1]:4")]
    for bad in ("a:1", "a:1:x", "a:1:2,a:1:2", "a:0:2"):
        with pytest.raises(ValueError, match="--decode-url"):
            parse_decode_urls(bad)


def test_pool_probes_back_off_and_picks_the_least_loaded():
    """Liveness and choice without processes: /health answers come from an httpx mock transport."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from jaxserve.server import router as rt
    answers = {"a:1": [httpx.ConnectError("refused")] * 3 + [200], "b:1": [503, 200]}

    def health(req: httpx.Request) -> httpx.Response:
        a = answers[req.url.netloc.decode()].pop(0)
        if isinstance(a, Exception):
            raise a
        return httpx.Response(a, json={"status": "ok" if a == 200 else "starting"})

    async def run():
        pool = rt.Pool([("http://a:1", "a:2"), ("http://b:1", "b:2")], CollectorRegistry())
        a, b = pool.backends
        with pytest.raises(rt.NoBackend, match=r"no decode server is reachable \(a:1: not probed yet; b:1"):
            pool.pick("http")
        async with httpx.AsyncClient(transport=httpx.MockTransport(health)) as client:
            backoffs = []
            for _ in range(3):  # unreachable: each failed probe doubles the wait before the next
                before = time.monotonic()
                await pool._probe(client, a)
                backoffs.append(round(a.next_probe - before, 1))
            assert backoffs == [0.5, 1.0, 2.0] and not a.live and "ConnectError: refused" in a.reason
            await pool._probe(client, b)  # answers but is not ready: probed again in a second, no back-off
            assert not b.live and b.reason == "health 503 (starting)" and b.backoff == rt.BACKOFF_MIN_S
            await pool._probe(client, a)
            await pool._probe(client, b)
        assert a.live and b.live and a.backoff == rt.BACKOFF_MIN_S
        with pool.use(a):  # the one with fewer requests in flight; equals in turn
            assert {pool.pick("http").name for _ in range(4)} == {"b:1"}
        assert {pool.pick("http").name for _ in range(4)} == {"a:1", "b:1"}
        for x in pool.backends:
            await x.channel.close()

    asyncio.run(run())


def test_forwarding_matches_colocated_and_cancels(request, cluster):
    _, decodes, router = cluster
    client = openai.OpenAI(base_url=router.http + "/v1", api_key="unused", max_retries=0)
    llm = reference_llm(request)
    for sp, extra in ((SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), {}),
                      (SamplingParams(max_tokens=8, temperature=0.8, seed=5, ignore_eos=True), {"seed": 5})):
        for prompt in (PROMPT_IDS, PROMPT_IDS[:9]):
            want = llm.generate(prompt, sp)[0].outputs[0]
            got = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=sp.max_tokens,
                                            temperature=sp.temperature, extra_body={"ignore_eos": True}, **extra)
            assert got.choices[0].text == want.text
            streamed = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=sp.max_tokens,
                                                 temperature=sp.temperature, extra_body={"ignore_eos": True},
                                                 stream=True, **extra)
            assert "".join(c.choices[0].text for c in streamed if c.choices) == want.text
    want = llm.generate(PROMPT_IDS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].outputs[0]
    with grpc.insecure_channel(router.grpc) as ch:
        msgs = list(pb_grpc.JaxServeStub(ch).Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=PROMPT_IDS),
            sampling_params=pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)), timeout=60))
        assert [t for m in msgs for t in m.token_ids] == want.token_ids
        assert pb_grpc.JaxServeStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10).max_model_len == 128
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:  # the decode server's own refusal passes through
            list(pb_grpc.JaxServeStub(ch).Generate(pb.GenerateRequest(sampling_params=pb.SamplingParams(
                max_tokens=2)), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in e.value.details()
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(router.http + "/health", timeout=10).json()["status"] == "ok"
    bad = httpx.post(router.http + "/v1/completions", json={"model": MODEL_NAME, "prompt": [1], "max_tokens": -1})
    assert bad.status_code == 400 and "max_tokens" in bad.text
    m = router.metrics()
    for d in decodes:  # both took requests (fewest in flight first, ties in turn)
        assert m[f'jaxserve_router_requests_total{{api="http",outcome="ok",server="{_name(d)}"}}'] >= 3

    # A client that goes away mid-stream aborts its request on the decode server.
    def aborted():
        return sum(d.metrics().get('jaxserve_requests_finished_total{finish_reason="abort"}', 0) for d in decodes)

    before = aborted()
    with httpx.stream("POST", router.http + "/v1/completions", timeout=60, json=dict(
            model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=90, stream=True, ignore_eos=True)) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    deadline = time.monotonic() + 30
    while aborted() == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborted() == before + 1
    with grpc.insecure_channel(router.grpc) as ch:  # and a cancelled gRPC call
        call = pb_grpc.JaxServeStub(ch).Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=PROMPT_IDS),
            sampling_params=pb.SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True)), timeout=60)
        next(call)
        call.cancel()
    deadline = time.monotonic() + 30
    while aborted() == before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborted() == before + 2
    for d in decodes:
        assert pages_idle(d.wait_metrics(pages_idle, timeout=30))


def test_prefill_outage_is_reported_and_service_resumes_within_a_second(request, cluster):
    """With the only prefill process down, both decode processes say they are not ready, the router routes around
    them and says why; once a new prefill process is ready, requests are served again, within a second by
    construction: the decode processes probe it every ``PROBE_S`` on channels that reconnect within
    ``RECONNECT_MAX_MS`` (gRPC adds up to 20% jitter), and the router, whose decode processes answered "not ready"
    rather than not at all, probes them every ``UNREADY_PROBE_S`` (its probe loop wakes every 0.1 s) without
    backing off."""
    assert remote.PROBE_S + 1.2 * remote.RECONNECT_MAX_MS / 1000 + router_module.UNREADY_PROBE_S + 0.1 < 1.0
    prefills, decodes, router = cluster
    prefill = prefills[0]
    prefill.kill()
    deadline = time.monotonic() + 10
    while True:
        health = [httpx.get(d.http + "/health", timeout=10) for d in decodes + [router]]
        if all(h.status_code == 503 and "no prefill server is reachable" in h.text for h in health):
            break
        assert time.monotonic() < deadline, [h.text for h in health]
        time.sleep(0.05)
    assert all(d.metrics()["jaxserve_ready"] == 0 for d in decodes)
    with grpc.insecure_channel(decodes[0].grpc) as ch:
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
    r = httpx.post(router.http + "/v1/completions", timeout=30, json=dict(model=MODEL_NAME, prompt=PROMPT_IDS,
                                                                          max_tokens=2))
    assert r.status_code == 503 and "no prefill server is reachable" in r.text
    # Reachable, not ready: the router keeps probing them every UNREADY_PROBE_S instead of backing off.
    assert all(re.search(rf"{re.escape(_name(d))}: (health )?503", health[-1].text) for d in decodes), health[-1].text

    revived = PrefillProcess(request, "router-prefill-again", port=prefill.port)
    prefills.append(revived)
    revived.wait_ready()
    ready = time.monotonic()
    while True:
        r = httpx.post(router.http + "/v1/completions", timeout=30, json=dict(
            model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=2))
        if r.status_code == 200:
            break
        assert r.status_code == 503 and time.monotonic() - ready < 30, r.text  # liveness only: the bound is above
        time.sleep(0.02)
    print(f"served again {time.monotonic() - ready:.2f} s after the new prefill process was ready")
    router.wait_metrics(lambda m: m.get("jaxserve_router_servers_live") == 2, timeout=10)
    assert all(d.metrics()["jaxserve_ready"] == 1 for d in decodes)


def test_dead_decode_process_fails_its_stream_then_others_serve_then_503(request, cluster):
    _, decodes, router = cluster
    client = openai.OpenAI(base_url=router.http + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=100, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    m = router.metrics()
    victim = next(d for d in decodes if m[f'jaxserve_router_in_flight{{server="{_name(d)}"}}'] == 1)
    survivor = next(d for d in decodes if d is not victim)
    victim.proc.kill()
    with pytest.raises(openai.APIError, match=f"decode server {_name(victim)} failed"):
        for _ in stream:
            pass
    m = router.metrics()
    assert m[f'jaxserve_router_server_up{{server="{_name(victim)}"}}'] == 0
    assert m[f'jaxserve_router_requests_total{{api="http",outcome="failed",server="{_name(victim)}"}}'] == 1

    want = reference_llm(request).generate(PROMPT_IDS, SamplingParams(max_tokens=5, temperature=0.0,
                                                                      ignore_eos=True))[0].outputs[0]
    for _ in range(3):  # every later request goes to the survivor
        got = client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=5, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == want.text
    with grpc.insecure_channel(router.grpc) as ch:
        msgs = list(pb_grpc.JaxServeStub(ch).Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=PROMPT_IDS),
            sampling_params=pb.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)), timeout=60))
    assert [t for m in msgs for t in m.token_ids] == want.token_ids
    m = router.metrics()
    assert m[f'jaxserve_router_requests_total{{api="http",outcome="ok",server="{_name(survivor)}"}}'] >= 3
    assert m["jaxserve_router_servers_live"] == 1

    # A gRPC stream in flight on the last one when it dies: UNAVAILABLE naming it.
    with grpc.insecure_channel(router.grpc) as ch:
        call = pb_grpc.JaxServeStub(ch).Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=PROMPT_IDS),
            sampling_params=pb.SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)), timeout=60)
        next(call)
        survivor.proc.kill()
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and _name(survivor) in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.JaxServeStub(ch).Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT_IDS)),
                                                   timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no decode server is reachable" in \
            e.value.details()
    r = httpx.post(router.http + "/v1/completions", timeout=30, json=dict(model=MODEL_NAME, prompt=PROMPT_IDS,
                                                                          max_tokens=4))
    assert r.status_code == 503 and "no decode server is reachable" in r.text and _name(victim) in r.text
    health = httpx.get(router.http + "/health", timeout=10)
    assert health.status_code == 503 and "no decode server is reachable" in health.text
    m = parse_metrics(httpx.get(router.http + "/metrics", timeout=10).text)
    assert m['jaxserve_router_rejected_total{api="http"}'] >= 1 and m['jaxserve_router_rejected_total{api="grpc"}'] >= 1


def test_a_replica_that_resets_the_connection_before_answering_is_failed_over():
    """A replica killed under a request resets its connection before any byte of the answer: the request goes to
    a live replica (it got a 500, "ReadError", before), and the dead one leaves the rotation."""
    import asyncio
    import json as json_module
    import socket
    import struct
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    resets = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def reset_each():  # read the request, then close with RST (SO_LINGER 0), as a killed process's kernel does
        resets.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = resets.accept()
            except OSError:
                continue
            conn.recv(65536)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    class Live(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            body = json_module.dumps({"choices": [{"text": "live", "index": 0}]}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    live = ThreadingHTTPServer(("127.0.0.1", 0), Live)
    threads = [threading.Thread(target=reset_each, daemon=True), threading.Thread(target=live.serve_forever,
                                                                                   daemon=True)]
    for t in threads:
        t.start()
    dead_url, live_url = f"http://127.0.0.1:{resets.getsockname()[1]}", f"http://127.0.0.1:{live.server_port}"

    async def scenario():
        router = router_module.Router([(dead_url, "127.0.0.1:1"), (live_url, "127.0.0.1:2")])
        for b in router.pool.backends:
            router.pool.set_live(b)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router.app()),
                                         base_url="http://router", timeout=30) as client:
                answers = [await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
                           for _ in range(4)]
            return answers, router.pool
        finally:
            await router.aclose()

    try:
        answers, pool = asyncio.run(scenario())
    finally:
        stop.set()
        live.shutdown()
        resets.close()
    assert [a.status_code for a in answers] == [200] * 4, [a.text[:200] for a in answers]
    assert all(a.json()["choices"][0]["text"] == "live" for a in answers)
    dead = next(b for b in pool.backends if b.http == dead_url)
    assert not dead.live
