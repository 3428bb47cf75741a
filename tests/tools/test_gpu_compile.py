"""The serving steps compiled for a described H100 / H200 by XLA's GPU compiler (jax's CUDA plugin), no GPU needed.

The plugin comes with the test extra on x86-64 Linux; there a missing plugin fails these tests rather than skipping
them, so a CI that lost it cannot pass silently.
"""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.config.engine import GPU_MEMORY_FRACTION, claim_gpu_memory
from jaxserve.tools import aot, gpu_targets

ROOT = Path(__file__).resolve().parents[2]
# A config-only folder (no weights, no tokenizer): what aot reads of a checkpoint.
TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}


def _needs_cuda_plugin():
    try:
        gpu_targets.devices("h100")
    except gpu_targets.NoGpuCompiler as e:
        if sys.platform == "linux" and platform.machine() == "x86_64":
            pytest.fail(f"{e} (pip install -e '.[test]' installs the one matching jax)")
        pytest.skip("jax's CUDA plugin has no build for this platform")


@pytest.fixture(scope="module")
def config_only_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-gpu")
    (folder / "config.json").write_text(json.dumps(TINY))
    return folder


def test_every_bucket_and_the_sampler_compile_for_sm90a(config_only_folder, tmp_path):
    """`python -m jaxserve.aot --topology h100`: every bucket the engine warms up (Pallas GPU kernels inside the
    steps) and the sampler, compiled by XLA's GPU compiler for Hopper's sm_90a, and the report it gives."""
    _needs_cuda_plugin()
    dump = tmp_path / "xla"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_dump_to={dump}", PYTHONPATH=str(ROOT))
    # Two sequences of a 16-token budget: two buckets (a prefill, a decode of two rows: on a GPU one sequence decodes
    # in the two-row bucket, shapes.decode_floor), each of both step kinds; larger ladders add more of the same.
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.aot", "--model", str(config_only_folder), "--topology", "h100",
         "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--decode-batches", "1,2", "--report-seqs", "2,8",
         "--json"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["platform"] == "gpu" and r["device_kind"] == "NVIDIA H100 80GB HBM3"
    assert r["libtpu"].startswith("jax-cuda13-plugin")  # the compiler that built them
    warmup = aot.warmup_shapes(aot.resolve(aot.Request(model=str(config_only_folder), topology="h100", mesh=None,
                                                        max_num_seqs=2, max_num_batched_tokens=16)).shapes)
    compiled = {(s["kind"], s["tokens"], s["slots"], s["pages"]) for s in r["steps"]}
    assert [s[:3] for s in warmup] == [("prefill", 16, 2), ("decode", 2, 2)]
    assert set(warmup) <= compiled and r["compiled"]["sampler_executables"] == 5
    # XLA's GPU compiler gives no cost analysis: the report says so and predicts from the model's shape.
    assert r["compiled"]["cost_analysis"] is False
    assert all(d["flops"] > 0 and d["tokens_per_s"] > 0 for d in r["decode"].values())
    m = r["memory_per_device"]
    # The engine lets jax's allocator take 95% of the device's memory; the pool is sized within that.
    assert m["hbm"] == pytest.approx(GPU_MEMORY_FRACTION * gpu_targets.GPU_TARGETS["h100"].memory_bytes)
    assert m["weights"] > 0 and m["pool_pages"] > 0 and m["fits"]
    # Hopper's architecture-specific target (wgmma, setmaxnreg), not plain sm_90.
    assert any("sm_9.0a" in p.name for p in dump.iterdir()), sorted(p.name for p in dump.iterdir())[:20]


def test_tensor_parallel_steps_compile_for_two_h200s(config_only_folder):
    _needs_cuda_plugin()
    r = aot.run(aot.Request(model=str(config_only_folder), topology="h200:2", mesh="tensor=2", max_num_seqs=4,
                            max_num_batched_tokens=32, buckets="probes", decode_batches=(1, 4), report_seqs=(2,)))
    assert r["device_kind"] == "NVIDIA H200" and r["mesh"].endswith("tensor=2")
    first = next(iter(r["decode"].values()))
    assert first["collectives"].get("all-reduce", 0) > 0  # the row-parallel projections' sums over the two GPUs
    text = aot.format_report(r)
    assert "gives no cost analysis" in text and "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95" in text


@pytest.mark.parametrize("topology,mesh,qkv", [("h200", None, True), ("h200:2", "tensor=2", True),
                                               ("h200:4", "tensor=4", False)])
