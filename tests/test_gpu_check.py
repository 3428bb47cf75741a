"""scripts/gpu_check.py, the GPU check kit, run here in its CPU dry-run mode (no GPU needed)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def kit():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_names_the_pallas_backend(kit):
    assert kit.pallas_backend('custom_call_target="__gpu$xla.gpu.triton"') == "Triton"
    assert kit.pallas_backend('custom_call_target="mosaic_gpu_v2"') == "Mosaic GPU"
    assert kit.pallas_backend("stablehlo.add") == "unknown"


def test_reads_junit_counts(kit, tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text('<testsuites><testsuite tests="7" failures="1" errors="0" skipped="2"/></testsuites>')
    assert kit.junit_counts(xml) == {"passed": 4, "failed": 1, "errors": 0, "skipped": 2}


def test_dry_run_writes_one_report(kit, tmp_path):
    out = tmp_path / "report.md"
    assert kit.main(["--dry-run", "--out", str(out), "--skip", "bench"]) == 0
    text = out.read_text()
    assert text.startswith("# jaxserve GPU check (dry run on CPU: not a GPU result)")
    assert "Pallas GPU backend of `ragged_paged_attention_gpu`: **Triton**" in text
    assert "| Tiny random bf16 model on the device | pass |" in text
    for row in ("decode, batch 1", "prefill, one 256-token prompt", "offline, 8 requests"):
        assert row in text
    assert "FAIL" not in text
