"""scripts/batch_generate.py: results appended per request, kill-and-resume loses and duplicates nothing."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tiny import build_tiny_model, hf_greedy, hf_model, train_tokenizer

ROOT = Path(__file__).resolve().parents[2]
# One request at a time, so 60 requests of 12 tokens leave the kill (after 5 results) far from the job's end; longer
# outputs only add decode steps.
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), tokenizer=train_tokenizer())


def write_input(path: Path) -> dict:
    rng = np.random.default_rng(0)
    valid = {}
    lines = []
    for i in range(60):
        prompt = rng.integers(3, 300, int(rng.integers(2, 20))).tolist()
        valid[f"req-{i}"] = prompt
        lines.append(json.dumps({"id": f"req-{i}", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                                 "ignore_eos": True}))
        if i == 5:
            lines.append("{not json")  # line 7
        if i == 10:
            lines.append(json.dumps({"prompt": "no id"}))  # line 13
        if i == 20:
            lines.append(json.dumps({"id": "bad-temp", "prompt": "x", "temperature": -1}))  # line 24
        if i == 30:
            lines.append(json.dumps({"id": "req-3", "prompt": [5, 6]}))  # line 35: duplicate id
    lines.append(json.dumps({"id": 7, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}))
    valid[7] = None
    path.write_text("\n".join(lines) + "\n")
    return valid


def command(model_dir, inp, out, cache):
    return [sys.executable, "scripts/batch_generate.py", "--model", str(model_dir), "--input", str(inp), "--output",
            str(out), "--max-num-seqs", "1", "--max-in-flight", "1", "--max-num-batched-tokens", "32",
            "--max-model-len", "64", "--page-size", "4", "--no-warmup", "--compilation-cache-dir", str(cache)]


def test_kill_and_resume(model_dir, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    valid = write_input(inp)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(command(model_dir, inp, out, tmp_path / "xla"), cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 5):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the job finished before it could be killed"
    first = out.read_text().count("\n")
    assert 5 <= first < len(valid)
    with open(out, "a") as f:  # a crash in the middle of a write leaves half a line behind
        f.write('{"id": "req-59", "text": "tru')

    done = subprocess.run(command(model_dir, inp, out, tmp_path / "xla"), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    ids = [r["id"] for r in records]
    assert sorted(map(str, ids)) == sorted(map(str, valid)), "every valid id exactly once"
    assert len(ids) == len(set(map(str, ids)))
    for lineno, why in ((7, "invalid JSON"), (13, "missing 'id'"), (24, "temperature"), (35, "duplicate id")):
        assert f"in.jsonl:{lineno}: skipped" in done.stderr and why in done.stderr
    assert f"{first} already done" in done.stdout and "generated tok/s" in done.stdout
    hf = hf_model(model_dir)
    by_id = {r["id"]: r for r in records}
    for rid in ("req-0", "req-4", f"req-{first}", "req-59"):  # before the kill, around it, after it
        assert by_id[rid]["token_ids"] == hf_greedy(hf, valid[rid], MAX_TOKENS), rid
        assert by_id[rid]["finish_reason"] == "length" and by_id[rid]["usage"]["completion_tokens"] == MAX_TOKENS
    assert by_id[7]["usage"]["completion_tokens"] <= 3
