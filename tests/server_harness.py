"""Start ``python -m jaxserve.serve`` as a real subprocess on free loopback ports, for the server tests.

One tiny model is built per test session; the main server (with an API key) is shared by the server test
modules and stopped at the end of the session. XLA compilations go to a persistent cache under pytest's cache
folder, so later starts (and later runs) skip most of the warm-up compile.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
API_KEY = "test-key-123"
ADMIN_KEY = "test-admin-key-456"
MODEL_NAME = "tiny-llama"
# Small shapes keep the warm-up compile short on CPU.
SMALL_ENGINE = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "128", "--page-size", "8"]
MAX_MODEL_LEN = 128
STARTUP_TIMEOUT = 300

_state: dict = {}


def tiny_model(request) -> Path:
    """The session's tiny Llama checkpoint (random weights, trained tokenizer with a chat template)."""
    if "model" not in _state:
        from tiny import build_tiny_model

        root = request.getfixturevalue("tmp_path_factory").mktemp("server-model")
        _state["model"] = build_tiny_model("llama", root / "tiny-llama")
    return _state["model"]


def compile_cache(request) -> str:
    """The servers' compilation cache: in pytest's cache folder, kept between runs; with the cache plugin off
    (``-p no:cacheprovider``), one folder for this session's servers."""
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return str(cache.mkdir("jaxserve_xla"))
    if "xla" not in _state:
        _state["xla"] = request.getfixturevalue("tmp_path_factory").mktemp("jaxserve_xla")
    return str(_state["xla"])


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests")] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    # Same numerics as the test process (conftest), so greedy tokens can be compared with LLM.generate.
    env["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


class ServerProcess:
    """A running server: ``http`` (base URL), ``grpc`` (host:port), ``metrics()``, ``terminate()``."""

    def __init__(self, model: Path, *, cache_dir: str, log_path: Path, extra: list[str] = (), http_port: int = 0,
                 grpc_port: int = 0, wait: bool = True, entry: tuple[str, ...] = ("-m", "jaxserve.serve")):
        self.log_path = log_path
        self.args = [sys.executable, *entry, "--model", str(model), "--served-model-name", MODEL_NAME,
                     "--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
                     *SMALL_ENGINE, "--compilation-cache-dir", cache_dir, *extra]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(self.args, cwd=REPO, env=server_env(), stdout=subprocess.PIPE,
                                     stderr=self._log, text=True)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        self.http = f"http://127.0.0.1:{http_port}" if http_port else None
        self.grpc = f"127.0.0.1:{grpc_port}" if grpc_port else None
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        self.http, self.grpc = self._wait_ready()

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _wait_ready(self) -> tuple[str, str]:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            m = re.search(r"jaxserve ready: .*http=(\S+) grpc=(\S+)", line)
            if m:
                self.ready_line = line.strip()
                return m.group(1), m.group(2)
        self.proc.kill()
        raise RuntimeError(f"server did not become ready; log:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-6000:]

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics by name with labels, e.g. ``jaxserve_requests_finished_total{finish_reason="abort"}``."""
        return parse_metrics(httpx.get(self.http + "/metrics", timeout=10).text)

    def wait_metrics(self, predicate, timeout: float = 10.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if predicate(m) or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def signal(self, sig=signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.flush()

    def terminate(self, timeout: float = 60) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def start_server(request, name: str, extra: list[str] = (), **kw) -> ServerProcess:
    log = request.getfixturevalue("tmp_path_factory").mktemp("server-logs") / f"{name}.log"
    return ServerProcess(tiny_model(request), cache_dir=compile_cache(request), log_path=log, extra=list(extra), **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shared_server(request) -> ServerProcess:
    """The main server (``--api-key API_KEY``), started on first use and stopped when the session ends. Its
    admin routes are on (``--admin-api-key ADMIN_KEY``, reading anything under the session's temporary folder),
    and it reports ``prompt_tokens_details``."""
    server = _state.get("server")
    if server is None or server.proc.poll() is not None:
        temp = request.getfixturevalue("tmp_path_factory").getbasetemp()
        server = _state["server"] = start_server(request, "shared", [
            "--api-key", API_KEY, "--enable-admin-endpoints", "--admin-api-key", ADMIN_KEY,
            "--allowed-admin-paths", str(temp), "--enable-prompt-tokens-details"])
        request.config.add_cleanup(server.terminate)
    return server


PARSERS_KEY = "parsers-key"
THINKING_TEMPLATE = Path(__file__).resolve().parent / "data" / "qwen3_thinking_xml_tools.jinja"
# enable_in_reasoning: the tests steer the random model through its reasoning with a guided_choice
PARSER_FLAGS = ["--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
                "--chat-template", str(THINKING_TEMPLATE), "--max-model-len", "256",
                "--structured-outputs-config", '{"enable_in_reasoning": true}']


def parsers_server(request) -> ServerProcess:
    """The server the reasoning, Messages and Responses tests share (``--api-key PARSERS_KEY``,
    ``--reasoning-parser qwen3``, ``--tool-call-parser qwen3_coder`` with auto tool choice, a Qwen3.5-style
    thinking template, max_model_len 256, structured output enabled in the reasoning), started on first use and stopped when the session ends."""
    server = _state.get("parsers")
    if server is None or server.proc.poll() is not None:
        server = _state["parsers"] = start_server(request, "parsers", ["--api-key", PARSERS_KEY, *PARSER_FLAGS])
        request.config.add_cleanup(server.terminate)
    return server


def reference_llm(request):
    """An in-process ``LLM`` on the same checkpoint and engine shapes as the servers (compiled lazily)."""
    if "llm" not in _state:
        from jaxserve import LLM
        _state["llm"] = LLM(str(tiny_model(request)), page_size=8, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                            max_num_batched_tokens=64, warmup=False, compilation_cache_dir=None)
    return _state["llm"]


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def pages_idle(m: dict[str, float]) -> bool:
    return (m.get("jaxserve_kv_pages_used") == 0 and m.get("jaxserve_num_requests_running") == 0
            and m.get("jaxserve_num_requests_waiting") == 0)
