"""One KV pool sizing rule (``jaxserve.executor.kv_cache.pool_pages``): the engine, ``capacity``, ``aot`` and
``plan`` count the same pages for the same model and memory budget; one ``kv_cache_dtype`` rule; one chip table;
the tools' ``--help``."""

import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from jaxserve.config.engine import EngineConfig
from jaxserve.executor.executor import Executor
from jaxserve.executor.kv_cache import bytes_per_token, kv_storage_dtype, local_pool_pages, pool_pages
from jaxserve.models.config import ModelConfig
from jaxserve.tools import aot
from jaxserve.tools.capacity import capacity, weights_per_device
from jaxserve.tools.chips import CHIPS, DEVICE_KINDS
from jaxserve.tools.plan import cli, simulator, step_model
from sharding.config import MeshConfig

from test_aot import _needs_libtpu
from tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
PAGE, MAX_LEN, SEQS, TOKENS = 4, 64, 16, 32  # the engine's options every count below is taken at


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def model(request, tmp_path_factory):
    """(folder, config, KV budget in bytes): a budget of about 100 pages of every layer, not a page multiple."""
    folder = build_tiny_model(request.param, tmp_path_factory.mktemp("sizing") / request.param)
    cfg = ModelConfig.from_pretrained(folder)
    return folder, cfg, 100 * PAGE * bytes_per_token(cfg, jnp.float32) + 1000


def _engine_pages(folder, budget: float) -> int:
    config = EngineConfig(model=str(folder), dtype="float32", page_size=PAGE, max_model_len=MAX_LEN,
                          max_num_seqs=SEQS, max_num_batched_tokens=TOKENS, cpu_kv_cache_gib=budget / 2**30,
                          warmup=False, compilation_cache_dir=None)
    executor = Executor(config, model_path=str(folder))
    assert jnp.dtype(executor.cache_dtype) == jnp.float32  # the pool every count below prices
    return executor.cache_config.pages_per_replica


def test_engine_capacity_aot_and_plan_count_the_same_pages(model):
    folder, cfg, budget = model
    engine = _engine_pages(folder, budget)
    assert 0 < engine < SEQS * MAX_LEN // PAGE  # what fits, not the max_num_seqs cap
    per_token = bytes_per_token(cfg, jnp.float32)
    weights = weights_per_device(cfg, "float32", MeshConfig.parse(None))
    # capacity: a device of exactly the weights plus the budget, all of it usable.
    cap = capacity(cfg, hbm_gb=(budget + weights) / 2**30, dtype="float32", page_size=PAGE,
                   mesh=MeshConfig.parse(None), utilization=1.0, max_model_len=MAX_LEN, max_num_seqs=SEQS,
                   max_num_batched_tokens=TOKENS)
    assert cap["pages_per_replica"] == engine
    assert cap["window_pages_per_replica"] == local_pool_pages(cfg.sliding_windows, PAGE, SEQS, TOKENS)
    # plan: its simulated engine's pool (from the budget), and an instance's pool on chips (from their HBM).
    fields = simulator.window_fields(cfg.sliding_windows, page_size=PAGE, max_num_seqs=SEQS,
                                     max_num_batched_tokens=TOKENS)
    assert simulator.pool_pages(budget, per_token, PAGE, fields) == engine
    assert cli.instance_pool_pages(cfg, budget + weights, chips=1, utilization=1.0, page_size=PAGE,
                                    max_model_len=MAX_LEN, max_num_seqs=SEQS, max_num_batched_tokens=TOKENS,
                                    dtype="float32") == engine
    if cfg.local_window is not None:  # two pools: more global pages than pricing each page at every layer's KV
        assert engine > budget // (per_token * PAGE)
    # aot: the engine's pool on a described v5e chip holding the weights, with the budget left.
    _needs_libtpu()
    req = aot.Request(model=str(folder), topology="v5e:2x2", mesh=None, dtype="float32", page_size=PAGE,
                      max_num_seqs=SEQS, max_num_batched_tokens=TOKENS, max_model_len=MAX_LEN, hbm_utilization=1.0)
    target = aot.resolve(req)
    assert aot.engine_pool_pages(target, req, used=target.hbm - budget) == engine


