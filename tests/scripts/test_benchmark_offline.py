"""scripts/benchmark_offline.py end to end on a tiny model (with transformers as the peer), and the roofline
arithmetic it prints against."""

import os
import re
import subprocess
import sys
from pathlib import Path

from jaxserve.models.config import ModelConfig
from jaxserve.executor.kv_cache import bytes_per_token
from jaxserve.tools.roofline import decode_cost, matmul_flops_per_token, prefill_cost, weight_bytes
from tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def test_roofline_counts(tmp_path):
    cfg = ModelConfig.from_pretrained(build_tiny_model("llama", tmp_path / "m"))  # untied embeddings
    embed = cfg.vocab_size * cfg.hidden_size
    assert weight_bytes(cfg, 4) == (cfg.num_params - embed) * 4  # every matrix once, no embedding table
    kv = bytes_per_token(cfg, "float32")
    d = decode_cost(cfg, 4, batch=3, context=9)
    assert d.bytes == weight_bytes(cfg, 4) + 3 * 10 * kv
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 3 * 10
    assert d.flops == 3 * matmul_flops_per_token(cfg) + attention
    p = prefill_cost(cfg, 4, tokens=8)
    head = 2 * cfg.hidden_size * cfg.vocab_size  # the LM head runs on the last row only
    assert p.flops == 8 * (matmul_flops_per_token(cfg) - head) + head + \
        4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 8 * 4.5
    assert d.bound_seconds(1e9, 1e12) == d.flops / 1e9 and d.bound_seconds(1e15, 1e3) == d.bytes / 1e3


def test_benchmark_offline_reports_and_compares(tmp_path):
    model = build_tiny_model("llama", tmp_path / "m")
    cmd = [sys.executable, str(ROOT / "scripts" / "benchmark_offline.py"), "--model", str(model),
           "--num-requests", "3", "--prompt-len", "4:9", "--output-len", "3", "--max-num-seqs", "4",
           "--max-num-batched-tokens", "32", "--max-model-len", "64", "--page-size", "4", "--no-warmup",
           "--compilation-cache-dir", "", "--probe-batches", "1,2", "--probe-context", "8",
           "--compare", "transformers", "--hf-batch-sizes", "3", "--profile"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "jaxserve: 3 requests in" in out and "output tok/s" in out and "mean step" in out
    assert "workload compute bound" in out
    for b in (1, 2):
        assert f"decode batch {b} @ context 8:" in out and "host overhead" in out and "bandwidth bound" in out
    assert "transformers batch 3:" in out and "jaxserve / transformers (best batch) =" in out
    # The profiled run's split by layer kind: each kind found in the trace (the named scopes reached the ops).
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("  profile ")}
    assert set(lines) == {"prefill", "decode"}, out
    for line in lines.values():
        ms = dict(re.findall(r"(embed|norm|attention|mlp|lm_head|sampler|rest) ([0-9.]+) \(", line))
        assert set(ms) == {"embed", "norm", "attention", "mlp", "lm_head", "sampler", "rest"}, line
        assert float(ms["attention"]) > 0 and float(ms["mlp"]) > 0, line
        assert "per layer (us): attention" in line


def test_benchmark_offline_through_generate_times_its_phases(tmp_path):
    """``--api generate --rounds 2``: each round through LLM.generate, its phases timed; every request's
    tokens counted (3 requests x 3 tokens)."""
    model = build_tiny_model("llama", tmp_path / "m")
    cmd = [sys.executable, str(ROOT / "scripts" / "benchmark_offline.py"), "--model", str(model),
           "--num-requests", "3", "--prompt-len", "4:9", "--output-len", "3", "--max-num-seqs", "4",
           "--max-num-batched-tokens", "32", "--max-model-len", "64", "--page-size", "4",
           "--no-warmup", "--compilation-cache-dir", "", "--probe-batches", "", "--api", "generate",
           "--skip-tokenizer-init",
           "--rounds", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rounds = [line for line in proc.stdout.splitlines() if line.startswith("round ")]
    assert len(rounds) == 2, proc.stdout
    for line in rounds:
        phases = re.search(r"admission (\d+) ms, (\d+) steps with prompt tokens (\d+) ms, (\d+) decode steps", line)
        assert phases is not None and "output assembly" in line, line
        assert int(phases[2]) >= 1 and int(phases[2]) + int(phases[4]) >= 3, line  # 3 tokens: a step per token
