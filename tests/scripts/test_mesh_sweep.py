"""scripts/mesh_sweep.py: a mesh that fails keeps its row (table, CSV, plot) saying why in one line, the other
meshes' rows stay, and the script exits non-zero; an expected failure (a mesh the model refuses) shows no
traceback."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "mesh_sweep.py"

_spec = importlib.util.spec_from_file_location("mesh_sweep", SCRIPT)
mesh_sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mesh_sweep)

RAN = {"mesh": "tensor=2", "devices": 2, "requests": 2, "output_tokens": 8, "wall_s": 0.5, "output_tok_s": 16.0,
       "total_tok_s": 40.0, "ttft_mean_ms": 10.0, "ttft_p50_ms": 9.0, "ttft_p99_ms": 12.0, "tpot_mean_ms": 2.0,
       "tpot_p50_ms": 2.0, "warmup_s": 3.0, "tokens_sha": "abc"}


@pytest.mark.quick
def test_a_failed_mesh_is_a_row_saying_why_and_the_exit_code_is_1(tmp_path, capsys):
    failed = mesh_sweep.child_row("tensor=3", 1, "FAILED tensor=3 does not divide the 4 attention heads\n", "")
    assert failed == {"mesh": "tensor=3", "devices": 3, "error": "tensor=3 does not divide the 4 attention heads"}
    # An unexpected failure: the last line of the child's stderr (its exception) and its exit code.
    crashed = mesh_sweep.child_row("data=2", -9, "", "Traceback (most recent call last):\n  ...\nMemoryError\n")
    assert crashed["error"] == "exit code -9: MemoryError"
    args = argparse.Namespace(out=str(tmp_path / "out"), results_json=None, results_label="")
    assert mesh_sweep.write_outputs([RAN, failed, crashed], args, "header") == 1
    md = (tmp_path / "out" / "sweep.md").read_text().splitlines()
    row = next(line for line in md if line.startswith("| `tensor=3`"))
    assert "| 3 | failed: tensor=3 does not divide the 4 attention heads |" in row
    assert row.count("|") == md[2].count("|")  # as many cells as the header
    assert next(line for line in md if line.startswith("| `tensor=2`")).endswith("| yes |")
    with open(tmp_path / "out" / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["mesh"] for r in rows] == ["tensor=2", "tensor=3", "data=2"]
    assert rows[0]["error"] == "" and rows[1]["error"] == failed["error"] and rows[2]["output_tok_s"] == ""
    assert "2 of 3 meshes failed: tensor=3, data=2" in capsys.readouterr().err
    assert mesh_sweep.write_outputs([RAN], args, "header") == 0


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib (the bench extra)")
def test_the_plot_keeps_a_failed_mesh(tmp_path):
    failed = mesh_sweep.failed_row("tensor=3", "tensor=3 does not divide the 4 attention heads")
    mesh_sweep.plot([RAN, failed], tmp_path / "sweep.png", "header")
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_a_mesh_the_model_refuses_fails_in_one_line_and_exit_code_1(tmp_path):
    """End to end on the demo model (4 heads): ``tensor=3`` is refused before anything compiles."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, str(SCRIPT), "--meshes", "tensor=3", "--num-prompts", "2",
                          "--input-len", "8", "--output-len", "2", "--cpu-devices", "4", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    row = next(line for line in (tmp_path / "sweep.md").read_text().splitlines() if line.startswith("| `tensor=3`"))
    assert "| failed: " in row and "tensor=3" in row.partition("failed: ")[2], row
    assert "1 of 1 meshes failed: tensor=3" in out.stderr