def test_gpu_steps_compile_the_fused_projections_the_engine_serves(config_only_folder, topology, mesh, qkv):
    """On a GPU the engine joins Q/K/V and gate/up after loading (``fuse_projections="auto"``); aot compiles the
    same weights: Q/K/V only where the query and KV heads split alike (4 query and 2 KV heads: not over 4)."""
    _needs_cuda_plugin()
    from flax import nnx

    req = aot.Request(model=str(config_only_folder), topology=topology, mesh=mesh, max_num_seqs=4,
                      max_num_batched_tokens=32, buckets="probes")
    target = aot.resolve(req)
    weights = {".".join(map(str, k)): v.get_value()
               for k, v in nnx.to_flat_state(aot._compiler(target, req, 2, 64).params)}
    assert ("layers.0.self_attn.qkv_proj" in weights) == qkv
    assert ("layers.0.self_attn.q_proj.weight" in weights) == (not qkv)
    gate_up = weights["layers.0.mlp.gate_up_proj"]
    assert gate_up.shape == (256, 2, 512) and "layers.0.mlp.up_proj.weight" not in weights
    if mesh == "tensor=2":  # sharded as their parts: the fused weights' output dims over tensor
        assert tuple(gate_up.sharding.spec) == (None, None, "tensor")
        assert tuple(weights["layers.0.self_attn.qkv_proj"].sharding.spec)[:2] == (None, "tensor")
    # A TPU compile keeps the weights as loaded (the engine fuses on a GPU only).
    tpu = aot.Request(model=str(config_only_folder), topology="v5e:2x2", mesh="tensor=2", max_num_seqs=4,
                      max_num_batched_tokens=32, buckets="probes")
    tpu_weights = {".".join(map(str, k)) for k, _ in nnx.to_flat_state(aot._compiler(aot.resolve(tpu), tpu, 2,
                                                                                        64).params)}
    assert "layers.0.self_attn.q_proj.weight" in tpu_weights and "layers.0.mlp.gate_proj.weight" in tpu_weights


@pytest.mark.parametrize("topology,message", [
    ("h100:x", "the GPU count after ':' must be a positive integer"),
    ("h100:0", "the GPU count after ':' must be a positive integer"),
])
def test_bad_gpu_topologies_are_one_line_errors(config_only_folder, topology, message, capsys):
    assert aot.main(["--model", str(config_only_folder), "--topology", topology]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_mesh_larger_than_the_described_gpus_is_refused(config_only_folder, capsys):
    _needs_cuda_plugin()
    assert aot.main(["--model", str(config_only_folder), "--topology", "h100", "--mesh", "tensor=2"]) == 2
    assert "needs 2 devices; topology h100 has 1" in capsys.readouterr().err


def test_the_engine_claims_the_gpu_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    claim_gpu_memory()
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    claim_gpu_memory()
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"


def test_memory_fraction_must_be_a_share(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "1.5")
    with pytest.raises(aot.AotError, match="must be in"):
        aot.gpu_memory_fraction()
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert aot.gpu_memory_fraction() == 0.9


def test_gpu_names_parse():
    assert gpu_targets.parse("v5e:2x2") is None
    target, count = gpu_targets.parse("H200:8")
    assert target.name == "h200" and count == 8
    assert "cuda_compute_capability { major: 9 minor: 0 }" in target.target_config()


def test_odd_head_size_steps_compile_for_h100(tmp_path):
    """head_dim 96 (Phi-3's): the GPU kernels pad it to 128 lanes inside the compiled steps."""
    _needs_cuda_plugin()
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY, hidden_size=384, num_attention_heads=4, head_dim=96)))
    r = aot.run(aot.Request(model=str(tmp_path), topology="h100", mesh=None, max_num_seqs=4, max_num_batched_tokens=32,
                            buckets="probes", decode_batches=(4,), report_seqs=(2,)))
    assert r["memory_per_device"]["pool_pages"] > 0 and len(r["steps"]) == 2


def test_the_pool_stays_within_the_gpu_kernels_32_bit_offsets(config_only_folder, capsys):
    """A small model on an H200 with 8-bit KV fits more pages than one layer's pool can address with 32-bit
    offsets: the report caps the pool as the engine does, and refuses a --num-pages past it. Its bf16 pool is
    limited only by the row index, which it does not reach."""
    _needs_cuda_plugin()
    req = aot.Request(model=str(config_only_folder), topology="h200", mesh=None, kv_cache_dtype="int8")
    t = aot.resolve(req)
    limit = (2**31 - 1) // (TINY["num_key_value_heads"] * req.page_size * TINY["head_dim"])
    assert aot.gpu_pool_limit(t, req) == limit
    assert aot.engine_pool_pages(t, req, used=0.0, capped=False) == limit
    assert aot.main(["--model", str(config_only_folder), "--topology", "h200", "--kv-cache-dtype", "int8",
                     "--num-pages", str(limit + 1)]) == 2
    assert "more than the GPU kernels address" in capsys.readouterr().err
    bf16 = aot.Request(model=str(config_only_folder), topology="h200", mesh=None)
    t = aot.resolve(bf16)
    rows_limit = (2**31 - 1) // (TINY["num_key_value_heads"] * bf16.page_size)
    assert aot.gpu_pool_limit(t, bf16) == rows_limit
    assert aot.engine_pool_pages(t, bf16, used=0.0, capped=False) < rows_limit
