"""The OpenAPI schema the HTTP server publishes, fuzzed with schemathesis against a live server on loopback
(over the stand-in engine: the point is the server). Valid and invalid bodies for every operation: never a 5xx,
never a hang, every error a JSON body with a message; a normal request succeeds afterwards."""

from __future__ import annotations

import time

import httpx
import hypothesis
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fake_server import FakeServer  # noqa: E402

CASES_PER_OPERATION = 12  # derandomized cases for each operation in each mode (valid bodies, invalid bodies)
TIME_LIMIT = 60.0  # seconds of fuzzing at most, shared evenly by the operations; each sends at least one case
REQUEST_TIMEOUT = 20.0  # a request that takes longer counts as a hang


@pytest.fixture(scope="module")
def server():
    with FakeServer(max_num_seqs=4) as s:
        yield s


def test_fuzzing_the_published_schema_finds_no_5xx_and_no_hang(server):
    schema = schemathesis.openapi.from_url(server.http + "/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models"} <= paths
    seen: dict[int, int] = {}
    reached: set[tuple[str, str]] = set()
    client = httpx.Client(base_url=server.http, timeout=REQUEST_TIMEOUT)

    def send(case):
        kwargs = case.as_transport_kwargs(base_url=server.http)
        try:
            resp = client.request(kwargs["method"], kwargs["url"], headers=kwargs.get("headers"),
                                  params=kwargs.get("params"), json=kwargs.get("json"),
                                  content=kwargs.get("data") if isinstance(kwargs.get("data"), (bytes, str)) else None)
        except httpx.TimeoutException:
            raise AssertionError(f"no answer in {REQUEST_TIMEOUT}s: {case.method} {case.path} {case.body!r}")
        seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
        reached.add((case.method.upper(), case.path))
        assert resp.status_code < 500, (case.method, case.path, case.body, resp.text)
        if resp.status_code >= 400:
            body = resp.json()
            assert isinstance(body["error"]["message"], str) and body["error"]["message"], body

    # Each operation gets its own share of cases and of the time, so a slow machine sends fewer bodies to each
    # but still reaches every one (one strategy over all operations left some unreached when time ran out).
    budget = TIME_LIMIT / (2 * len(operations))
    with client:
        for op in operations:
            for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
                start = time.monotonic()
                sent = [0]

                @settings(max_examples=CASES_PER_OPERATION, deadline=None, database=None, derandomize=True,
                          phases=[Phase.generate], suppress_health_check=list(HealthCheck))
                @given(case=op.as_strategy(mode))
                def fuzz(case):
                    if sent[0] and time.monotonic() - start > budget:
                        return
                    sent[0] += 1
                    send(case)

                try:
                    fuzz()
                except hypothesis.errors.Unsatisfiable:
                    pass  # no negative body exists for an operation without inputs
    assert sum(seen.values()) >= 50, seen  # the bound above is generous: most cases do get sent
    assert reached == {(op.method.upper(), op.path) for op in operations}, reached
    assert seen.get(200, 0) and any(400 <= code < 500 for code in seen), seen
    assert server.wait_idle(10)
    resp = httpx.post(server.http + "/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=30)
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "length"
