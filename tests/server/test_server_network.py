"""What a server opens to the network (jaxserve/server/connections.py, jaxserve/config/network.py): TLS on the
public API with vLLM's flags (the ``openai`` client and gRPC against a certificate the test makes), the cluster
secret a replica requires and the router sends, the router's TLS to its replicas, the caps on connections and
calls, and the read deadlines that cut off idle and trickling clients while others are served. The servers are
the real server process around the stand-in engine (tests/fake_decode_server.py): no model, no compile."""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
import subprocess
import sys
import time

import grpc
import httpx
import openai
import pytest

from jaxserve.config.network import SECRET_ENV, SECRET_HEADER
from jaxserve.server.args import parse_args
from jaxserve.server.protos import jaxserve_pb2 as pb
from jaxserve.server.protos import jaxserve_pb2_grpc as pb_grpc

from server_harness import REPO, server_env
from tls_certs import make_certs

MODEL = "jaxserve-demo"  # the fake server's name (no --model)
SECRET = "s3cret-shared-by-the-cluster"
KEY = "user-key-1"


class Proc:
    """``python ARGS`` until it prints its ready line; ``http``, ``grpc`` from that line."""

    def __init__(self, args: list[str], log_path, timeout: float = 120):
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=server_env(), stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            m = re.search(r"jaxserve ready: .*http=(\S+) grpc=(\S+)", line)
            if m:
                self.http, self.grpc = m.group(1), m.group(2)
                return
        self.stop()
        raise RuntimeError(f"{args} did not become ready:\n{open(log_path).read()[-4000:]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def fake_server(tmp_path, name: str, *flags: str, step_s: float = 0.0) -> Proc:
    return Proc(["tests/fake_decode_server.py", str(step_s), "--http-port", "0", "--grpc-port", "0",
                 "--log-level", "warning", *flags], tmp_path / f"{name}.log")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


# The command line ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, needle", [
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-certfile", "/nonexistent/c.pem", "--ssl-keyfile", "/nonexistent/k.pem"], "--ssl-certfile"),
    (["--ssl-ca-certs", "ca.pem"], "need --ssl-certfile and --ssl-keyfile"),
    (["--ssl-cert-reqs", "3"], "invalid choice"),
    (["--cluster-secret", "short"], "--cluster-secret: at least 16 characters"),
    (["--cluster-ssl-certfile", "c.pem"], "--cluster-ssl-certfile and --cluster-ssl-keyfile go together"),
    (["--cluster-ssl-ca-certs", "ca.pem"], "give this process's own"),
    (["--role", "prefill", "--kv-transfer", "jax", "--cluster-secret", SECRET], "--kv-transfer jax"),
    (["--max-connections", "0"], "--max-connections=0"),
    (["--max-concurrent-rpcs", "-1"], "--max-concurrent-rpcs=-1"),
    (["--request-header-timeout", "0"], "--request-header-timeout=0"),
    (["--request-body-timeout", "-2"], "--request-body-timeout=-2"),
])
def test_bad_network_flags_exit_with_a_message(capsys, monkeypatch, argv, needle):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()[-1]) < 400, err


def test_network_defaults_and_the_secret_from_the_environment(monkeypatch, certs):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    args = parse_args([])
    assert args.tls is None and args.cluster.secret is None and not args.cluster.tls and args.kv_host == "127.0.0.1"
    c = args.connections
    assert (c.max_connections, c.max_concurrent_rpcs, c.header_timeout, c.body_timeout) == (1024, 1024, 10.0, 30.0)
    monkeypatch.setenv(SECRET_ENV, "from-the-environment-123")
    assert parse_args([]).cluster.secret == "from-the-environment-123"
    assert parse_args(["--cluster-secret", SECRET]).cluster.secret == SECRET  # the flag wins
    args = parse_args(["--ssl-certfile", certs.cert, "--ssl-keyfile", certs.key, "--ssl-ca-certs", certs.ca,
                       "--ssl-cert-reqs", "2"])
    assert (args.tls.certfile, args.tls.ca_certs, args.tls.cert_reqs) == (certs.cert, certs.ca, ssl.CERT_REQUIRED)


def test_kv_events_bind_the_servers_host_unless_told_otherwise():
    on = '{"enable_kv_cache_events": true}'
    cfg = parse_args(["--kv-events-config", on]).engine_config.kv_events_config
    assert cfg.publish_address == ("tcp://127.0.0.1:5557", True)  # --host's default, not every interface
    cfg = parse_args(["--host", "10.1.2.3", "--kv-events-config", on]).engine_config.kv_events_config
    assert cfg.publish_address == ("tcp://10.1.2.3:5557", True)
    cfg = parse_args(["--host", "::1", "--kv-events-config", on]).engine_config.kv_events_config
    assert cfg.publish_address == ("tcp://[::1]:5557", True)
    asked = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6001"}'
    cfg = parse_args(["--kv-events-config", asked]).engine_config.kv_events_config
    assert cfg.publish_address == ("tcp://*:6000", True) and cfg.replay_endpoint == "tcp://*:6001"  # as asked
    cfg = parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://10.0.0.9:7000"}']
                     ).engine_config.kv_events_config
    assert cfg.publish_address == ("tcp://10.0.0.9:7000", False)  # vLLM's rule: a named host is connected to


