"""What reinforcement-learning clients read and call on the HTTP server: vLLM's ``return_token_ids`` and
``/tokenize`` fields, ``POST /sleep`` / ``/wake_up`` / ``GET /is_sleeping``, and ``POST /v1/update_weights``."""

import json

import httpx
import pytest

from server_harness import ADMIN_KEY, API_KEY, MAX_MODEL_LEN, MODEL_NAME, shared_server, tiny_model

AUTH = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}  # the admin routes need the admin key
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def server(request):
    return shared_server(request)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http, headers=AUTH, timeout=120) as c:
        yield c


def events(resp: httpx.Response) -> list[dict]:
    assert resp.status_code == 200, resp.text
    lines = [ln[len("data: "):] for ln in resp.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_return_token_ids_in_completions_streamed_or_not(http):
    tok = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": "The quick brown fox"}).json()
    body = {"prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0, "n": 2, "return_token_ids": True}
    full = http.post("/v1/completions", json=body).json()
    for choice in full["choices"]:
        assert choice["prompt_token_ids"] == tok["tokens"]
        assert len(choice["token_ids"]) == 5
    chunks = events(http.post("/v1/completions", json={**body, "stream": True}))
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["prompt_token_ids"] == tok["tokens"]
        assert all(c["prompt_token_ids"] is None for c in mine[1:])
        assert sum((c["token_ids"] for c in mine), []) == full["choices"][index]["token_ids"]
    plain = http.post("/v1/completions", json={**body, "return_token_ids": False}).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_return_token_ids_in_chat_streamed_or_not(http):
    tok = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": True}).json()
    body = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "return_token_ids": True}
    full = http.post("/v1/chat/completions", json=body).json()
    assert full["prompt_token_ids"] == tok["tokens"]
    assert len(full["choices"][0]["token_ids"]) == 5
    chunks = events(http.post("/v1/chat/completions", json={**body, "stream": True}))
    assert chunks[0]["prompt_token_ids"] == tok["tokens"]
    ids = sum((c["choices"][0].get("token_ids", []) for c in chunks[1:] if c["choices"]), [])
    assert ids == full["choices"][0]["token_ids"]


def test_tokenize_fields_as_vllm_answers_them(http):
    plain = http.post("/tokenize", json={"prompt": "The quick brown fox"}).json()
    assert set(plain) == {"count", "max_model_len", "tokens", "token_strs"}
    assert plain["token_strs"] is None and plain["max_model_len"] == MAX_MODEL_LEN
    assert plain["tokens"][0] == 0  # <s>: add_special_tokens defaults to true for a prompt
    bare = http.post("/tokenize", json={"prompt": "The quick brown fox", "add_special_tokens": False,
                                        "return_token_strs": True}).json()
    assert bare["tokens"] == plain["tokens"][1:]
    assert "".join(bare["token_strs"]) == "TheĠquickĠbrownĠfox"  # vocabulary entries (byte-level BPE)
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    no_prompt = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    assert len(no_prompt) < len(chat) and chat[: len(no_prompt)] == no_prompt
    cont = [*MESSAGES, {"role": "assistant", "content": "jumps"}]
    open_end = http.post("/tokenize", json={"messages": cont, "add_generation_prompt": False,
                                            "continue_final_message": True}).json()["tokens"]
    closed = http.post("/tokenize", json={"messages": cont, "add_generation_prompt": False}).json()["tokens"]
    assert closed[: len(open_end)] == open_end and len(closed) > len(open_end)
    r = http.post("/tokenize", json={"messages": cont, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_sleep_refuses_requests_with_503_until_wake_up(http):
    body = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
    before = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert http.post("/sleep", params={"level": 3}, headers=ADMIN).status_code == 400
    for level in (1, 2):
        assert http.post("/sleep", params={"level": level}, headers=ADMIN).status_code == 200
        assert http.get("/is_sleeping", headers=ADMIN).json() == {"is_sleeping": True}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 503 and "asleep" in r.json()["error"]["message"]
        assert http.post("/wake_up", headers=ADMIN).status_code == 200
        assert http.get("/is_sleeping", headers=ADMIN).json() == {"is_sleeping": False}
        assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == before


def test_update_weights_from_a_folder(request, http, tmp_path):
    from tiny import build_tiny_model

    body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    before = http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    other = build_tiny_model("llama", tmp_path / "other", seed=1)  # same shapes and tokenizer, other weights
    r = http.post("/v1/update_weights", json={"path": str(other)}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] != before
    assert http.post("/v1/update_weights", json={"path": str(tiny_model(request))}, headers=ADMIN).status_code == 200
    assert http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] == before
    for bad in ({}, {"path": 3}, {"path": "/no/such/folder"}, {"path": str(tmp_path)}):
        r = http.post("/v1/update_weights", json=bad, headers=ADMIN)
        assert r.status_code == 400 and r.json()["error"]["param"] == "path", r.text
