"""vLLM's ``vllm serve`` flags (tests/data/vllm_serve_flags.txt, read from vLLM's own argument parser) in the serve
command's parser: each one parses, acts where it has a meaning here, and is refused in one line naming it where
its value would change results jaxserve does not follow."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import httpx
import pytest

from fake_server import MODEL, FakeServer
from jaxserve.server import vllm_flags
from jaxserve.server.args import build_parser, parse_args
from jaxserve.server.connections import uvicorn_config
from jaxserve.server.stats_log import StatsLogger

pytestmark = pytest.mark.quick

FLAGS_FILE = Path(__file__).resolve().parents[1] / "data" / "vllm_serve_flags.txt"
# The flags issue #59 found refused by earlier versions: each must be in vLLM's list and parse.
NAMED = ["--uvicorn-log-level", "--disable-log-requests", "--enable-log-requests", "--disable-log-stats",
         "--enforce-eager", "--swap-space", "--pipeline-parallel-size", "--tokenizer-mode",
         "--disable-uvicorn-access-log", "--max-seq-len-to-capture", "--response-role", "--root-path", "--dtype"]
# A valid value of each flag jaxserve has as its own (the others' come from vllm_flags' tables; the --ssl-*
# naming files are left to tests/server/test_server_network.py, which serves with them).
VALUES = {"--host": ["0.0.0.0"], "--port": ["8001"], "--api-key": ["k"], "--lora-modules": ["a=/tmp", "--enable-lora"],
          "--chat-template": ["{{ messages }}"], "--tool-call-parser": ["hermes"], "--ssl-cert-reqs": ["0"],
          "--enable-auto-tool-choice": ["--tool-call-parser", "hermes"], "--model": ["/tmp"], "--tokenizer": ["/tmp"],
          "--dtype": ["half"], "--seed": ["1"], "--revision": ["main"], "--max-model-len": ["256"],
          "--quantization": ["int8"], "-q": ["int8"], "--max-logprobs": ["5"], "--logprobs-mode": ["raw"],
          "--served-model-name": ["m"], "--generation-config": ["vllm"], "--load-format": ["dummy"],
          "--download-dir": ["/tmp"], "--reasoning-parser": ["qwen3"], "--tensor-parallel-size": ["1"],
          "--structured-outputs-config": ['{"backend": "xgrammar", "enable_in_reasoning": true}'],
          "-tp": ["1"], "--data-parallel-size": ["1"], "-dp": ["1"], "--block-size": ["16"],
          "--gpu-memory-utilization": ["0.5"], "--kv-cache-dtype": ["int8"], "--prefix-caching-hash-algo": ["sha256"],
          "--max-loras": ["2"], "--max-lora-rank": ["8"], "--max-cpu-loras": ["4"], "--max-num-batched-tokens": ["64"],
          "--max-num-seqs": ["4"], "--long-prefill-token-threshold": ["32"], "--speculative-config": [
              '{"method": "ngram", "num_speculative_tokens": 2}'], "--kv-events-config": ['{"publisher": "null"}'],
          "--uvicorn-log-level": ["warning"], "--root-path": ["/llm"], "--response-role": ["bot"],
          "--num-gpu-blocks-override": ["64"]}
# The flags refused whatever their value, and the on/off flags refused when on (vllm_flags.GUARDED says why).
ALWAYS_REFUSED = {name for spec, (neutral, _) in vllm_flags.GUARDED.items() if not neutral
                  for name in spec[:-1].split("/")}
REFUSED_ON = {"--trust-remote-code"} | {spec[:-1] for spec in vllm_flags.GUARDED if spec.endswith("!")}


def _vllm_flags() -> list[list[str]]:
    lines = [line.split() for line in FLAGS_FILE.read_text().splitlines()]
    return [names for names in lines if names and names[0].startswith("-")]


def _table() -> dict[str, tuple[str, tuple[str, ...] | None]]:
    """Each tabled flag name -> (how it takes a value, its neutral values; None: any value)."""
    out = {}
    for specs in vllm_flags.INERT.values():
        for spec in specs:
            out.update({name: (spec[-1], None) for name in spec[:-1].split("/")})
    for spec, (neutral, _) in vllm_flags.GUARDED.items():
        out.update({name: (spec[-1], neutral) for name in spec[:-1].split("/")})
    return out


def _argv(name: str, table: dict) -> list[str]:
    if name in table:
        kind, neutral = table[name]
        if kind == "!":
            return [name] if neutral is None else ["--no-" + name[2:]]  # on: it is refused
        return [name, neutral[0] if neutral else "1"]
    action = next(a for a in build_parser()._actions if name in a.option_strings)
    if action.nargs == 0 and name in REFUSED_ON:
        return ["--no-" + name[2:]] if "--no-" + name[2:] in action.option_strings else []
    return [name, *VALUES.get(name, [])] if action.nargs == 0 else [name, *VALUES[name]]


def test_the_list_is_vllms_and_holds_the_flags_the_issue_names():
    text = FLAGS_FILE.read_text()
    assert "99d7eb5d6a512cfcc5a2b104f24ebf2d6cda772b" in text and "vllm/entrypoints/openai/cli_args.py" in text
    names = {n for names in _vllm_flags() for n in names}
    assert len(names) > 180
    assert not [flag for flag in NAMED if flag not in names]


def test_every_vllm_flag_parses_or_is_refused_naming_itself(capsys, monkeypatch):
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    table, ours = _table(), {s for a in build_parser()._actions for s in a.option_strings}
    unknown = [n for names in _vllm_flags() for n in names if n not in ours]
    assert not unknown, f"not in the serve parser: {unknown}"
    for names in _vllm_flags():
        for name in names:
            if name in ("--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs"):
                continue
            argv = _argv(name, table)
            if name in ALWAYS_REFUSED:
                with pytest.raises(SystemExit):
                    parse_args(argv)
                err = capsys.readouterr().err
                assert err.count("\n") == 1 and f"error: {names[0]}" in err and "not supported" in err, (name, err)
                continue
            try:
                parse_args(argv)
            except SystemExit:
                pytest.fail(f"{argv}: {capsys.readouterr().err}")
            if name in REFUSED_ON:
                with pytest.raises(SystemExit):
                    parse_args([name])
                err = capsys.readouterr().err
                assert err.count("\n") == 1 and f"error: {name}: " in err, (name, err)


@pytest.mark.parametrize("argv, needle", [
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2: not supported"),
    (["-pp", "4"], "--pipeline-parallel-size 4: not supported"),
    (["--tokenizer-mode", "mistral"], "--tokenizer-mode mistral: not supported"),
    (["--rope-theta", "1e6"], "--rope-theta 1e6: not supported"),
    (["--disable-sliding-window"], "--disable-sliding-window: not supported"),
    (["--scheduling-policy", "priority"], "--scheduling-policy priority: not supported"),
])
def test_a_value_that_would_change_results_is_refused_in_one_line(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and err.count("\n") == 1, err


def test_flags_with_a_meaning_act_and_the_others_say_they_do_nothing():
    args = parse_args(["--dtype", "half", "--num-gpu-blocks-override", "64", "--enforce-eager", "--swap-space", "8",
                       "-pp", "1", "--tokenizer-mode", "auto", "--disable-log-requests", "--uvicorn-log-level",
                       "warning", "--root-path", "/llm", "--response-role", "bot", "--disable-log-stats"])
    assert args.engine_config.dtype == "float16" and args.engine_config.num_pages == 64
    assert parse_args(["--dtype", "float"]).engine_config.dtype == "float32"
    assert (args.uvicorn_log_level, args.root_path, args.response_role, args.disable_log_stats) == \
        ("warning", "/llm", "bot", True)
    assert len(args.inert_flags) == 5  # one line each
    assert args.inert_flags[0].startswith("--pipeline-parallel-size 1 does nothing here: ")
    assert any(line.startswith("--enforce-eager does nothing here: XLA") for line in args.inert_flags)
    assert parse_args([]).inert_flags == [] and not parse_args([]).disable_log_stats


def test_response_role_names_the_chat_answers_role():
    """--response-role: the answer's role (whole and streamed); without a generation prompt, the last message's
    role, as vLLM answers."""
    with FakeServer(options={"response_role": "bot"}) as server:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        whole = httpx.post(server.http + "/v1/chat/completions", json=body, timeout=30).json()
        assert whole["choices"][0]["message"]["role"] == "bot", whole
        streamed = httpx.post(server.http + "/v1/chat/completions", json={**body, "stream": True}, timeout=30).text
        first = json.loads(streamed.split("data: ", 2)[1].strip())
        assert first["choices"][0]["delta"]["role"] == "bot", first
        cont = httpx.post(server.http + "/v1/chat/completions", json={**body, "add_generation_prompt": False},
                          timeout=30).json()
        assert cont["choices"][0]["message"]["role"] == "user", cont


def test_root_path_and_uvicorn_log_level_reach_the_http_server():
    config = uvicorn_config(None, root_path="/llm", log_level="warning")
    assert (config.root_path, config.log_level) == ("/llm", "warning")
    assert uvicorn_config(None).root_path == "" and uvicorn_config(None).log_level is None


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_stats_line_reads_as_vllms_while_there_is_work(caplog):
    """StatsLogger fed made-up engine stats: vLLM's line over each interval while busy, one more after the work
    ends, then nothing while idle."""
    clock, stats = _Clock(), {}
    log = StatsLogger(lambda: dict(stats), interval_s=10, clock=clock)
    assert log.tick() is None  # no snapshot before the engine is ready
    stats.update(prompt_tokens=50, generation_tokens=10, num_running=0, num_waiting=0, pages_total=100,
                 pages_used=0, prefix_cache_queries=40, prefix_cache_hits=0, num_preemptions=0)
    assert log.tick() is None  # the starting counters
    clock.now += 10
    assert log.tick() is None  # idle
    stats.update(prompt_tokens=250, generation_tokens=510, num_running=3, num_waiting=2, pages_used=25,
                 prefix_cache_queries=240, prefix_cache_hits=50)
    clock.now += 10
    with caplog.at_level(logging.INFO, logger="jaxserve.stats"):
        line = log.tick()
    assert line == ("Engine 000: Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 50.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 2 reqs, GPU KV cache usage: 25.0%, Prefix cache hit rate: 25.0%")
    assert [r.getMessage() for r in caplog.records if r.name == "jaxserve.stats"] == [line]
    stats.update(num_running=0, num_waiting=0, pages_used=0, num_preemptions=1)
    clock.now += 10
    assert log.tick() == ("Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
                          "Running: 0 reqs, Waiting: 0 reqs, Preemptions: 1, GPU KV cache usage: 0.0%, "
                          "Prefix cache hit rate: 25.0%")  # the interval the work ended in
    clock.now += 10
    assert log.tick() is None  # idle again: no line


def test_disable_log_stats_turns_the_line_off():
    """Beside serving, the server runs a StatsLogger unless --disable-log-stats."""
    from jaxserve.server import app

    class Engine:  # what the watchers read of the engine
        def stats(self):
            return None

        def unready_reason(self):
            return None

    async def watchers(flags: list[str]) -> list[str]:
        tasks = app._watchers(parse_args(flags), Engine(), None, None, True)
        await asyncio.sleep(0)
        names = [t.get_coro().__qualname__ for t in tasks]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return names

    assert "StatsLogger.run" in asyncio.run(watchers([]))
    assert "StatsLogger.run" not in asyncio.run(watchers(["--disable-log-stats"]))


def test_underscored_flag_names_read_as_vllm_reads_them():
    args = parse_args(["--max_model_len", "256", "--max_num_seqs=4", "--served-model-name", "a_b", "--enforce_eager"])
    assert (args.engine_config.max_model_len, args.engine_config.max_num_seqs) == (256, 4)
    assert args.served_model_name == ["a_b"] and args.inert_flags[0].startswith("--enforce-eager does nothing")
