"""The Mosaic GPU attention kernel lowered and exported for a described H100 (sm_90a) with no GPU, as
``scripts/export_mosaic_gpu.py`` does at every serving shape: Pallas builds the Mosaic GPU module (wgmma, TMA,
barriers), infers and checks its register layouts, tilings and swizzles (what the CPU interpreter does not
model), and embeds it in the ``mosaic_gpu_v2`` custom call; only Mosaic's compile to machine code is left for a
real GPU. The cases cover every serving shape (decode, large-batch decode, prefill, a mixed step with a window and
a soft cap, and one with gpt-oss's attention sinks), head sizes at the extremes and in between, 16-bit and 8-bit
pools; the script's full sweep (7 head sizes x 5 pools x 4 shapes) is recorded in
docs/benchmarks/gpu-compile-only.md. (XLA's GPU
compiler also compiles the program around the custom call for the described H100, about 40 s per shape, which these
tests leave out.)
"""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "export_mosaic_gpu.py"


@pytest.fixture(scope="module")
def export():
    from jaxserve.tools import gpu_targets

    try:
        gpu_targets.devices("h100")
    except gpu_targets.NoGpuCompiler as e:
        pytest.skip(str(e))
    spec = importlib.util.spec_from_file_location("export_mosaic_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.export_case


@pytest.mark.parametrize("shape,head_dim,pool,sinks", [
    ("decode", 128, "bfloat16", False),
    ("large_decode", 80, "fp8", False),  # 8-bit rows of 80 bytes: shared memory without a swizzle
    ("prefill", 256, "int8", False),  # the largest tile and ring
    ("mixed", 96, "float16", False),
    ("mixed", 64, "bfloat16", True),  # gpt-oss: head size 64, a window, a sink per query head
])
def test_exports_for_h100(export, shape, head_dim, pool, sinks):
    exported = export("h100", shape, head_dim, pool, sinks=sinks)
    assert exported.platforms == ("cuda",)
    module = exported.mlir_module()
    assert "stablehlo.custom_call @mosaic_gpu_v2" in module and "wgmma" in module


def test_the_target_is_hopper(export):
    """Mosaic GPU reads the architecture it lowers for off the described device: compute capability 9.0, i.e.
    sm_90a, for the H100 and the H200."""
    from jax.experimental.mosaic.gpu import utils

    from jaxserve.tools import gpu_targets

    for target in ("h100", "h200"):
        with gpu_targets.described_mesh(target):
            assert utils._infer_arch() == (9, 0)
