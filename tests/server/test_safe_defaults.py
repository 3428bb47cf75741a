"""Safe to put on a network: a server started with default flags refuses what a stranger could abuse, and the
options that open more keep their own guards (issue #50).

With default flags: every admin route is a 404 (HTTP; gRPC has no admin method at all), ``usage`` carries no
``prompt_tokens_details`` (gRPC: no ``cached_prompt_tokens``), and JSON given as text inside a request is held to
the body's nesting limit (a 400 naming the field, no 500, no traceback). The router forwards only the public
routes, checks its own key before it tokenizes anything, and gives up on a decode server that stops answering.

Enabled: admin routes need the admin key (an API key opens none), a path outside ``--allowed-admin-paths`` is
refused the same way whether it exists or not, one weight update runs at a time (409), registered adapters are
capped (409 naming ``--max-cpu-loras``), and ``--cache-salt-per-api-key`` keeps each key's prefix-cache pages to
itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import grpc
import httpx
import pytest

import jaxserve
from fake_server import FakeServer
from jaxserve.server import router as router_module
from jaxserve.server.access import DEV_ROUTES, LORA_ROUTES, AdminConfig, tenant_salt
from jaxserve.server.args import parse_args
from jaxserve.server.protos import jaxserve_pb2 as pb
from jaxserve.server.protos import jaxserve_pb2_grpc as pb_grpc
from server_harness import start_server

KEY_A, KEY_B, ADMIN_KEY = "tenant-a-key", "tenant-b-key", "admin-key-789"
ADMIN_ROUTES = DEV_ROUTES + LORA_ROUTES
# Long enough for several full pages (--page-size 8), so a repeat would hit the prefix cache.
PROMPT = "Tenants share nothing they should not, not even a cached page of a prompt like this one " * 2
DEEP = "[" * 5000 + "]" * 5000  # valid JSON, nested 5,000 deep
DEEPISH = "[" * 40 + "]" * 40  # within Python's recursion limit, past the body's 32 levels


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def default_server(request):
    server = start_server(request, "safe-defaults")  # no flag beyond the harness's model, shapes and ports
    yield server
    server.terminate()


@pytest.fixture(scope="module")
def http(default_server):
    with httpx.Client(base_url=default_server.http, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def admin_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("admin-root")
    (root / "inside").mkdir()
    os.symlink("/etc", root / "link-to-etc")
    return root


@pytest.fixture(scope="module")
def tenant_server(request, admin_root):
    server = start_server(request, "safe-tenants", [
        "--api-key", KEY_A, KEY_B, "--cache-salt-per-api-key", "--enable-prompt-tokens-details",
        "--enable-admin-endpoints", "--admin-api-key", ADMIN_KEY, "--allowed-admin-paths", str(admin_root)])
    yield server
    server.terminate()


def generate(target: str, key: str | None, **fields) -> list:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.JaxServeStub(channel)
        metadata = (("authorization", f"Bearer {key}"),) if key else ()
        return list(stub.Generate(pb.GenerateRequest(**fields), metadata=metadata, timeout=120))


# Default flags ---------------------------------------------------------------------------------------------------
def test_admin_routes_answer_404_by_default(http):
    body = {"prompt": "hi", "max_tokens": 2}
    for method, path in ADMIN_ROUTES:
        r = http.request(method, path, json={"path": "/etc", "lora_name": "x", "lora_path": "/etc"})
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"]["message"] == f"no route {method} {path}"
    assert http.post("/v1/completions", json=body).status_code == 200  # /sleep did not put it to sleep


def test_grpc_serves_no_admin_method(default_server):
    assert set(pb.DESCRIPTOR.services_by_name["JaxServe"].methods_by_name) == {"Generate", "Tokenize",
                                                                               "GetModelInfo"}
    with grpc.insecure_channel(default_server.grpc) as channel:
        for name in ("Sleep", "WakeUp", "UpdateWeights", "LoadLoraAdapter"):
            with pytest.raises(grpc.RpcError) as e:
                channel.unary_unary(f"/jaxserve.v1.JaxServe/{name}")(b"", timeout=30)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_usage_tells_nothing_of_the_prefix_cache_by_default(default_server, http):
    body = {"prompt": PROMPT, "max_tokens": 1}
    for _ in range(2):  # the second would hit the first one's pages
        usage = http.post("/v1/completions", json=body).json()["usage"]
        assert usage["prompt_tokens_details"] is None, usage
    for _ in range(2):
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT[:80]}],
                                                       "max_tokens": 1})
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens_details"] is None, chat.text
    with http.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                       "stream_options": {"include_usage": True}}) as r:
        last = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")][-1]
    assert last["usage"]["prompt_tokens"] > 0 and last["usage"]["prompt_tokens_details"] is None
    for _ in range(2):
        msgs = generate(default_server.grpc, None, text=PROMPT, sampling_params=pb.SamplingParams(max_tokens=1))
        assert msgs[-1].usage.prompt_tokens > 0 and msgs[-1].usage.cached_prompt_tokens == 0


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": "hi", "guided_json": DEEP}, "guided_json"),
    ("/v1/completions", {"prompt": "hi", "guided_json": DEEPISH}, "guided_json"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": DEEP}}, "structured_outputs"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": DEEP}}},
     "response_format"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}],
                              "tool_choice": "none"}, "tools"),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": DEEP}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}, "messages"),
])
def test_json_text_in_a_field_gets_the_body_limits(default_server, http, path, body, field):
    if path == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    logged = default_server.log_path.stat().st_size
    r = http.post(path, json={**body, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "nested too deeply" in err["message"] and "\n" not in err["message"], err
    default_server.log()  # flushed
    with open(default_server.log_path) as f:
        f.seek(logged)
        assert "Traceback" not in f.read()
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_admin_flags_refuse_to_start_without_an_admin_key(monkeypatch, capsys):
    for name in ("JAXSERVE_API_KEY", "JAXSERVE_ADMIN_API_KEY", "VLLM_SERVER_DEV_MODE",
                 "VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        monkeypatch.delenv(name, raising=False)
    args = parse_args([])
    assert not args.admin.enabled and not args.enable_prompt_tokens_details and not args.cache_salt_per_api_key
    for argv, env in ((["--enable-admin-endpoints", "--api-key", "k"], {}),
                      (["--api-key", "k"], {"VLLM_SERVER_DEV_MODE": "1"}),
                      (["--api-key", "k"], {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})):
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            with pytest.raises(SystemExit) as e:
                parse_args(argv)
        assert e.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert "--admin-api-key" in lines[-1], lines
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    admin = parse_args([]).admin
    assert admin.dev_routes and not admin.lora_routes
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "0")
    for value, on in (("True", True), ("1", True), ("yes", False), ("0", False)):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert parse_args([]).admin.lora_routes is on and not parse_args([]).admin.dev_routes
    monkeypatch.setenv("JAXSERVE_ADMIN_API_KEY", "adm")
    assert parse_args(["--enable-admin-endpoints", "--api-key", "k"]).admin.admin_api_key == "adm"
    with pytest.raises(SystemExit):
        parse_args(["--enable-admin-endpoints", "--api-key", "k", "--admin-api-key", "k"])


# Enabled, with their own guards ----------------------------------------------------------------------------------
def test_admin_routes_need_the_admin_key(tenant_server):
    with httpx.Client(base_url=tenant_server.http, timeout=60) as c:
        for headers in ({}, bearer(KEY_A), bearer(KEY_B), bearer("wrong")):
            r = c.get("/is_sleeping", headers=headers)
            assert r.status_code == 401 and "admin" in r.json()["error"]["message"], r.text
            assert c.post("/sleep", headers=headers).status_code == 401
        assert c.get("/is_sleeping", headers=bearer(ADMIN_KEY)).json() == {"is_sleeping": False}
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                      headers=bearer(KEY_A)).status_code == 200  # never put to sleep


def test_paths_outside_the_allowed_folders_are_refused_alike(tenant_server, admin_root, tmp_path):
    (tmp_path / "config.json").write_text("{}")  # an existing checkpoint-looking folder outside the roots
    outside = ["/etc", "/no/such/folder", str(tmp_path), str(admin_root / ".."), str(admin_root / "link-to-etc"),
               str(admin_root / "inside" / ".." / ".." / "elsewhere"), "relative/path"]
    with httpx.Client(base_url=tenant_server.http, timeout=60, headers=bearer(ADMIN_KEY)) as c:
        for route, field, extra in (("/v1/update_weights", "path", {}),
                                    ("/v1/load_lora_adapter", "lora_path", {"lora_name": "x"})):
            answers = set()
            for path in outside:
                r = c.post(route, json={**extra, field: path})
                assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
                answers.add(r.json()["error"]["message"].replace(repr(path), "PATH"))
            assert len(answers) == 1 and "--allowed-admin-paths" in answers.pop()
            # inside the root, a folder that is no checkpoint is refused for what it is
            r = c.post(route, json={**extra, field: str(admin_root / "inside")})
            assert r.status_code == 400 and "--allowed-admin-paths" not in r.json()["error"]["message"]


def test_each_api_key_is_its_own_tenant(tenant_server):
    with httpx.Client(base_url=tenant_server.http, timeout=60) as c:
        def cached(key, salt=None):
            body = {"prompt": PROMPT, "max_tokens": 1, **({"cache_salt": salt} if salt is not None else {})}
            r = c.post("/v1/completions", json=body, headers=bearer(key))
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached(KEY_A) == 0
        assert cached(KEY_A) > 0  # a tenant hits its own pages
        assert cached(KEY_B) == 0  # the other tenant's same prompt does not
        assert cached(KEY_B, tenant_salt(KEY_A, None)) == 0  # nor by naming the first one's salt
        assert cached(KEY_A, "x") == 0  # a request's own salt splits its key's pages further
        assert cached(KEY_B) > 0 and cached(KEY_A, "x") > 0
    prompt = "On gRPC too, each key's requests keep their pages to themselves: " * 2
    sampling = pb.SamplingParams(max_tokens=1)
    first = generate(tenant_server.grpc, KEY_A, text=prompt, sampling_params=sampling)[-1].usage
    again = generate(tenant_server.grpc, KEY_A, text=prompt, sampling_params=sampling)[-1].usage
    other = generate(tenant_server.grpc, KEY_B, text=prompt, sampling_params=sampling)[-1].usage
    assert first.cached_prompt_tokens == 0 and again.cached_prompt_tokens > 0 and other.cached_prompt_tokens == 0


def test_one_weight_update_at_a_time(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    admin = AdminConfig(dev_routes=True, allowed_paths=(str(tmp_path),))
    with FakeServer(max_num_seqs=4, options={"admin": admin}) as server:
        weights = server.fake.executor.weights
        weights.hold.clear()  # the first update's read waits
        first: dict = {}
        thread = threading.Thread(target=lambda: first.update(
            r=httpx.post(server.http + "/v1/update_weights", json={"path": str(tmp_path / "a")}, timeout=60)))
        thread.start()
        deadline = time.monotonic() + 10
        while not weights.reads and time.monotonic() < deadline:
            time.sleep(0.01)
        assert weights.reads == [str(tmp_path / "a")]
        second = httpx.post(server.http + "/v1/update_weights", json={"path": str(tmp_path / "b")}, timeout=60)
        assert second.status_code == 409 and second.json()["error"]["param"] == "path", second.text
        assert "already running" in second.json()["error"]["message"]
        assert weights.reads == [str(tmp_path / "a")]  # the second never read anything
        weights.hold.set()
        thread.join(30)
        assert first["r"].status_code == 200 and server.fake.weights_from == str(tmp_path / "a")
        third = httpx.post(server.http + "/v1/update_weights", json={"path": str(tmp_path / "b")}, timeout=60)
        assert third.status_code == 200 and server.fake.weights_from == str(tmp_path / "b")


def test_registered_adapters_are_capped(tmp_path):
    admin = AdminConfig(lora_routes=True, allowed_paths=(str(tmp_path),), max_cpu_loras=2)
    with FakeServer(max_num_seqs=4, options={"admin": admin}) as server, \
            httpx.Client(base_url=server.http, timeout=60) as c:
        def load(name):
            (tmp_path / name).mkdir(exist_ok=True)
            return c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(tmp_path / name)})

        assert load("a").status_code == 200 and load("b").status_code == 200
        r = load("c")
        assert r.status_code == 409 and "--max-cpu-loras" in r.json()["error"]["message"], r.text
        assert set(server.fake.loras) == {"a", "b"}
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
        assert load("c").status_code == 200 and set(server.fake.loras) == {"b", "c"}


# The router ------------------------------------------------------------------------------------------------------
class _CountingTokenizer:
    """Counts every use (the router must not tokenize or render a template for a request it refuses)."""

    chat_template = "{{ messages }}"

    def __init__(self):
        self.calls = 0

    def encode(self, text, add_special_tokens=True):
        self.calls += 1
        return [ord(ch) % 100 for ch in text]

    def apply_chat_template(self, messages, **kwargs):
        self.calls += 1
        return [len(m["content"]) for m in messages]


class _Index:
    page_size = 4

    def prompt_hashes(self, token_ids, page_size, cache_salt=None):
        return []

    def longest_prefix(self, name, hashes):
        return 0


async def _through_router(backend: tuple[str, str], calls, **router_kw):
    """``calls(client, router)`` against a router over ``backend`` (taken as live), in this event loop."""
    router = router_module.Router([backend], **router_kw)
    for b in router.pool.backends:
        router.pool.set_live(b)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router.app()), base_url="http://router",
                                     timeout=30) as client:
            return await calls(client, router)
    finally:
        await router.aclose()


def test_the_router_forwards_only_public_routes_and_checks_its_key_first():
    replica_admin = AdminConfig(dev_routes=True, lora_routes=True)
    with FakeServer(max_num_seqs=4, options={"admin": replica_admin}) as server:
        backend = (server.http, server.grpc)
        tokenizer = _CountingTokenizer()

        async def calls(client, router):
            out = {}
            for method, path in ADMIN_ROUTES + (("GET", "/openapi.json"), ("POST", "/v1/anything")):
                out[path] = (await client.request(method, path, json={}, headers=bearer(KEY_A))).status_code
            completion = {"prompt": "hello there", "max_tokens": 2}
            chat = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}
            out["no key"] = [(await client.post(p, json=b)).status_code
                             for p, b in (("/v1/completions", completion), ("/v1/chat/completions", chat))]
            out["wrong key"] = (await client.post("/v1/completions", json=completion,
                                                  headers=bearer("wrong"))).status_code
            out["tokenized before a key"] = tokenizer.calls
            out["with key"] = [(await client.post(p, json=b, headers=bearer(KEY_A))).status_code
                               for p, b in (("/v1/completions", completion), ("/v1/chat/completions", chat))]
            out["tokenized"] = tokenizer.calls
            # vLLM's rule: the key guards /v1 only; /tokenize is forwarded without one.
            out["tokenize no key"] = (await client.post("/tokenize", json={"prompt": [5, 6]})).status_code
            out["version"] = (await client.get("/version")).json()  # the router's own, without a key
            return out

        out = asyncio.run(_through_router(backend, calls, api_key=[KEY_A, KEY_B], tokenizer=tokenizer,
                                          prefix_index=_Index()))
        assert all(out[path] == 404 for _, path in ADMIN_ROUTES), out
        assert out["/openapi.json"] == 404 and out["/v1/anything"] == 404
        assert not server.engine.sleeping  # /sleep never reached the replica
        assert out["no key"] == [401, 401] and out["wrong key"] == 401 and out["tokenized before a key"] == 0
        assert out["with key"] == [200, 200] and out["tokenized"] == 2
        assert out["tokenize no key"] == 200
        assert out["version"] == {"version": jaxserve.__version__}

        async def admin_calls(client, router):
            return [(await client.get("/is_sleeping", headers=bearer(key))).status_code for key in (KEY_A, ADMIN_KEY)]

        # with admin routes on at the router too, they are forwarded, behind the admin key
        assert asyncio.run(_through_router(backend, admin_calls, api_key=[KEY_A],
                                           admin=AdminConfig(dev_routes=True, admin_api_key=ADMIN_KEY))) == [401, 200]


def test_the_router_forwards_the_responses_and_messages_apis_and_reads_anthropics_key_header():
    """/v1/responses, /v1/messages and /v1/messages/count_tokens go through the router to a replica; the
    Messages API's routes take the key as ``x-api-key`` too (Anthropic's clients send it so), the others do not."""
    with FakeServer(max_num_seqs=4, options={"api_key": [KEY_A]}) as server:
        async def calls(client, router):
            model = (await client.get("/v1/models", headers=bearer(KEY_A))).json()["data"][0]["id"]
            messages = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hello there"}]}
            x_key = {"x-api-key": KEY_A, "anthropic-version": "2023-06-01"}
            return {
                "messages": (await client.post("/v1/messages", json=messages, headers=x_key)),
                "count": (await client.post("/v1/messages/count_tokens", json=messages, headers=x_key)),
                "messages no key": (await client.post("/v1/messages", json=messages)).status_code,
                "messages wrong key": (await client.post("/v1/messages", json=messages,
                                                         headers={"x-api-key": "wrong"})).status_code,
                "responses": (await client.post("/v1/responses", json={"model": model, "input": "hello there",
                                                                       "max_output_tokens": 2},
                                                headers=bearer(KEY_A))),
                "responses x-api-key": (await client.post("/v1/responses", json={"model": model, "input": "hi"},
                                                          headers=x_key)).status_code,
            }

        out = asyncio.run(_through_router((server.http, server.grpc), calls, api_key=[KEY_A]))
        assert out["messages"].status_code == 200 and out["messages"].json()["type"] == "message", out["messages"].text
        assert out["count"].status_code == 200 and out["count"].json()["input_tokens"] > 0
        assert out["messages no key"] == 401 and out["messages wrong key"] == 401
        assert out["responses"].status_code == 200 and out["responses"].json()["object"] == "response"
        assert out["responses x-api-key"] == 401


def test_the_router_gives_up_on_a_decode_server_that_stops_answering():
    async def main():
        async def silent(reader, writer):  # reads the request; answers nothing, or one chunk of a stream
            data = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in data.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            body = await reader.readexactly(length)
            if b'"stream"' in body:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                             b"\r\n" + b"%x\r\n" % len(b"data: {}\n\n") + b"data: {}\n\n\r\n")
                await writer.drain()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:  # the test is over
                writer.close()

        upstream = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = upstream.sockets[0].getsockname()[1]

        async def calls(client, router):
            start = time.monotonic()
            plain = await client.post("/v1/completions", json={"prompt": "hi"})
            waited = time.monotonic() - start
            router.pool.set_live(router.pool.backends[0])  # the timeout took it out of rotation
            streamed = await client.post("/v1/completions", json={"prompt": "hi", "stream": True})
            return plain, waited, streamed

        try:
            return await asyncio.wait_for(_through_router((f"http://127.0.0.1:{port}", "127.0.0.1:1"), calls,
                                                          read_timeout=0.5), 20)
        finally:
            upstream.close()

    plain, waited, streamed = asyncio.run(main())
    assert plain.status_code == 504 and "--router-read-timeout" in plain.json()["error"]["message"], plain.text
    assert waited < 5
    assert streamed.status_code == 200, (streamed.status_code, streamed.text)
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[0] == "{}" and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 504 and "--router-read-timeout" in error["message"]
    defaults = parse_args(["--role", "router", "--decode-url", "127.0.0.1:1:2"])
    assert (defaults.router_connect_timeout, defaults.router_read_timeout) == (5.0, 600.0)
