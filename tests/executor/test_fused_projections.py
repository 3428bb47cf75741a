"""One weight for each layer's Q/K/V projections and one for its gate/up (``fuse_projections``, the GPU's
default): the same tokens as separate weights, and the engine's public weight layout (``get_weights``,
``update_weights``, ``graphdef``) unchanged."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.executor.runner import CompileCounter
from tests.tiny import build_tiny_model, hf_model

OPTIONS = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=48, warmup=False,
               compilation_cache_dir=None)
PROMPTS = [[5, 17, 42, 9, 33, 8, 71, 12, 3], [100, 7, 250, 64]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)


def answers(llm):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, [float(r[t].logprob) for r, t in zip(o.outputs[0].logprobs,
                                                                            o.outputs[0].token_ids)]) for o in outs]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    return (build_tiny_model("llama", root / "a", num_hidden_layers=2),
            build_tiny_model("llama", root / "b", num_hidden_layers=2, seed=7))


@pytest.fixture(scope="module")
def fused(model_dirs):
    return LLM(str(model_dirs[0]), fuse_projections="on", **OPTIONS)


def test_fused_weights_give_the_separate_weights_tokens(fused, model_dirs):
    layer = fused.engine.executor.runner.params["layers"][0]
    mlp, attn = layer["mlp"], layer["self_attn"]
    assert "gate_up_proj" in mlp and "gate_proj" not in mlp and "up_proj" not in mlp
    assert "qkv_proj" in attn and not {"q_proj", "k_proj", "v_proj"} & set(attn)
    hidden, _, width = mlp["gate_up_proj"].get_value().shape
    cfg = fused.engine.model_config
    assert attn["qkv_proj"].get_value().shape == (hidden, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads + 2,
                                                  cfg.head_dim)
    separate = LLM(str(model_dirs[0]), fuse_projections="off", **OPTIONS)
    assert "gate_proj" in separate.engine.executor.runner.params["layers"][0]["mlp"]
    for (ids, lps), (sids, slps) in zip(answers(fused), answers(separate)):
        assert ids == sids
        np.testing.assert_allclose(lps, slps, rtol=1e-5, atol=1e-5)
    # The public layout is the separate one, the same arrays.
    got, want = fused.get_weights()["layers"][0]["mlp"], separate.get_weights()["layers"][0]["mlp"]
    assert set(got) == {"gate_proj", "up_proj", "down_proj"}
    for name in ("gate_proj", "up_proj"):
        assert got[name]["weight"].shape == (hidden, width)
        np.testing.assert_array_equal(np.asarray(got[name]["weight"]), np.asarray(want[name]["weight"]))
    got, want = fused.get_weights()["layers"][1]["self_attn"], separate.get_weights()["layers"][1]["self_attn"]
    assert set(got) == set(want)
    for name in ("q_proj", "k_proj", "v_proj"):
        np.testing.assert_array_equal(np.asarray(got[name]["weight"]), np.asarray(want[name]["weight"]))
    # The graphdef is the public layout's: with get_weights' arrays it is the model (a training loop's view).
    from flax import nnx
    nnx.merge(fused.graphdef, fused.get_weights())


def test_new_weights_by_hf_names_and_in_the_public_layout(fused, model_dirs):
    other = LLM(str(model_dirs[1]), fuse_projections="off", **OPTIONS)
    want = answers(other)
    before = answers(fused)
    assert [ids for ids, _ in before] != [ids for ids, _ in want]
    state_dict = {k: v for k, v in hf_model(model_dirs[1]).state_dict().items()}
    fused.update_weights(state_dict)  # compiles the layout's small split and join programs, once per shape
    for (ids, lps), (wids, wlps) in zip(answers(fused), want):
        assert ids == wids
        np.testing.assert_allclose(lps, wlps, rtol=1e-5, atol=1e-5)
    layer = fused.engine.executor.runner.params["layers"][1]
    assert "gate_up_proj" in layer["mlp"] and "qkv_proj" in layer["self_attn"]  # still fused
    public = LLM(str(model_dirs[0]), fuse_projections="off", **OPTIONS).get_weights()
    compiles = CompileCounter()
    fused.update_weights(public)  # the public layout
    assert [ids for ids, _ in answers(fused)] == [ids for ids, _ in before]
    assert compiles.count() == 0, "a second swap must compile nothing, the steps included"


def test_fusing_is_refused_with_lora_and_checked(model_dirs):
    with pytest.raises(ValueError, match="fuse_projections='on' cannot be combined with enable_lora"):
        LLM(str(model_dirs[0]), fuse_projections="on", enable_lora=True, **OPTIONS)
    with pytest.raises(ValueError, match="fuse_projections='sometimes' must be one of 'auto', 'on', 'off'"):
        LLM(str(model_dirs[0]), fuse_projections="sometimes", **OPTIONS)
    # "auto" fuses on a GPU only: separate weights here, on the CPU.
    auto = LLM(str(model_dirs[0]), **OPTIONS)
    assert "gate_proj" in auto.engine.executor.runner.params["layers"][0]["mlp"]
    assert not auto.engine.executor.weights.fused


@pytest.mark.parametrize("mesh", ["tensor=2", "tensor=4"])
def test_fused_weights_split_over_the_tensor_axis(model_dirs, mesh):
    """tensor=2 splits both KV heads and the MLP: the fused weights are sharded as their parts were (each shard
    whole GQA groups, its gate and up columns). tensor=4 replicates the 2 KV heads while the 4 query heads are
    split, so Q/K/V stay separate there and gate/up alone is fused."""
    opts = dict(OPTIONS, mesh=mesh, num_devices=int(mesh.split("=")[1]))
    fused = LLM(str(model_dirs[0]), fuse_projections="on", **opts)
    layer = fused.engine.executor.runner.params["layers"][0]
    assert ("qkv_proj" in layer["self_attn"]) == (mesh == "tensor=2")
    gate_up = layer["mlp"]["gate_up_proj"].get_value()
    assert gate_up.sharding.spec[2] == "tensor" and gate_up.sharding.spec[1] is None
    separate = LLM(str(model_dirs[0]), fuse_projections="off", **opts)
    for (ids, lps), (sids, slps) in zip(answers(fused), answers(separate)):
        assert ids == sids
        np.testing.assert_allclose(lps, slps, rtol=1e-5, atol=1e-5)
    got = fused.get_weights()["layers"][0]
    want = separate.get_weights()["layers"][0]
    for group, name in (("mlp", "gate_proj"), ("mlp", "up_proj"), ("self_attn", "k_proj")):
        assert got[group][name]["weight"].sharding == want[group][name]["weight"].sharding
        np.testing.assert_array_equal(np.asarray(got[group][name]["weight"]), np.asarray(want[group][name]["weight"]))
