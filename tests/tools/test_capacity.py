"""python -m jaxserve.capacity: pages, sequences and context that fit, by the same sizes the engine allocates."""

import pytest

from jaxserve.tools.capacity import capacity, main
from jaxserve.models.config import ModelConfig
from jaxserve.executor.kv_cache import bytes_per_token
from sharding.config import MeshConfig
from tiny import build_tiny_model

pytestmark = pytest.mark.quick


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    # 4 q heads, 2 KV heads, head_dim 16, 2 layers
    return build_tiny_model("llama", tmp_path_factory.mktemp("cap") / "m")


def test_capacity_matches_the_kv_formula_and_the_tensor_split(llama):
    cfg = ModelConfig.from_pretrained(llama)
    kw = dict(hbm_gb=0.01, dtype="bfloat16", page_size=16, utilization=0.9, max_model_len=128)
    one = capacity(cfg, mesh=MeshConfig.parse(None), **kw)
    assert one["kv_bytes_per_token"] == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    budget = 0.01 * 2**30 * 0.9 - cfg.num_params * 2
    assert one["pages_per_replica"] == int(budget // (one["kv_bytes_per_token"] * 16))
    assert one["full_length_sequences"] == one["tokens_of_context"] // 128
    # tensor=4 over 2 KV heads: each shard holds one (replicated) head, as the engine's pool does.
    four = capacity(cfg, mesh=MeshConfig.parse("tensor=4"), **kw)
    assert four["kv_bytes_per_token_per_device"] == bytes_per_token(cfg, "bfloat16", 4) == \
        one["kv_bytes_per_token"] // cfg.num_kv_heads
    # data=2: each replica holds its own pages, the context adds up.
    two = capacity(cfg, mesh=MeshConfig.parse("data=2"), **kw)
    assert two["tokens_of_context"] == 2 * one["tokens_of_context"]


def test_capacity_refuses_what_the_engine_refuses(llama):
    cfg = ModelConfig.from_pretrained(llama)
    with pytest.raises(ValueError, match="tensor=3"):
        capacity(cfg, hbm_gb=1, dtype="float32", page_size=16, mesh=MeshConfig.parse("tensor=3"), utilization=0.9,
                 max_model_len=128)
    with pytest.raises(ValueError, match="do not fit"):
        capacity(cfg, hbm_gb=1e-6, dtype="float32", page_size=16, mesh=MeshConfig.parse(None), utilization=0.9,
                 max_model_len=128)


def test_capacity_command_prints_the_figures(llama, capsys):
    main(["--model", str(llama), "--hbm-gb", "0.01", "--max-model-len", "128"])
    out = capsys.readouterr().out
    assert "KV bytes per token" in out and "KV pages per replica" in out and "sequences at 128 tokens" in out


def test_mixture_of_experts_total_and_active_params_and_the_expert_split(tmp_path, capsys):
    path = build_tiny_model("mixtral", tmp_path / "moe")  # 4 experts, top-2, 2 layers, hidden 64, width 128
    cfg = ModelConfig.from_pretrained(path)
    kw = dict(hbm_gb=0.01, dtype="bfloat16", page_size=16, utilization=0.9, max_model_len=128)
    one = capacity(cfg, mesh=MeshConfig.parse(None), **kw)
    routed = 2 * 4 * 3 * 64 * 128
    assert one["total_params"] - one["active_params"] == routed // 2  # 2 of 4 experts unread per token
    four = capacity(cfg, mesh=MeshConfig.parse("expert=4"), **kw)
    assert four["weights_gib_per_device"] * 2**30 == pytest.approx((cfg.num_params - routed * 3 / 4) * 2)
    with pytest.raises(ValueError, match="expert=8 does not divide num_experts=4"):
        capacity(cfg, mesh=MeshConfig.parse("expert=8"), **kw)
    main(["--model", str(path), "--hbm-gb", "0.01", "--mesh", "expert=2,tensor=2"])
    assert "active per token (2 of 4 experts)" in capsys.readouterr().out


def test_the_weights_dtype_is_the_engines_auto_the_checkpoints(tmp_path, capsys):
    """``--dtype auto`` (the default, as serve's) of a float32 checkpoint sizes float32 weights: what
    ``serve --dtype auto`` loads (``weights_dtype_name``, the engine's rule), not bfloat16's half."""
    import json

    from jaxserve.models.loader import weights_dtype_name

    path = build_tiny_model("llama", tmp_path / "f32")
    config = json.loads((path / "config.json").read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_pretrained(path)
    assert weights_dtype_name("auto", cfg) == "float32"
    kw = dict(hbm_gb=0.01, page_size=16, mesh=MeshConfig.parse(None), utilization=0.9, max_model_len=128)
    auto = capacity(cfg, dtype="auto", **kw)
    assert auto["dtype"] == "float32" and auto["weights_gib_per_device"] * 2**30 == cfg.num_params * 4
    assert capacity(cfg, dtype="bfloat16", **kw)["weights_gib_per_device"] * 2**30 == cfg.num_params * 2
    main(["--model", str(path), "--hbm-gb", "0.01", "--max-model-len", "128"])
    assert "dtype auto (float32), weights float32," in capsys.readouterr().out
    main(["--model", str(path), "--hbm-gb", "0.01", "--max-model-len", "128", "--dtype", "half"])
    assert "dtype float16, weights float16," in capsys.readouterr().out
    config["torch_dtype"] = "float8_e4m3fn"  # a dtype the engine cannot load: refused by the same rule
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        capacity(ModelConfig.from_pretrained(path), dtype="auto", **kw)