# TLS on the public API ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, certs):
    server = fake_server(tmp_path_factory.mktemp("tls"), "tls", "--ssl-certfile", certs.cert, "--ssl-keyfile",
                         certs.key)
    yield server
    server.stop()


def test_https_completion_with_the_openai_client(tls_server, certs):
    assert tls_server.http.startswith("https://")
    with httpx.Client(verify=ssl.create_default_context(cafile=certs.ca)) as http:
        client = openai.OpenAI(base_url=tls_server.http + "/v1", api_key="unused", http_client=http, max_retries=0)
        out = client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    # The same client without the CA: the certificate is refused, no completion.
    with httpx.Client() as http:
        client = openai.OpenAI(base_url=tls_server.http + "/v1", api_key="unused", http_client=http, max_retries=0)
        with pytest.raises(openai.APIConnectionError) as e:
            client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert isinstance(e.value.__cause__, httpx.ConnectError) and "CERTIFICATE_VERIFY_FAILED" in str(e.value.__cause__)
    # Plain HTTP on the TLS port gets no answer.
    with pytest.raises(httpx.HTTPError):
        httpx.get(tls_server.http.replace("https://", "http://") + "/health", timeout=5)


def test_grpc_over_tls(tls_server, certs):
    creds = grpc.ssl_channel_credentials(root_certificates=certs.ca_bytes())
    with grpc.secure_channel(tls_server.grpc, creds) as ch:
        resp = pb_grpc.JaxServeStub(ch).Tokenize(pb.TokenizeRequest(text="abc"), timeout=30)
    assert list(resp.token_ids) == [ord(c) % 100 for c in "abc"]
    with grpc.secure_channel(tls_server.grpc, grpc.ssl_channel_credentials(
            root_certificates=open(certs.other_ca, "rb").read())) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.JaxServeStub(ch).Tokenize(pb.TokenizeRequest(text="abc"), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake failed: the server is not trusted
    with grpc.insecure_channel(tls_server.grpc) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.JaxServeStub(ch).Tokenize(pb.TokenizeRequest(text="abc"), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


# The cluster secret and the router's TLS to its replicas ------------------------------------------------------
def test_replica_requires_the_cluster_secret_and_the_router_sends_it_over_mutual_tls(tmp_path, certs):
    """A replica with --cluster-secret, --api-key and mutual TLS (--ssl-cert-reqs 2): direct callers without the
    secret get 401 / UNAUTHENTICATED (the API key alone is not enough, nor the secret alone), callers without a
    client certificate get no connection; the router, holding the secret and a certificate of the CA
    (--cluster-ssl-*), serves the user's request with the user's key, on both APIs."""
    replica = fake_server(tmp_path, "replica", "--api-key", KEY, "--cluster-secret", SECRET, "--ssl-certfile",
                          certs.cert, "--ssl-keyfile", certs.key, "--ssl-ca-certs", certs.ca, "--ssl-cert-reqs", "2")
    router = None
    try:
        host_port = replica.http.removeprefix("https://")
        grpc_port = replica.grpc.rpartition(":")[2]
        mtls = ssl.create_default_context(cafile=certs.ca)
        mtls.load_cert_chain(certs.client_cert, certs.client_key)
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        with httpx.Client(base_url=replica.http, verify=mtls, timeout=30) as direct:
            assert direct.get("/health").status_code == 200  # probes stay open
            r = direct.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 401 and SECRET_HEADER in r.json()["error"]["message"]
            r = direct.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}",
                                                                   SECRET_HEADER: SECRET + "x"})
            assert r.status_code == 401
            r = direct.post("/v1/completions", json=body, headers={SECRET_HEADER: SECRET})
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"]  # never in place of the key
            r = direct.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}",
                                                                   SECRET_HEADER: SECRET})
            assert r.status_code == 200, r.text
        with pytest.raises(httpx.HTTPError):  # no client certificate: no connection
            httpx.get(replica.http + "/health", verify=ssl.create_default_context(cafile=certs.ca), timeout=5)
        creds = grpc.ssl_channel_credentials(certs.ca_bytes(), open(certs.client_key, "rb").read(),
                                             open(certs.client_cert, "rb").read())
        with grpc.secure_channel(replica.grpc, creds) as ch:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.JaxServeStub(ch).Tokenize(pb.TokenizeRequest(text="a"), timeout=10,
                                                   metadata=[("authorization", f"Bearer {KEY}")])
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and SECRET_HEADER in e.value.details()

        router = Proc(["-m", "jaxserve.serve", "--role", "router", "--decode-url", f"{host_port}:{grpc_port}",
                       "--http-port", "0", "--grpc-port", "0", "--log-level", "warning", "--cluster-secret", SECRET,
                       "--cluster-ssl-certfile", certs.client_cert, "--cluster-ssl-keyfile", certs.client_key,
                       "--cluster-ssl-ca-certs", certs.ca], tmp_path / "router.log")
        r = httpx.post(router.http + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        r = httpx.post(router.http + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 401  # the user's key is still the replica's to check
        with grpc.insecure_channel(router.grpc) as ch:
            resp = pb_grpc.JaxServeStub(ch).Tokenize(pb.TokenizeRequest(text="ab"), timeout=30,
                                                      metadata=[("authorization", f"Bearer {KEY}")])
        assert list(resp.token_ids) == [ord("a") % 100, ord("b") % 100]
        assert replica.alive()
    finally:
        if router is not None:
            router.stop()
        replica.stop()


# Bounded connections ------------------------------------------------------------------------------------------
def test_connection_and_call_caps(tmp_path):
    """--max-connections: a request beyond the cap is answered 503 (and served again once connections close);
    --max-concurrent-rpcs: a call beyond the cap is answered RESOURCE_EXHAUSTED while one streams."""
    server = fake_server(tmp_path, "caps", "--max-connections", "4", "--max-concurrent-rpcs", "1",
                         "--request-header-timeout", "30", step_s=0.05)
    host, port = server.http.removeprefix("http://").rsplit(":", 1)
    try:
        idle = [socket.create_connection((host, int(port))) for _ in range(4)]
        time.sleep(0.5)  # the server has accepted them
        r = httpx.get(server.http + "/v1/models", timeout=10)
        assert r.status_code == 503
        for s in idle:
            s.close()
        time.sleep(0.5)
        assert httpx.get(server.http + "/v1/models", timeout=10).status_code == 200

        with grpc.insecure_channel(server.grpc) as ch:
            stub = pb_grpc.JaxServeStub(ch)
            stream = stub.Generate(pb.GenerateRequest(text="long", sampling_params=pb.SamplingParams(
                max_tokens=100, ignore_eos=True)), timeout=60)
            next(stream)  # it runs (about 5 s of steps)
            with pytest.raises(grpc.RpcError) as e:
                stub.Tokenize(pb.TokenizeRequest(text="a"), timeout=10)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            stream.cancel()
        time.sleep(0.5)
        with grpc.insecure_channel(server.grpc) as ch:
            assert list(pb_grpc.JaxServeStub(ch).Tokenize(pb.TokenizeRequest(text="a"), timeout=10).token_ids)
    finally:
        server.stop()


HEADER_TIMEOUT_S = 2.0


async def _soak(http: str) -> dict:
    """300 sockets: 100 that send nothing, 100 that send their headers a byte a second, 100 whose headers say
    1000 bytes of body that arrive a byte a second; meanwhile normal requests. Returns what happened."""
    host, port = http.removeprefix("http://").rsplit(":", 1)
    closed_after: dict[str, list[float]] = {"idle": [], "headers": [], "body": []}
    start = time.monotonic()

    async def hold(kind: str) -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        if kind == "body":
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 1000\r\n\r\n{")
        trickle = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 100
        i = 0
        while time.monotonic() - start < 25:
            if kind != "idle":
                try:
                    writer.write(trickle[i % len(trickle):i % len(trickle) + 1] if kind == "headers" else b" ")
                    await writer.drain()
                except ConnectionError:
                    break
                i += 1
            try:
                if await asyncio.wait_for(reader.read(1024), 1.0) == b"":
                    break  # closed by the server
            except asyncio.TimeoutError:
                continue
            except ConnectionError:
                break
        closed_after[kind].append(time.monotonic() - start)
        writer.close()

    holders = [asyncio.ensure_future(hold(kind)) for kind in ("idle", "headers", "body") for _ in range(100)]
    await asyncio.sleep(0.5)
    normal = []
    async with httpx.AsyncClient(base_url=http, timeout=10) as client:
        for _ in range(5):
            t = time.monotonic()
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            normal.append((r.status_code, time.monotonic() - t))
            await asyncio.sleep(0.2)
    await asyncio.wait_for(asyncio.gather(*holders), 30)
    return {"normal": normal, "closed_after": closed_after}


def test_idle_and_trickling_connections_are_cut_off_while_others_are_served(tmp_path):
    server = fake_server(tmp_path, "soak", "--request-header-timeout", str(HEADER_TIMEOUT_S),
                         "--request-body-timeout", str(HEADER_TIMEOUT_S))
    try:
        got = asyncio.run(_soak(server.http))
        assert all(status == 200 and seconds < 5 for status, seconds in got["normal"]), got["normal"]
        for kind, closed in got["closed_after"].items():
            assert len(closed) == 100, kind
            # Each was cut off by the server, well before the 25 s it would have held on, not before its deadline.
            assert all(HEADER_TIMEOUT_S * 0.9 < t < 15 for t in closed), (kind, sorted(closed)[::10])
        assert server.alive()
        assert httpx.get(server.http + "/v1/models", timeout=10).status_code == 200
    finally:
        server.stop()
