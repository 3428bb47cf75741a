"""Two local CPU processes of 4 devices each (gloo collectives) give the tokens of one single-device process.

Meshes: data=2,tensor=4 puts one replica on each process; tensor=8 splits every layer across both processes;
sequence=2,tensor=4 splits long-prompt rows across them.
"""

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tiny import build_tiny_model, train_tokenizer
from xla_flags import xla_flags

ROOT = Path(__file__).parents[2]
DRIVER = Path(__file__).parents[1] / "multihost_driver.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(devices: int) -> dict:
    e = dict(os.environ)
    e["XLA_FLAGS"] = xla_flags(devices)
    e["JAX_PLATFORMS"] = "cpu"
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), e.get("PYTHONPATH", "")])
    return e


def tokens_from(output: str) -> dict[str, list[list[int]]]:
    """Each mesh's greedy tokens, as the driver printed them (``TOKENS <mesh> <json>``)."""
    lines = [l.split(" ", 2) for l in output.splitlines() if l.startswith("TOKENS ")]
    return {mesh: json.loads(tokens) for _, mesh, tokens in lines}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The checkpoint and its one-device tokens, from the driver's own code run in this process (one device of the
    emulated eight, as a one-device process would run it): no second interpreter start-up and import."""
    import multihost_driver

    path = build_tiny_model("mistral", tmp_path_factory.mktemp("mistral"), tokenizer=train_tokenizer())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        multihost_driver.main(str(path), "", "0", "1", "0")
    return path, tokens_from(out.getvalue())["-"]


MESHES = ["data=2,tensor=4", "tensor=8", "sequence=2,tensor=4"]


@pytest.mark.slow
def test_two_processes_match_one(model):
    """The same two processes serve each mesh in turn (one distributed start-up for all three)."""
    path, want = model
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(DRIVER), str(path), ";".join(MESHES), port, "2", str(i)],
                              env=env(4),
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    got = tokens_from(results[0][0])
    assert list(got) == MESHES
    for mesh in MESHES:
        assert got[mesh] == want, mesh
    assert "TOKENS" not in results[1][0]  # only process 0 samples and reports
