"""The serve command's options and the committed gRPC stubs (no server started)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.server.args import DEMO_MODEL_NAME, parse_args

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--model", "--tokenizer", "--served-model-name", "--dtype", "--max-model-len", "--max-num-seqs",
         "--max-num-batched-tokens", "--page-size", "--num-pages", "--hbm-utilization", "--enable-prefix-caching",
         "--no-enable-prefix-caching", "--max-waiting-requests", "--compilation-cache-dir", "--attention-backend",
         "--mesh", "--seed", "--host", "--http-port", "--grpc-port", "--api-key", "--shutdown-grace-period",
         "--max-request-bytes", "--log-level", "--max-n", "--max-prompts-per-request",
         "--max-stop-strings", "--max-stop-string-chars", "--max-logprobs",
         # vLLM's names and options
         "--port", "--block-size", "--gpu-memory-utilization", "--tensor-parallel-size", "--data-parallel-size",
         "--trust-remote-code", "--revision", "--download-dir", "--generation-config", "--chat-template",
         "--skip-tokenizer-init", "--enable-auto-tool-choice", "--tool-call-parser", "--enable-prompt-tokens-details",
         "--enable-admin-endpoints", "--max-cpu-loras",
         # jaxserve's safety options
         "--cache-salt-per-api-key", "--admin-api-key", "--allowed-admin-paths", "--router-connect-timeout",
         "--router-read-timeout"]


def test_help_documents_every_flag():
    out = subprocess.run([sys.executable, "-m", "jaxserve.serve", "--help"], cwd=REPO, capture_output=True, text=True,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in FLAGS:
        assert flag in out.stdout, flag
    assert "demo-model-v1" in out.stdout.replace("\n", "")  # where the demo model lives, for outside tools' --tokenizer


def test_the_waiting_queue_has_no_count_limit_by_default_on_any_mesh():
    """vLLM queues every request it can hold: no default cap on the waiting sequences, whatever the meshes (what
    admitted requests hold is bounded by host memory, AsyncEngine.token_budget)."""
    for argv in ([], ["--mesh", "data=2", "--max-num-seqs", "4"],
                 ["--prefill-mesh", "tensor=2", "--decode-mesh", "data=2", "--max-num-seqs", "4"]):
        assert parse_args(argv).engine_config.max_waiting_requests is None, argv
    assert parse_args(["--max-waiting-requests", "7"]).engine_config.max_waiting_requests == 7


def test_defaults_and_engine_config(monkeypatch):
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    args = parse_args([])
    assert args.model is None and args.served_model_name == [DEMO_MODEL_NAME]
    assert args.host == "127.0.0.1" and args.api_key is None
    cfg = args.engine_config
    assert cfg.model is None and cfg.enable_prefix_caching
    assert (cfg.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens) == (512, 8, 128)  # demo-sized
    assert cfg.max_waiting_requests is None  # vLLM's queue: no count limit
    assert (args.limits.max_n, args.limits.max_prompts_per_request, args.limits.max_logprobs) == (16, 64, 20)
    assert parse_args(["--max-waiting-requests", "0"]).engine_config.max_waiting_requests is None  # no limit

    monkeypatch.setenv("JAXSERVE_API_KEY", "from-env")
    args = parse_args(["--model", "some/model", "--max-num-seqs", "4", "--no-enable-prefix-caching",
                       "--max-waiting-requests", "7", "--page-size", "8", "--compilation-cache-dir", ""])
    assert args.served_model_name == ["some/model"] and args.api_key == ["from-env"]  # --api-key takes several
    cfg = args.engine_config
    assert (cfg.max_num_seqs, cfg.enable_prefix_caching, cfg.max_waiting_requests, cfg.page_size) == (4, False, 7, 8)
    assert cfg.compilation_cache_dir is None
    assert (cfg.max_model_len, cfg.max_num_batched_tokens) == (None, 512)  # the engine's defaults for real models


def test_vllm_names_and_the_jaxserve_command(monkeypatch):
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    args = parse_args(["--model", "m", "--port", "9001", "--block-size", "32", "--gpu-memory-utilization", "0.5",
                       "-tp", "4", "--data-parallel-size", "2", "--generation-config", "vllm", "--revision", "v2",
                       "--download-dir", "/tmp/hub", "--chat-template", "{{ messages }}", "--skip-tokenizer-init"])
    cfg = args.engine_config
    assert args.http_port == 9001 and (cfg.page_size, cfg.hbm_utilization, cfg.mesh) == (32, 0.5, "tensor=4,data=2")
    # vLLM's rule: -tp/-dp take the first N devices, whatever the host has; --num-devices given explicitly wins
    assert cfg.num_devices == 8 and parse_args(["-tp", "2"]).engine_config.num_devices == 2
    assert parse_args(["-tp", "2", "--num-devices", "4"]).engine_config.num_devices == 4
    assert parse_args(["-tp", "1"]).engine_config.num_devices is None  # the single-device default
    assert (cfg.generation_config, cfg.revision, cfg.download_dir) == ("vllm", "v2", "/tmp/hub")
    assert cfg.chat_template == "{{ messages }}" and cfg.skip_tokenizer_init
    assert parse_args(["--model", "m"]).http_port == 8000  # an alias left out changes nothing
    out = subprocess.run([sys.executable, "-m", "jaxserve.cli", "serve", "--help"], cwd=REPO, capture_output=True,
                         text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: jaxserve serve"), out.stderr


def test_the_model_by_position_as_vllm_serve_takes_it(monkeypatch):
    """``python -m jaxserve.serve MODEL`` as ``jaxserve serve MODEL`` and ``vllm serve MODEL``: the same as
    ``--model MODEL``, before or after the options; both given and equal is fine."""
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    for argv in (["m"], ["m", "--port", "9001"], ["--port", "9001", "m"], ["m", "--model", "m"]):
        args = parse_args(argv)
        assert args.model == args.engine_config.model == "m" and args.served_model_name == ["m"], argv
    assert parse_args([]).model is None  # no model: the demo model


@pytest.mark.parametrize("argv, needle", [
    (["a", "--model", "b"], "the model is given twice and differs: 'a' by position, --model 'b'"),
    (["a", "b"], "unrecognized arguments: b"),
    (["--trust-remote-code"], "never runs code"),
    (["--mesh", "tensor=2", "-tp", "2"], "not both"),
    (["--enable-auto-tool-choice"], "needs --tool-call-parser"),
    (["--tool-call-parser", "xml"], "invalid choice"),
    (["--max-num-seqs", "0"], "max_num_seqs=0"),
    (["--http-port", "70000"], "--http-port"),
    (["--hbm-utilization", "1.5"], "hbm_utilization"),
    (["--dtype", "int8"], "invalid choice"),
    (["--max-logprobs", "21"], "--max-logprobs=21"),
    (["--max-n", "0"], "--max-n=0"),
    (["--role", "router"], "--role router needs --decode-url"),
    (["--decode-url", "h:1:2"], "--decode-url is for --role router"),
    (["--role", "router", "--decode-url", "h:8000"], "expected HOST:HTTP_PORT:GRPC_PORT"),
    (["--role", "decode", "--prefill-url", "h:1", "--kv-transfer", "nccl"], "invalid choice"),
    (["--structured-outputs-config", "{"], "--structured-outputs-config: not JSON"),
    (["--structured-outputs-config", "[]"], "must be a JSON object"),
    (["--structured-outputs-config", '{"enable_in_reasoning": 1}'], "enable_in_reasoning must be a bool"),
    (["--structured-outputs-config", '{"disable_any_whitespace": true}'], "set per request"),
    (["--structured-outputs-config", '{"reasoning_parser": "qwen3"}'], "differs from --reasoning-parser"),
])
def test_bad_options_exit_with_a_message(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_committed_stubs_match_the_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from gen_protos import GENERATED, PROTO_DIR, generate
    finally:
        sys.path.pop(0)
    generate(tmp_path)
    for name in GENERATED:
        assert (tmp_path / name).read_text() == (PROTO_DIR / name).read_text(), (
            f"{name} is stale: run python scripts/gen_protos.py")
    from jaxserve.server.protos import jaxserve_pb2, jaxserve_pb2_grpc

    assert jaxserve_pb2.DESCRIPTOR.package == "jaxserve.v1"
    assert hasattr(jaxserve_pb2_grpc, "JaxServeStub")


def test_the_demo_model_says_where_it_is_and_does_not_claim_to_serve(tmp_path, caplog):
    from jaxserve.models.demo import demo_model_folder, demo_model_path

    with caplog.at_level("WARNING", logger="jaxserve.models.demo"):
        folder = demo_model_path(tmp_path)  # also what python -m jaxserve.generate logs
    assert folder == demo_model_folder(tmp_path) and (folder / "tokenizer.json").exists()
    message = caplog.records[-1].getMessage()
    assert str(folder) in message and "serving" not in message


def test_an_engine_that_refuses_to_start_is_raised_once_both_servers_are_closed(caplog):
    """A ``ValueError`` from the engine's construction (a model the devices cannot hold, a mesh the model
    refuses) leaves ``serve`` as that error, for the command's one line (exit code 2); nothing logs it before."""
    import asyncio
    import logging

    from jaxserve.server.app import serve

    args = parse_args(["--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0", "--compilation-cache-dir", ""])

    def refuse(config):
        raise ValueError("the weights (9.0 GiB per device) do not fit in 8 GB")

    args.engine_factory = refuse
    with caplog.at_level(logging.INFO), pytest.raises(ValueError, match="do not fit in 8 GB"):
        asyncio.run(serve(args))
    assert not [r for r in caplog.records if "do not fit" in r.getMessage()], caplog.text
    assert [r for r in caplog.records if r.name == "jaxserve.serve" and r.getMessage() == "stopped"]


def test_start_and_stop_are_logged_under_jaxserves_names(caplog):
    """The server's start and stop lines are ``jaxserve.serve``'s; uvicorn's own lifecycle lines (as
    ``uvicorn.error``, a name that reads as a failure) are kept out, its warnings are not."""
    import asyncio
    import logging

    from jaxserve.server import logs
    from jaxserve.server.app import serve

    logs.setup("info")
    args = parse_args(["--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0", "--compilation-cache-dir", ""])

    def refuse(config):
        raise ValueError("no model here")

    args.engine_factory = refuse
    with caplog.at_level(logging.INFO), pytest.raises(ValueError):
        asyncio.run(serve(args))
    logging.getLogger("uvicorn.error").warning("Invalid HTTP request received.")
    own = [r.getMessage() for r in caplog.records if r.name == "jaxserve.serve"]
    assert own[0].startswith("loading and warming up the demo model; HTTP on 127.0.0.1:") and own[-1] == "stopped"
    assert [r.getMessage() for r in caplog.records if r.name.startswith("uvicorn")] == \
        ["Invalid HTTP request received."], caplog.text
