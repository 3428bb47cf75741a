"""scripts/profile_decode.py reads a GPU's kernels out of a perfetto trace (the GPU run itself is in the GPU kit's
follow-up; here a trace of known kernels)."""

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def profile_decode():
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("profile_decode", ROOT / "scripts" / "profile_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_device_kernels_are_summed_per_step_and_host_events_left_out(profile_decode, tmp_path):
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 2, "name": "PjitFunction(step)", "dur": 900.0},  # host: not a kernel
    ]
    for _ in range(2):  # two steps, each: two gemms, one attention call
        events += [{"ph": "X", "pid": 1, "name": "gemm_fusion_dot_7", "dur": 30.0},
                   {"ph": "X", "pid": 1, "name": "gemm_fusion_dot_7", "dur": 30.0},
                   {"ph": "X", "pid": 1, "name": "ragged_paged_attention_gpu", "dur": 15.0}]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    kernels, processes = profile_decode.device_kernels(path)
    assert processes == ["/device:GPU:0", "/host:CPU"]
    assert len(kernels) == 6
    summary = profile_decode.summarize(kernels, steps=2, wall_s=100e-6)
    assert summary["kernels_per_step"] == 3
    assert summary["kernel_us_per_step"] == 75
    assert summary["kernel_share_of_wall"] == pytest.approx(0.75)
    assert [(t["name"], t["calls_per_step"], t["us_per_step"]) for t in summary["top"]] == [
        ("gemm_fusion_dot_7", 2, 60), ("ragged_paged_attention_gpu", 1, 15)]
