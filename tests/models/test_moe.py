"""Mixture of Experts: the grouped-matmul block against its dense reference, configs and parameter counts against
transformers, checkpoint layouts, expert-parallel meshes on 8 emulated CPU devices, and the engine's features
(preemption, prefix caching, chunked prefill) on an MoE family.

Token-exactness of each family against transformers on one device is in test_models_vs_transformers.py (the
MoE families are in tiny.FAMILIES); every attention backend in test_attention_backends.py.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file
from test_engine import random_workload, run

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.models import moe
from jaxserve.models.config import ModelConfig
from jaxserve.models.loader import load_model
from jaxserve.models.moe_config import MoeConfig
from sharding.config import MeshConfig

from tiny import FAMILIES, MOE_FAMILIES, build_tiny_model, hf_greedy, hf_model, train_tokenizer

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPT_LENS = [1, 7, 19, 40]  # page size 4: page edges; 19 and 40 > max_num_batched_tokens = 16 (chunked)


# ---- the block --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_grouped_experts_match_the_dense_reference_and_shards_sum_to_the_whole(norm_topk_prob):
    rng = np.random.default_rng(0)
    t, h, i, e, k = 13, 16, 24, 6, 3
    cfg = MoeConfig(num_experts=e, top_k=k, intermediate_size=i, norm_topk_prob=norm_topk_prob,
                    sparse_layers=(True,))
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape) * 0.5, jnp.float32)  # noqa: E731
    x, router, gate, up, down = arr(t, h), arr(h, e), arr(e, h, i), arr(e, h, i), arr(e, i, h)
    weights, experts = moe.route(x, router, cfg)
    assert experts.shape == (t, k) and len({tuple(sorted(r)) for r in np.asarray(experts).tolist()}) > 1
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6) if norm_topk_prob else None
    whole = moe.experts_local(x, weights, experts, gate, up, down, 0, e)
    want = moe.dense_reference(x, router, gate, up, down, cfg)
    np.testing.assert_allclose(np.asarray(whole), np.asarray(want), rtol=1e-5, atol=1e-5)
    # What each `expert` shard computes (its own experts only) sums to the whole: the expert-parallel combine.
    for shards in (2, 3, 6):
        n = e // shards
        parts = [moe.experts_local(x, weights, experts, gate[s * n:(s + 1) * n], up[s * n:(s + 1) * n],
                                   down[s * n:(s + 1) * n], s * n, e) for s in range(shards)]
        np.testing.assert_allclose(np.asarray(sum(parts)), np.asarray(whole), rtol=1e-5, atol=1e-5)


def test_group_by_expert_sorts_pairs_stably():
    experts = jnp.asarray([[2, 0], [0, 1], [2, 1]], jnp.int32)
    order, sizes = moe.group_by_expert(experts, 4)
    assert order.tolist() == [1, 2, 3, 5, 0, 4] and sizes.tolist() == [2, 2, 2, 0]


# ---- configs and parameter counts ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_config_and_parameter_counts_match_transformers(family):
    config_cls, model_cls, overrides = FAMILIES[family]
    hf_cfg = config_cls(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, **overrides)
    cfg = ModelConfig.from_hf_dict({**hf_cfg.to_dict(), "architectures": [model_cls.__name__]})
    with torch.device("meta"):
        # num_params leaves out biases (Qwen2-MoE's q/k/v), as for the dense families.
        total = sum(p.numel() for n, p in model_cls(hf_cfg).named_parameters() if not n.endswith("bias"))
    assert cfg.num_params == total
    m = cfg.moe
    assert (m.num_experts, m.top_k) == {"mixtral": (4, 2), "qwen2_moe": (4, 2), "qwen3_moe": (8, 3)}[family]
    assert m.norm_topk_prob == (family != "qwen2_moe")
    assert m.sparse_layers == ((True, False) if family == "qwen3_moe" else (True, True))
    assert (m.shared_expert_size > 0) == (family == "qwen2_moe")
    expert = 3 * 64 * m.intermediate_size
    assert cfg.num_params - cfg.num_active_params == sum(m.sparse_layers) * (m.num_experts - m.top_k) * expert


def test_decoder_sparse_step_and_mlp_only_layers():
    base = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=2,
                mlp_only_layers=[3])
    assert MoeConfig.from_hf_dict(base, "qwen3_moe", 6).sparse_layers == (False, True, False, False, False, True)
    with pytest.raises(ValueError, match="num_experts_per_tok=9 exceeds num_experts=8"):
        MoeConfig.from_hf_dict({**base, "num_experts_per_tok": 9}, "qwen3_moe", 6)
    # A Qwen1.5-MoE config.json as published: no qkv_bias key (the biases are there), no layer_types.
    hub = dict(architectures=["Qwen2MoeForCausalLM"], hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
               num_attention_heads=16, num_key_value_heads=16, vocab_size=151936, num_experts=60,
               num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
               norm_topk_prob=False, decoder_sparse_step=1, sliding_window=32768, use_sliding_window=False)
    cfg = ModelConfig.from_hf_dict(hub)
    assert cfg.qkv_bias and not cfg.o_bias and cfg.sliding_windows == (None,) * 24
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.shared_expert_size) == (60, 4, 5632)
    assert cfg.num_params / 1e9 == pytest.approx(14.32, abs=0.01)
    assert cfg.num_active_params / 1e9 == pytest.approx(2.69, abs=0.01)


# ---- checkpoints ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    tokenizer = train_tokenizer()
    return {f: build_tiny_model(f, tmp_path_factory.mktemp(f), tokenizer=tokenizer) for f in MOE_FAMILIES}


def test_fused_expert_layout_loads_the_same_weights(paths, tmp_path):
    """transformers >= 5 keeps experts stacked (gate_up_proj [E, 2I, H], down_proj [E, H, I]); a checkpoint
    saved in that layout loads to the same parameters as the per-expert one."""
    src = paths["qwen3_moe"]
    tensors = load_file(src / "model.safetensors")
    fused = {}
    for name, array in tensors.items():
        if ".mlp.experts." not in name:
            fused[name] = array
        elif name.endswith(".0.gate_proj.weight"):
            prefix = name[: -len(".0.gate_proj.weight")]
            e = sum(1 for n in tensors if n.startswith(prefix) and n.endswith(".gate_proj.weight"))
            get = lambda proj: np.stack([tensors[f"{prefix}.{j}.{proj}.weight"] for j in range(e)])  # noqa: E731
            fused[f"{prefix}.gate_up_proj"] = np.concatenate([get("gate_proj"), get("up_proj")], axis=1)
            fused[f"{prefix}.down_proj"] = get("down_proj")
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(fused, tmp_path / "model.safetensors")
    a, _, _ = load_model(src, "float32")
    b, _, _ = load_model(tmp_path, "float32")
    flat_a, flat_b = (dict(nnx.to_flat_state(nnx.state(m))) for m in (a, b))
    assert ("layers", 0, "mlp", "experts", "gate_proj") in flat_a and flat_a.keys() == flat_b.keys()
    for path, var in flat_a.items():
        np.testing.assert_array_equal(np.asarray(var.get_value()), np.asarray(flat_b[path].get_value()),
                                      err_msg=str(path))


def test_missing_expert_is_named(paths, tmp_path):
    src = paths["mixtral"]
    tensors = {n: a for n, a in load_file(src / "model.safetensors").items() if ".experts.3.w2." not in n}
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.0.mlp.experts.down_proj'"):
        load_model(tmp_path, "float32")


# ---- expert parallelism -------------------------------------------------------------------------------------------
def make_llm(path, mesh: str | None, **kw) -> LLM:
    return LLM(str(path), dtype="float32", page_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
               num_pages=64, mesh=mesh, num_devices=None if mesh is None else MeshConfig.parse(mesh).num_devices,
               warmup=False, debug_checks=True, compilation_cache_dir=None, **kw)


@pytest.mark.parametrize("family, mesh", [
    ("mixtral", "expert=4,tensor=2"),  # the expert axis with tensor-split experts (and attention heads)
    ("qwen3_moe", "data=2,expert=4"),  # data replicas, each with experts spread over 4 devices; a dense layer
    ("qwen2_moe", "expert=2,sequence=2,tensor=2"),  # sequence-split prefill rows; the shared expert over tensor
])
def test_expert_meshes_match_one_device(paths, family, mesh):
    """Greedy tokens on the mesh equal transformers' (which the one-device engine equals, see
    test_models_vs_transformers.py), for prompts that cross page edges and span several prefill chunks."""
    llm = make_llm(paths[family], mesh)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, llm.model_config.vocab_size, n).tolist() for n in PROMPT_LENS]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    hf = hf_model(paths[family])
    assert got == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    for replica in llm.engine.scheduler.replicas:
        replica.block_manager.check_invariants()
        assert replica.block_manager.num_free_pages == replica.block_manager.num_pages


def spec_of(array) -> P:
    spec = tuple(array.sharding.spec)
    return P(*spec, *([None] * (array.ndim - len(spec))))


def test_experts_are_placed_across_devices(paths):
    """expert=4, tensor=2 on 4 experts: each device holds one whole expert, half its hidden width; the router
    and attention are as without the axis (replicated over it)."""
    llm = make_llm(paths["mixtral"], "data=1,expert=4,tensor=2")
    layer = llm.engine.executor.runner.params["layers"][0]
    gate = layer["mlp"]["experts"]["gate_proj"].get_value()
    down = layer["mlp"]["experts"]["down_proj"].get_value()
    assert gate.shape == (4, 64, 128) and spec_of(gate) == P("expert", None, "tensor")
    assert spec_of(down) == P("expert", "tensor", None)
    assert {s.data.shape for s in gate.addressable_shards} == {(1, 64, 64)}
    assert len({(s.index[0].start, s.index[2].start) for s in gate.addressable_shards}) == 8  # no copies
    assert spec_of(layer["mlp"]["gate"]["weight"].get_value()) == P(None, None)
    assert spec_of(layer["self_attn"]["q_proj"]["weight"].get_value()) == P(None, "tensor")


@pytest.mark.parametrize("family, mesh, message", [
    ("mixtral", "expert=8", r"expert=8 does not divide num_experts=4"),
    ("llama", "expert=2", r"expert=2 needs a Mixture-of-Experts model"),
])
def test_expert_meshes_a_model_cannot_use(paths, tmp_path, family, mesh, message):
    path = paths.get(family) or build_tiny_model(family, tmp_path / family, num_hidden_layers=1)
    with pytest.raises(ValueError, match=message):
        make_llm(path, mesh)


# ---- the engine's features on an MoE family ----------------------------------------------------------------------
def test_preemption_prefix_caching_and_chunked_prefill_match_transformers(paths):
    """A pool small enough to force preemption, shared prompt prefixes (prefix-cache hits) and prompts longer
    than a step's budget (chunked prefill): every request's greedy tokens equal transformers'."""
    engine = Engine(EngineConfig(model=str(paths["qwen2_moe"]), page_size=4, num_pages=24, max_model_len=64,
                                 max_num_seqs=8, max_num_batched_tokens=32, debug_checks=True, seed=0,
                                 warmup=False, compilation_cache_dir=None))
    arrivals = random_workload(np.random.default_rng(0), engine.model_config.vocab_size)
    results = run(engine, arrivals)
    assert engine.scheduler.num_preemptions > 0, "the workload should force preemption"
    assert engine.scheduler.block_manager.prefix_cache_hits > 0, "shared prefixes should hit the prefix cache"
    hf = hf_model(paths["qwen2_moe"])
    for wave in arrivals:
        for rid, prompt, params in wave:
            assert results[rid].outputs[0].token_ids == hf_greedy(hf, prompt, params.max_tokens), rid
