"""gpt-oss: its config, refused configs, expert meshes, the engine's features, and its checkpoint formats (bf16, and
MXFP4 expert weights dequantized at load).

Token-exactness against transformers on one device is in test_models_vs_transformers.py (gpt_oss is in
tiny.FAMILIES), as are speculative decoding (test_spec.py), disaggregation (test_disagg.py), every attention
backend with warm-up and no compiles while serving (test_attention_backends.py) and the tensor, data and
sequence axes (test_sharding.py); the sinks inside each kernel are in test_attention_sinks.py.
"""

import json
import shutil

import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from safetensors.torch import save_file as save_torch
from test_engine import random_workload, run
from transformers import GptOssForCausalLM

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.models import mxfp4
from jaxserve.models.config import ModelConfig
from jaxserve.models.loader import load_model
from sharding.config import MeshConfig

from tiny import FAMILIES, build_tiny_model, hf_greedy, hf_model, train_tokenizer

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    """Two layers: windowed (5) then full, as gpt-oss alternates them."""
    return build_tiny_model("gpt_oss", tmp_path_factory.mktemp("gpt_oss"), tokenizer=train_tokenizer())


@pytest.fixture(scope="module")
def hf(path):
    return hf_model(path)


def test_config_and_parameter_count_match_transformers(path):
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.family, cfg.attn_sinks, cfg.qkv_bias, cfg.o_bias) == ("gpt_oss", True, True, True)
    assert cfg.sliding_windows == (5, None) and cfg.local_window == 5  # the windowed layers' own page pool
    assert (cfg.rope.kind, cfg.rope.truncate, cfg.rope.factor) == ("yarn", False, 4.0)
    m = cfg.moe
    assert (m.num_experts, m.top_k, m.norm_topk_prob, m.activation, m.swiglu_limit) == (4, 2, False, "gpt_oss", 1.5)
    assert m.router_bias and m.softmax_after_topk and m.expert_bias
    config_cls, _, overrides = FAMILIES["gpt_oss"]
    with torch.device("meta"):
        model = GptOssForCausalLM(config_cls(vocab_size=cfg.vocab_size, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, **overrides))
        # num_params leaves out the attention projections' biases, as for every family.
        total = sum(p.numel() for n, p in model.named_parameters() if not (".self_attn." in n and n.endswith("bias")))
    assert cfg.num_params == total


@pytest.mark.parametrize("field, value, message", [
    ("rope_parameters", dict(rope_type="ntk", rope_theta=1e4), r"rope type 'ntk' is not supported"),
    ("layer_types", ["sliding_attention", "chunked_attention"], r"layer_types \['chunked_attention'\] are not"),
    ("swiglu_limit", 0.0, r"swiglu_limit=0.0 must be > 0"),
    ("quantization_config", dict(quant_method="awq"), r"quant_method='awq' is not supported"),
])
def test_bad_configs_are_refused_at_load_naming_the_field(path, tmp_path, field, value, message):
    shutil.copytree(path, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path / "m"), page_size=4, max_num_seqs=2, max_model_len=32, warmup=False,
            compilation_cache_dir=None)


@pytest.mark.parametrize("mesh", ["expert=2,tensor=2"])
def test_expert_and_tensor_mesh_matches_transformers(path, hf, mesh):
    """Experts over `expert`, their width and the attention heads (and sinks) over `tensor`; prompts that cross
    page edges, the window, and several prefill chunks."""
    llm = LLM(str(path), dtype="float32", page_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
              num_pages=64, mesh=mesh, num_devices=MeshConfig.parse(mesh).num_devices, warmup=False,
              debug_checks=True, compilation_cache_dir=None)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, llm.model_config.vocab_size, n).tolist() for n in (1, 7, 19, 40)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


def test_preemption_prefix_caching_and_chunked_prefill_match_transformers(path, hf):
    """A pool small enough to force preemption, shared prefixes (prefix-cache hits in both page pools: the
    windowed layers keep their own), prompts longer than a step's budget."""
    engine = Engine(EngineConfig(model=str(path), page_size=4, num_pages=16, max_model_len=64, max_num_seqs=8,
                                 max_num_batched_tokens=32, debug_checks=True, seed=0, warmup=False,
                                 compilation_cache_dir=None))
    arrivals = random_workload(np.random.default_rng(0), engine.model_config.vocab_size, n=8)
    results = run(engine, arrivals)
    assert engine.scheduler.num_preemptions > 0, "the workload should force preemption"
    assert engine.scheduler.block_manager.prefix_cache_hits > 0, "shared prefixes should hit the prefix cache"
    for wave in arrivals:
        for rid, prompt, params in wave:
            assert results[rid].outputs[0].token_ids == hf_greedy(hf, prompt, params.max_tokens), rid


