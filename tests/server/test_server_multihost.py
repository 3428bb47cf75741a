"""A multi-host server: two local CPU processes (one device each, gloo collectives, mesh data=2) run
``python -m jaxserve.serve`` with --coordinator-address / --num-processes / --process-id; process 0 serves,
process 1 follows. The official openai client gets the tokens of a single-device run, and a SIGTERM to process 0
ends both."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import openai
import pytest

from jaxserve.sampling_params import SamplingParams
from xla_flags import xla_flags
from server_harness import MODEL_NAME, REPO, free_port, reference_llm, server_env, ServerProcess, tiny_model

# Fewer shapes than the other servers' (3 compiled steps): both processes compile each one, with no cache.
SHAPES = ["--max-num-seqs", "2", "--max-num-batched-tokens", "16"]


@pytest.mark.slow
def test_two_process_server_serves_the_tokens_of_one(request, tmp_path):
    model = tiny_model(request)
    coordinator, http = free_port(), free_port()
    env = dict(server_env(), XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu")
    common = [*SHAPES, "--mesh", "data=2", "--coordinator-address", f"127.0.0.1:{coordinator}", "--num-processes", "2",
              "--compilation-cache-dir", "", "--no-enable-prefix-caching"]
    follower_log = open(tmp_path / "follower.log", "w")
    follower = subprocess.Popen([sys.executable, "-m", "jaxserve.serve", "--model", str(model),
                                 "--max-model-len", "128", "--page-size", "8",
                                 *common, "--process-id", "1", "--http-port", str(free_port()), "--grpc-port", "0"],
                                cwd=REPO, env=env, stdout=follower_log, stderr=subprocess.STDOUT)
    leader = None
    try:
        saved = os.environ.copy()
        os.environ.update(XLA_FLAGS=env["XLA_FLAGS"])  # ServerProcess takes this process's environment
        try:
            leader = ServerProcess(model, cache_dir="", log_path=tmp_path / "leader.log", http_port=http,
                                   extra=[*common, "--process-id", "0"])
        finally:
            os.environ.clear()
            os.environ.update(saved)
        ref = reference_llm(request)
        prompts = ["The quick brown fox", "Paged attention keeps"]
        want = [o.outputs[0].text for o in ref.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0,
                                                                                  ignore_eos=True))]
        with openai.OpenAI(base_url=leader.http + "/v1", api_key="none", max_retries=0, timeout=120) as client:
            resp = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
            assert [c.text for c in resp.choices] == want
            chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=4,
                                                  messages=[{"role": "user", "content": "hi"}])
            assert chat.choices[0].finish_reason in ("stop", "length")
        leader.signal(signal.SIGTERM)
        assert leader.wait(60) == 0
        assert follower.wait(60) == 0, (tmp_path / "follower.log").read_text()[-3000:]
    finally:
        for p in (follower, leader.proc if leader else None):
            if p is not None and p.poll() is None:
                p.kill()
        follower_log.close()
