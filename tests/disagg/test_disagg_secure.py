"""The channels between a decode process and its prefill service, guarded (jaxserve/config/network.py): a
prefill process and a decode process sharing ``--cluster-secret`` over mutual TLS (``--cluster-ssl-*``, a CA the
test makes) serve completions matching the colocated engine, with the KV pages over the authenticated gRPC
stream; a caller without the secret, or without a certificate of the CA, is refused and the service goes on.
Transfer offers of JAX's transfer server are numbered at random."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import grpc
import httpx
import pytest

from jaxserve.config.network import SECRET_HEADER
from jaxserve.disagg.wire import STATS_METHOD
from jaxserve.sampling_params import SamplingParams

from server_harness import (
    MODEL_NAME,
    REPO,
    SMALL_ENGINE,
    compile_cache,
    free_port,
    reference_llm,
    server_env,
    start_server,
    tiny_model,
)
from tls_certs import make_certs

SECRET = "the-cluster-secret-0123"
PROMPT_IDS = [0, 17, 23, 99, 41, 5, 77, 120, 8, 64, 33, 2, 19]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def _cluster_flags(certs) -> list[str]:
    return ["--cluster-secret", SECRET, "--cluster-ssl-certfile", certs.cert, "--cluster-ssl-keyfile", certs.key,
            "--cluster-ssl-ca-certs", certs.ca]


@pytest.fixture(scope="module")
def cluster(request, certs, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("prefill-logs") / "prefill.log"
    prefill = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.serve", "--model", str(tiny_model(request)), "--role", "prefill",
         "--kv-port", str(port), "--http-port", "0", *SMALL_ENGINE, "--compilation-cache-dir",
         compile_cache(request), *_cluster_flags(certs)], cwd=REPO, env=server_env(), stdout=subprocess.PIPE, stderr=open(log, "w"),
        text=True)
    decode = start_server(request, "secure-decode", ["--role", "decode", "--prefill-url", f"127.0.0.1:{port}",
                                                     *_cluster_flags(certs)], wait=False)
    try:
        line = prefill.stdout.readline()
        assert re.search(r"jaxserve prefill ready: kv=grpcs://127\.0\.0\.1:\d+ transfer=grpc ", line), \
            line + log.read_text()[-3000:]
        decode.wait_ready()
        yield f"127.0.0.1:{port}", decode
    finally:
        decode.terminate()
        prefill.kill()
        prefill.wait()


def _stats(target: str, creds, metadata=()):
    with grpc.secure_channel(target, creds) as ch:
        call = ch.unary_unary(STATS_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        return json.loads(call(b"", timeout=10, metadata=metadata))


def test_guarded_prefill_service_serves_the_decode_process_and_refuses_strangers(request, cluster, certs):
    target, decode = cluster
    ref = reference_llm(request).generate(PROMPT_IDS, SamplingParams(max_tokens=8, temperature=0.0,
                                                                     ignore_eos=True))[0]
    r = httpx.post(decode.http + "/v1/completions", timeout=60, headers={SECRET_HEADER: SECRET},
                   json={"model": MODEL_NAME, "prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref.outputs[0].text
    assert decode.metrics()["jaxserve_kv_transfers_total"] >= 1
    # The decode process is itself a cluster member: callers without the secret are refused.
    r = httpx.post(decode.http + "/v1/completions", timeout=30, json={"model": MODEL_NAME, "prompt": "x"})
    assert r.status_code == 401

    client = grpc.ssl_channel_credentials(certs.ca_bytes(), open(certs.client_key, "rb").read(),
                                          open(certs.client_cert, "rb").read())
    with pytest.raises(grpc.RpcError) as e:  # a certificate of the CA, but no secret
        _stats(target, client)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and SECRET_HEADER in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        _stats(target, client, [(SECRET_HEADER, SECRET[:-1] + "X")])
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:  # the secret, but no client certificate: no connection
        _stats(target, grpc.ssl_channel_credentials(certs.ca_bytes()), [(SECRET_HEADER, SECRET)])
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(target) as ch, pytest.raises(grpc.RpcError) as e:  # no TLS at all
        ch.unary_unary(STATS_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)(
            b"", timeout=10, metadata=[(SECRET_HEADER, SECRET)])
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    stats = _stats(target, client, [(SECRET_HEADER, SECRET)])  # a member: served, and still serving
    assert stats["prompt_tokens"] > 0 and stats["pages_used"] == 0 and stats["kv_transfer_offers"] == 0


def test_the_guarded_prefill_service_answers_grpc_health_without_the_secret(cluster, certs):
    """Kubernetes' gRPC probe carries no metadata: health answers it (it tells only SERVING or not); every other
    method still needs the secret."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target, _ = cluster
    client = grpc.ssl_channel_credentials(certs.ca_bytes(), open(certs.client_key, "rb").read(),
                                          open(certs.client_cert, "rb").read())
    with grpc.secure_channel(target, client) as ch:
        answer = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as refused:
        _stats(target, client)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_transfer_offers_are_numbered_at_random():
    import jax.numpy as jnp

    from jaxserve.disagg.kv_transfer import JaxTransfer

    t = JaxTransfer("127.0.0.1")
    assert t.address.startswith("127.0.0.1:")  # the --kv-host it was given, not every interface
    uuids = [t.offer((jnp.arange(4, dtype=jnp.float32),))["uuid"] for _ in range(8)]
    assert len(set(uuids)) == 8 and all(0 <= u < 2**63 for u in uuids)
    steps = {b - a for a, b in zip(uuids, uuids[1:])}
    assert 1 not in steps and len(steps) == 7  # not a counter: no id tells the next
