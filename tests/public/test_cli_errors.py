"""Every command answers a user error (unknown model or preset, missing folder or file, a hub id this machine
cannot reach, a bad flag value) with exit code 2 and one line on stderr naming what is wrong: no traceback.
Each bad input fails before anything is compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    (root / "empty").mkdir()
    gpt2 = root / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    broken = root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    return root


def _run(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")  # a hub id is refused at once, offline
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


# (command line, what the one line must name)
CASES = [
    (["-m", "jaxserve.capacity", "--model", "no-such-preset", "--hbm-gb", "80"], "'no-such-preset' is neither"),
    (["-m", "jaxserve.capacity", "--model", "org/no-such-model", "--hbm-gb", "80"], "could not be fetched"),
    (["-m", "jaxserve.capacity", "--model", "{empty}", "--hbm-gb", "80"], "has no config.json"),
    (["-m", "jaxserve.capacity", "--model", "{broken}", "--hbm-gb", "80"], "config.json is not valid JSON"),
    (["-m", "jaxserve.capacity", "--model", "{gpt2}", "--hbm-gb", "80"], "unsupported architecture"),
    (["-m", "jaxserve.capacity", "--model", "llama-3.1-8b", "--hbm-gb", "x"], "--hbm-gb"),
    (["-m", "jaxserve.capacity", "--model", "llama-3.1-8b", "--hbm-gb", "8"], "do not fit"),
    (["-m", "jaxserve.capacity", "--model", "llama-3.1-8b", "--hbm-gb", "80", "--mesh", "tensor=3"], "tensor=3"),
    (["-m", "jaxserve.capacity", "--model", "llama-3.1-8b", "--hbm-gb", "80", "--page-size", "0"], "--page-size"),
    (["-m", "jaxserve.aot", "--model", "no-such-preset", "--topology", "v5e:2x2"], "neither a preset"),
    (["-m", "jaxserve.aot", "--model", "org/no-such-model", "--topology", "h100"], "could not be fetched"),
    (["-m", "jaxserve.aot", "--model", "{gpt2}", "--topology", "h100"], "unsupported architecture"),
    (["-m", "jaxserve.aot", "--model", "llama-3.2-1b", "--topology", "h100", "--decode-batches", "a"],
     "--decode-batches"),
    (["-m", "jaxserve.aot", "--model", "llama-3.2-1b", "--topology", "h100", "--mesh", "bogus"], "bogus"),
    (["-m", "jaxserve.aot", "--model", "llama-3.2-1b"], "--topology"),
    (["-m", "jaxserve.plan"], "a command is required"),
    (["-m", "jaxserve.plan", "nonsense"], "unknown command 'nonsense'"),
    (["-m", "jaxserve.plan", "simulate", "--chip", "v6e", "--model", "org/no-such-model"], "could not be fetched"),
    (["-m", "jaxserve.plan", "simulate", "--steps", "{empty}/steps.json"], "steps.json"),
    (["-m", "jaxserve.plan", "simulate", "--chip", "v6e", "--model", "llama-3.1-8b", "--rates", "x"], "--rates"),
    (["-m", "jaxserve.plan", "calibrate", "--out", "{empty}/o.json", "--model", "{empty}/missing"], "missing"),
    (["-m", "jaxserve.generate", "--model", "org/no-such-model"], "could not be fetched from the hub"),
    (["-m", "jaxserve.generate", "--model", "{gpt2}"], "unsupported architecture"),
    (["-m", "jaxserve.generate", "--max-tokens", "0"], "max_tokens=0"),
    (["-m", "jaxserve.generate", "--max-num-seqs", "-3"], "max_num_seqs=-3"),
    (["-m", "jaxserve.generate", "--page-size", "3"], "page_size=3 must be a power of two"),
    (["-m", "jaxserve.generate", "--mesh", "tensor=3", "--log-level", "error"], "tensor=3 has 3 devices"),  # engine
    (["-m", "jaxserve.serve", "--model", "{empty}/missing"], "missing"),
    (["-m", "jaxserve.serve", "--model", "org/no-such-model"], "could not be fetched from the hub"),
    (["-m", "jaxserve.serve", "--max-n", "0"], "--max-n=0"),
    # Refused by the engine once both servers listen: one line all the same, once.
    (["-m", "jaxserve.serve", "--mesh", "tensor=3", "--http-port", "0", "--grpc-port", "0", "--log-level", "error"],
     "tensor=3 has 3 devices"),
    (["-m", "jaxserve.cli", "serve", "{empty}"], "has no config.json"),
    (["-m", "jaxserve.cli", "capacity", "--model", "nope", "--hbm-gb", "80"], "neither a preset"),
    (["-m", "jaxserve.cli", "nonsense"], "unknown command 'nonsense'"),
]


@pytest.mark.parametrize("argv, needle", CASES, ids=[" ".join(a[1:4]) + f" {i}" for i, (a, _) in enumerate(CASES)])
def test_a_user_error_is_one_line_and_exit_code_2(argv, needle, folders):
    argv = [a.format(**{p.name: p for p in folders.iterdir()}) for a in argv]
    needle = needle.format(**{p.name: p for p in folders.iterdir()})
    out = _run(*argv)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr and len(lines) == 1, out.stderr[-2000:]
    assert ": error: " in lines[0] and needle in lines[0], lines[0]


def test_a_config_without_architectures_is_read_by_its_model_type(tmp_path):
    """A config.json with ``model_type: llama`` and no ``architectures``: capacity, aot and plan read it."""
    cfg = dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from jaxserve.tools.model_specs import model_config

    assert model_config(str(tmp_path)).architecture == "LlamaForCausalLM"
    out = _run("-m", "jaxserve.capacity", "--model", str(tmp_path), "--hbm-gb", "1")
    assert out.returncode == 0 and "LlamaForCausalLM" in out.stdout, out.stderr[-2000:]
    # The preset names aot takes, capacity takes too (a preset is not a hub id).
    out = _run("-m", "jaxserve.capacity", "--model", "llama-3.1-8b", "--hbm-gb", "80")
    assert out.returncode == 0 and "LlamaForCausalLM" in out.stdout, out.stderr[-2000:]