def test_the_pool_rule():
    """What the one rule computes: memory at utilization less what is used, in pages; the windowed pool first."""
    assert pool_pages(1000, 10, 4, utilization=0.5, used=100) == (1000 * 0.5 - 100) // 40
    assert pool_pages(1000, 10, 4, max_pages=3) == 3
    assert pool_pages(1000, 10, 4, extra_bytes_per_token=15) == 1000 // 100  # a draft's pool in step
    # Two windowed layers of three: 5 windowed pages cost 5 * 40 * 2/3; a global page costs 40 / 3.
    assert pool_pages(1000, 10, 4, windows=(8, 8, None), local_pages=5) == int((1000 - 5 * 40 * 2 / 3) // (40 / 3))
    assert local_pool_pages((8, 8, None), 4, 2, 16) > 0 == local_pool_pages((8, 8), 4, 2, 16) == \
        local_pool_pages((None, None), 4, 2, 16)


def test_one_kv_cache_dtype_rule():
    assert kv_storage_dtype("auto", jnp.bfloat16) is jnp.bfloat16
    assert kv_storage_dtype("int8", jnp.bfloat16) == jnp.int8
    assert kv_storage_dtype("fp8", jnp.float32) == kv_storage_dtype("fp8_e4m3", jnp.float32) == jnp.float8_e4m3fn
    assert kv_storage_dtype("fp8_e5m2", jnp.float32) == jnp.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'"):
        kv_storage_dtype("int4", jnp.float32)


def test_one_chip_table_with_the_published_figures():
    """aot (by device kind) and plan (by name) read one table; v6e moves 1640 GB/s (aot had 1638)."""
    assert DEVICE_KINDS["TPU v6 lite"] is CHIPS["v6e"]
    v6e = CHIPS["v6e"]
    assert (v6e.peak_flops, v6e.hbm_bytes_per_s, v6e.hbm_bytes) == (918e12, 1640e9, 32 * 2**30)
    assert aot.chip_of([type("D", (), {"device_kind": "TPU v6 lite"})()], "v6e:1x1") == (v6e, 1)
    m = step_model.roofline_from_config(aot.model_config("llama-3.2-1b"), chip="v6e", chips=1)
    assert (m.peak_flops, m.peak_bytes_per_s) == (918e12, 1640e9)


@pytest.mark.parametrize("module,listed", [
    ("jaxserve.plan", ["calibrate", "simulate"]),
    ("jaxserve.aot", ["--topology", "--sample-layers"]),
    ("jaxserve.capacity", ["--hbm-gb", "--kv-cache-dtype"]),
])
def test_help_exits_0_and_lists_what_the_tool_takes(module, listed):
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: python -m {module} ")
    lines = done.stdout.splitlines()
    for name in listed:
        assert any(line.strip().startswith(name) for line in lines), name
    if module == "jaxserve.plan":  # each command on a line of its own, with what it does
        for name, text in cli.COMMANDS.items():
            assert f"  {name}" in done.stdout and text in done.stdout


def test_plan_without_a_command_is_an_error_that_lists_the_commands(capsys):
    assert cli.main([]) == 2 and cli.main(["bogus"]) == 2
    err = capsys.readouterr().err
    assert "calibrate" in err and "simulate" in err and "unknown command 'bogus'" in err


def test_plan_sizes_an_instance_at_the_configured_utilization(tmp_path, capsys):
    """With --chip, the pool is what --hbm-utilization (the engine's 0.9 by default) of the HBM holds after the
    weights, by the engine's rule: capacity's count for the same chips."""
    cfg = aot.model_config("llama-3.1-8b")
    for util in (None, 0.5):
        argv = ["simulate", "--model", "llama-3.1-8b", "--chip", "v6e", "--rates", "1", "--num-requests", "2",
                "--no-search", "--json"] + ([] if util is None else ["--hbm-utilization", str(util)])
        assert cli.main(argv) == 0
        report = json.loads(capsys.readouterr().out)
        expected = capacity(cfg, hbm_gb=32, dtype="bfloat16", page_size=16, mesh=MeshConfig.parse(None),
                            utilization=util or EngineConfig.hbm_utilization, max_model_len=4096, max_num_seqs=256,
                            max_num_batched_tokens=2048)
        assert report["engine"]["num_pages"] == expected["pages_per_replica"] > 0


def test_gpu_pool_limit_caps_an_automatic_pool_and_refuses_an_asked_for_one(caplog):
    """The GPU kernels address an 8-bit layer pool on a device with 32-bit offsets: under 2**31 elements."""
    from jaxserve.executor.kv_cache import limit_gpu_pool

    pools = [("model", 8, 128, 1), ("draft model", 2, 64, 1)]  # 16384 and 2048 elements per page of 16 tokens
    cap = (2**31 - 1) // (8 * 16 * 128)
    assert limit_gpu_pool(cap, 16, pools, automatic=False) == cap  # the largest pool that fits, untouched
    assert limit_gpu_pool(1000, 16, pools, automatic=True) == 1000
    with caplog.at_level("WARNING", logger="jaxserve.executor.kv_cache"):
        assert limit_gpu_pool(10 * cap, 16, pools, automatic=True) == cap
    assert f"at {cap} pages per replica (from {10 * cap})" in caplog.text
    with pytest.raises(ValueError, match=rf"model: a KV pool of num_pages={cap + 1} x page_size=16 x 8 KV heads "
                                         rf"x head_dim=128 = {2**31} elements.*limit {2**31 - 1}.*{cap} per data "
                                         "replica"):
        limit_gpu_pool(cap + 1, 16, pools, automatic=False)
    # The draft's pool is paged in step: its own limit counts too.
    draft_cap = (2**31 - 1) // (2 * 16 * 64)
    assert limit_gpu_pool(cap, 16, [("draft model", 2, 64, 1)], automatic=False) == cap
    with pytest.raises(ValueError, match="draft model: .* 2 KV heads"):
        limit_gpu_pool(draft_cap + 1, 16, [("draft model", 2, 64, 1)], automatic=False)


def test_gpu_pool_limit_of_a_bf16_pool_is_its_rows():
    """A pool of 2-byte elements past 4 GiB gets 64-bit offsets: only its int32 row index limits it, at
    2**31 rows (head_dim times the 8-bit pool's pages)."""
    from jaxserve.executor.kv_cache import limit_gpu_pool

    eight_bit = (2**31 - 1) // (8 * 16 * 128)
    cap = (2**31 - 1) // (8 * 16)
    assert cap >= 128 * eight_bit
    assert limit_gpu_pool(cap, 16, [("model", 8, 128, 2)], automatic=False) == cap
    assert limit_gpu_pool(10 * cap, 16, [("model", 8, 128, 2)], automatic=True) == cap
    with pytest.raises(ValueError, match=rf"num_pages={cap + 1} x page_size=16 x 8 KV heads = {8 * 16 * (cap + 1)} "
                                         rf"rows.*limit {2**31 - 1} rows.*{cap} per data replica"):
        limit_gpu_pool(cap + 1, 16, [("model", 8, 128, 2)], automatic=False)


def test_engine_refuses_a_gpu_pool_past_32_bit_offsets(tmp_path, monkeypatch):
    """At start-up, before anything is allocated, with the GPU kernels selected (interpreted on a CPU)."""
    import jaxserve.executor.builder as builder

    def no_allocation(*args, **kwargs):
        raise AssertionError("the pool was allocated")

    monkeypatch.setattr(builder, "ModelRunner", no_allocation)  # the 512 GiB pool, were it not refused
    folder = build_tiny_model("llama", tmp_path / "llama")  # 2 KV heads of head_dim 16
    pages = 2**31 // (2 * 16)  # 2**31 rows of 4-byte elements
    config = EngineConfig(model=str(folder), dtype="float32", page_size=16, num_pages=pages, max_model_len=64,
                          max_num_seqs=4, max_num_batched_tokens=32, attention_backend="pallas_gpu", warmup=False,
                          compilation_cache_dir=None)
    with pytest.raises(ValueError, match=rf"num_pages={pages} x page_size=16 x 2 KV heads = {2**31} rows"):
        Executor(config, model_path=str(folder))