def test_8_bit_kv_cache_keeps_transformers_tokens(path, hf):
    """int8 KV pages (quantized as written, read by the sinks-aware attention). 8-bit KV is not exact: on these
    prompts its rounding flips no greedy choice (a longer run can, as for every family)."""
    llm = LLM(str(path), dtype="float32", kv_cache_dtype="int8", page_size=4, max_num_seqs=4,
              max_num_batched_tokens=16, max_model_len=64, warmup=False, compilation_cache_dir=None)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, llm.model_config.vocab_size, n).tolist() for n in (3, 11, 22)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


# ---- checkpoints ------------------------------------------------------------------------------------------------
def pack_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A stacked expert weight f32[E, in, out] as MXFP4 (``<name>_blocks`` u8[E, out, in / 32, 16], ``<name>_scales``
    u8[E, out, in / 32]): per block of 32 inputs the power of two that brings its largest value within e2m1's 6,
    each value rounded to the nearest e2m1 code."""
    rows = np.swapaxes(w, 1, 2)  # f32[E, out, in]
    blocks = rows.reshape(*rows.shape[:-1], -1, mxfp4.BLOCK)  # f32[E, out, G, 32]
    amax = np.max(np.abs(blocks), axis=-1)  # f32[E, out, G]
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)
    scaled = blocks / np.ldexp(1.0, exp)[..., None]  # within [-6, 6]
    magnitude = np.argmin(np.abs(np.abs(scaled)[..., None] - mxfp4.FP4_VALUES[:8]), axis=-1)  # codes 0..7
    codes = (magnitude + 8 * (scaled < 0)).astype(np.uint8)  # u8[E, out, G, 32]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # u8[E, out, G, 16]: the low nibble first
    return packed, (exp + 127).astype(np.uint8)


def test_mxfp4_dequantization_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 8, 2, 16), dtype=np.uint8)
    scales = rng.integers(120, 134, (3, 8, 2), dtype=np.uint8)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(mxfp4.dequantize(blocks, scales), want.numpy())  # f32[3, 64, 8]
    with pytest.raises(ValueError, match="do not pair up"):
        mxfp4.dequantize(blocks, scales[..., :1])


def test_mxfp4_and_bf16_checkpoints_load_to_the_same_weights(path, tmp_path):
    """gpt-oss as published: bf16 attention, router and biases, MXFP4 experts (quant_method "mxfp4"). It loads,
    dequantized, to exactly the weights of a bf16 checkpoint holding the dequantized experts; both load in bf16."""
    tensors = load_file(path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    dense, packed = {}, {}
    for name, array in tensors.items():
        if name.endswith((".gate_up_proj", ".down_proj")):
            blocks, scales = pack_mxfp4(array)
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            array = mxfp4.dequantize(blocks, scales)
            assert np.abs(array - tensors[name]).max() > 0  # rounded to 4 bits: the test sees which values load
        dense[name] = packed[name] = array
    for name in [n for n in packed if n.endswith((".gate_up_proj", ".down_proj"))]:
        del packed[name]
    folders = {}
    for kind, weights, extra in (("bf16", dense, {}), ("mxfp4", packed, {"quantization_config": {
            "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}})):
        folder = tmp_path / kind
        shutil.copytree(path, folder)
        save_torch({n: torch.from_numpy(np.ascontiguousarray(a)) if a.dtype == np.uint8
                    else torch.from_numpy(np.ascontiguousarray(a)).bfloat16() for n, a in weights.items()},
                   folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16", **extra}))
        folders[kind] = folder
    a, cfg, _ = load_model(folders["bf16"])
    b, _, _ = load_model(folders["mxfp4"])
    assert cfg.torch_dtype == "bfloat16"
    flat_a, flat_b = (dict(nnx.to_flat_state(nnx.state(m))) for m in (a, b))
    assert flat_a.keys() == flat_b.keys()
    for p, var in flat_a.items():
        assert var.get_value().dtype == np.dtype("bfloat16"), p
        np.testing.assert_array_equal(np.asarray(var.get_value()), np.asarray(flat_b[p].get_value()), err_msg=str(p))
    # The interleaved gate/up columns went to our gate_proj (even) and up_proj (odd).
    gate_up = torch.from_numpy(dense["model.layers.0.mlp.experts.gate_up_proj"]).bfloat16().float().numpy()
    experts = flat_b[("layers", 0, "mlp", "experts", "gate_proj")].get_value()
    np.testing.assert_array_equal(np.asarray(experts, np.float32), gate_up[..., 0::2])


def test_mxfp4_checkpoint_missing_its_scales_is_named(path, tmp_path):
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj"
    blocks, _ = pack_mxfp4(tensors.pop(name))
    tensors[name + "_blocks"] = blocks
    shutil.copytree(path, tmp_path / "m")
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unexpected tensors \['model.layers.1.mlp.experts.down_proj_blocks'\]"):
        load_model(tmp_path / "m", "float32")
