"""Quantization: 8-bit weights (quantized at load, or pre-quantized checkpoints as published) and the 8-bit KV
cache, against the unquantized model and against one device."""

import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxserve.models import quantization as quant
from jaxserve.models.config import ModelConfig
from jaxserve.config.engine import EngineConfig
from jaxserve.models.loader import load_model
from tiny import FAMILIES, build_tiny_model, train_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from quant_quality import TEXT, compare, evaluate, held_out_markov, teacher_forced_logits, text_workload  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    tok = train_tokenizer()
    families = ("qwen3", "qwen3_moe", "gemma2", "qwen2_moe", "llama_tied_headdim", "qwen2", "llama_mha_bias", "gemma3")
    return {f: build_tiny_model(f, root / f, tokenizer=tok, init_std=0.08) for f in families}


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantize_is_per_output_channel_and_rounds_to_nearest(kind):
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.08, size=(64, 24)).astype(np.float32)  # [in, out]
    w[:, 3] *= 50.0  # one loud output channel must not coarsen the others
    q, scale = quant.quantize(w, kind)
    assert q.dtype == quant.WEIGHT_DTYPES[kind] and scale.shape == (24,)
    np.testing.assert_allclose(scale, np.abs(w).max(0) / quant.QMAX[kind], rtol=1e-6)
    err = np.abs(quant.dequantize_host(q, scale) - w)
    if kind == "int8":
        assert np.all(err <= scale / 2 + 1e-7)  # round to nearest
    else:
        assert np.all(err <= np.abs(w) * 2.0 ** -4 + scale * 2.0 ** -9)  # e4m3: 3 mantissa bits, nearest
    assert err[:, 0].max() < err[:, 3].max() / 10


def _nearest_even(x: np.ndarray, dtype) -> np.ndarray:
    """Round-to-nearest-even of ``x`` onto ``dtype``'s finite values, computed exactly in float64."""
    codes = np.arange(256, dtype=np.uint8)
    vals = codes.view(dtype).astype(np.float64)
    keep = np.isfinite(vals) & ~((vals == 0) & (codes != 0))  # one zero (code 0: even)
    order = np.argsort(vals[keep])
    vals, codes = vals[keep][order], codes[keep][order]
    i = np.clip(np.searchsorted(vals, x), 1, len(vals) - 1)
    lo, hi = vals[i - 1], vals[i]
    tie_lo = np.where(codes[i - 1] % 2 == 0, lo, hi)
    return np.where(x - lo < hi - x, lo, np.where(x - lo > hi - x, hi, tie_lo))


@pytest.mark.parametrize("storage", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_rounds_to_nearest_even_directly_from_f32(storage):
    """The KV write (XLA's cast) and the weight quantizer (ml_dtypes) round x / scale once, to the nearest fp8
    value, ties to even: no detour through float16 or bfloat16, which would round twice."""
    import jax.numpy as jnp

    from pallas_kernels import quantized_pages as qp

    dtype = np.dtype(qp.STORAGE[storage])
    grid = np.unique(np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64))
    grid = grid[np.isfinite(grid) & (grid >= 0)]
    mid = (grid[1:] + grid[:-1]) / 2  # exact midpoints, and points a hair either side of them
    y = np.concatenate([mid, mid * (1 + 2.0 ** -20), mid * (1 - 2.0 ** -20)])
    y = np.concatenate([y, -y]).astype(np.float32)
    top = float(qp.qmax(dtype))
    rows = np.concatenate([y, np.full(-len(y) % 63, 0.0, np.float32)]).reshape(-1, 63)
    rows = np.concatenate([rows, np.full((len(rows), 1), top, np.float32)], axis=1)  # each row's max: scale 1
    want = _nearest_even(rows.astype(np.float64), dtype)
    values, scales = qp.quantize(jnp.asarray(rows), dtype)
    np.testing.assert_array_equal(np.asarray(scales), 1.0)
    np.testing.assert_array_equal(np.asarray(values).astype(np.float64), want)
    assert np.any(rows.astype(np.float16).astype(dtype).astype(np.float64) != want)  # the trap is in the data
    if storage == "fp8_e4m3":  # weights at load: [in, out], per output channel
        q, scale = quant.quantize(rows.T, "fp8")
        np.testing.assert_array_equal(scale, 1.0)
        np.testing.assert_array_equal(q.astype(np.float64), want.T)


def test_config_and_flags_refuse_bad_combinations():
    with pytest.raises(ValueError, match="quantization='int4'"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp16'"):
        EngineConfig(kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="quantize_lm_head"):
        EngineConfig(quantize_lm_head=True)
    with pytest.raises(ValueError, match="dtype='float16'"):
        EngineConfig(quantization="int8", dtype="float16")
    import argparse

    from jaxserve.models.attention import AttentionBackend
    from jaxserve.config.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = engine_config_from_args(parser.parse_args(["--quantization", "int8", "--quantize-lm-head",
                                                     "--kv-cache-dtype", "fp8"]))
    assert (cfg.quantization, cfg.quantize_lm_head, cfg.kv_cache_dtype) == ("int8", True, "fp8")
    assert AttentionBackend("reference").supports_kv_cache_dtype("int8")
    assert AttentionBackend("pallas_tpu").supports_kv_cache_dtype("fp8")
    assert AttentionBackend("pallas_gpu").supports_kv_cache_dtype("int8")


def test_weights_and_scales_are_sharded_alike_and_the_mesh_matches_one_device(models):
    path = models["qwen3_moe"]
    model, _, _ = load_model(path, "float32", quantization="int8")
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    scaled = [p for p in flat if p[-1].endswith("_scale")]
    assert any("experts" in p for p in scaled) and any("q_proj" in p for p in scaled)
    assert flat[("embed_tokens", "embedding")].get_value().dtype == np.float32  # not without quantize_lm_head
    for p in scaled:
        w = flat[p[:-1] + (p[-1][:-len("_scale")],)].get_value()
        assert w.dtype == np.int8
    from jaxserve.llm import LLM  # noqa: F401  (the engine path is covered below)

    tokens = np.random.default_rng(1).integers(3, 300, size=(1, 32), dtype=np.int32)
    one = teacher_forced_logits(str(path), tokens, quantization="int8", kv_cache_dtype="int8")
    mesh = teacher_forced_logits(str(path), tokens, quantization="int8", kv_cache_dtype="int8",
                                 mesh="expert=2,tensor=2")
    # int8 weights meet int8 activation rows on CPU (layers.int8_rows_matmul): a last-bit difference in a float sum
    # (a sharded step's smaller matmuls take other kernels on some CPUs, e.g. AVX2 without AVX-512) can move a row's
    # rounding by one step, ~1e-4 of its scale, and layers carry that to ~1e-3; a sharding error would be O(1).
    np.testing.assert_allclose(mesh, one, atol=2e-3, rtol=1e-3)
    sharded, _, _ = load_model(path, "float32", make_mesh_for("expert=2,tensor=2"), quantization="int8")
    sflat = dict(nnx.to_flat_state(nnx.state(sharded)))
    for p in scaled:
        wspec = sflat[p[:-1] + (p[-1][:-len("_scale")],)].get_value().sharding.spec
        sspec = sflat[p].get_value().sharding.spec
        assert tuple(sspec) == tuple(wspec)[:-2] + tuple(wspec)[-1:], p  # the input axis dropped


def make_mesh_for(spec):
    from sharding.config import MeshConfig
    from sharding.mesh import make_mesh

    return make_mesh(spec, num_devices=MeshConfig.parse(spec).num_devices)


def test_engine_on_a_data_and_tensor_mesh_gives_one_devices_tokens(models):
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    prompts = [[0, 5, 6, 7, 8, 9] * 3, [0, 40, 41, 42]]
    got = {}
    for mesh in (None, "data=2,tensor=2"):
        llm = LLM(str(models["qwen3"]), quantization="int8", quantize_lm_head=True, kv_cache_dtype="int8",
                  warmup=False, num_pages=32, max_model_len=64, max_num_batched_tokens=32, max_num_seqs=4,
                  compilation_cache_dir=None, mesh=mesh, num_devices=4 if mesh else None, page_size=8)
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        got[mesh] = [o.outputs[0].token_ids for o in outs]
        assert llm.engine.executor.info.describe()["kv_bytes_per_token"] == 2 * 2 * 1 * (16 + 4)
    assert got[None] == got["data=2,tensor=2"]


ROUTERS = ("mlp.gate.weight", "shared_expert_gate.weight")


def _prequantize(src: Path, dst: Path, method: str, *, kind: str = "fp8", strategy: str = "channel",
                 block: int | None = None, routers: bool = False) -> Path:
    """Write ``src``'s weights as a published checkpoint of ``method`` would hold them (HF [out, in] layout);
    with ``routers`` the MoE routers too (a compressed-tensors "Linear" target without an ignore entry for
    them)."""
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    hf = json.loads((src / "config.json").read_text())
    out, deq = {}, {}
    qmax = quant.QMAX[kind]
    for name, w in tensors.items():
        if not ((name.endswith("_proj.weight") or (routers and name.endswith(ROUTERS))) and w.ndim == 2):
            out[name] = deq[name] = w
            continue
        o, i = w.shape
        if block is not None:
            nb = (-(-o // block), -(-i // block))
            pad = np.zeros((nb[0] * block, nb[1] * block), np.float32)
            pad[:o, :i] = w
            s = np.abs(pad.reshape(nb[0], block, nb[1], block)).max(axis=(1, 3)) / qmax
            full = np.repeat(np.repeat(s, block, 0), block, 1)[:o, :i]
        elif strategy == "tensor":
            s = np.array(np.abs(w).max() / qmax, np.float32)
            full = s
        else:
            s = (np.abs(w).max(axis=1, keepdims=True) / qmax).astype(np.float32)  # [out, 1]
            full = s
        x = w / full
        q = np.clip(np.rint(x), -127, 127).astype(np.int8) if kind == "int8" else \
            np.clip(x, -qmax, qmax).astype(ml_dtypes.float8_e4m3fn)
        out[name] = q
        scale_name = name + ("_scale_inv" if method == "fp8" else "_scale")
        out[scale_name] = np.asarray(s, np.float32)
        deq[name] = (q.astype(np.float32) * full).astype(np.float32)
        base = name[: -len("weight")]
        if method == "compressed-tensors":
            out[base + "input_scale"] = np.ones((1,), np.float32)  # static activation scale: unused here
    if method == "fp8":
        hf["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     **({"weight_block_size": [block, block]} if block else {})}
    else:
        t = "float" if kind == "fp8" else "int"
        hf["quantization_config"] = {"quant_method": "compressed-tensors", "format": f"{t}-quantized",
                                     "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                         "num_bits": 8, "type": t, "symmetric": True, "strategy": strategy}}},
                                     "ignore": ["lm_head"]}
    save_file(out, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(hf))
    ref = dst.parent / (dst.name + "_dequantized")
    ref.mkdir()
    save_file(deq, ref / "model.safetensors")
    (ref / "config.json").write_text((src / "config.json").read_text())
    return ref


@pytest.mark.parametrize("method,kind,strategy,block", [
    ("fp8", "fp8", "tensor", None),
    ("fp8", "fp8", None, 32),  # block-wise weight_scale_inv (the Qwen3 FP8 layout, smaller blocks)
    ("fp8", "fp8", None, 128),
    ("compressed-tensors", "fp8", "channel", None),
    ("compressed-tensors", "int8", "tensor", None),
])
def test_prequantized_checkpoints_load_as_published(models, tmp_path, method, kind, strategy, block):
    src = models["qwen3"]
    dst = tmp_path / "q"
    ref = _prequantize(src, dst, method, kind=kind, strategy=strategy or "channel", block=block)
    model, _, _ = load_model(dst, "float32")
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    assert flat[("layers", 0, "mlp", "up_proj", "weight")].get_value().dtype == quant.WEIGHT_DTYPES[kind]
    tokens = np.random.default_rng(2).integers(3, 300, size=(1, 32), dtype=np.int32)
    got = teacher_forced_logits(str(dst), tokens)
    want = teacher_forced_logits(str(ref), tokens)  # the published values, dequantized on the host
    # int8 weights meet ~14-bit activation rows on CPU (layers.int8_rows_matmul): a little further from fp32
    tol = 1e-3 if kind == "int8" else 1e-4
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def test_a_prequantized_checkpoints_config_is_read_once(models, tmp_path):
    """The loader takes the checkpoint's quantization from the ModelConfig read at start-up: config.json is not
    opened again (it was, by ``quantization_plan``)."""
    dst = tmp_path / "q"
    _prequantize(models["qwen3"], dst, "fp8", kind="fp8", block=32)
    cfg = ModelConfig.from_pretrained(dst)
    assert cfg.quantization_config["quant_method"] == "fp8"
    (dst / "config.json").rename(dst / "config.json.read")
    model, _, _ = load_model(dst, "float32", cfg=cfg)
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    assert flat[("layers", 0, "mlp", "up_proj", "weight")].get_value().dtype == quant.WEIGHT_DTYPES["fp8"]


@pytest.mark.parametrize("method,kind,block", [("compressed-tensors", "int8", None), ("fp8", "fp8", 32)])
def test_prequantized_moe_checkpoints_keep_routers_in_the_model_dtype(models, tmp_path, method, kind, block):
    """Experts, shared expert and routers of a published 8-bit MoE checkpoint: the experts stay 8-bit, the routers
    (and the shared expert's gate) are dequantized once at load and score experts in the model dtype."""
    src = models["qwen2_moe"]
    ref = _prequantize(src, tmp_path / "q", method, kind=kind, block=block, routers=True)
    model, _, _ = load_model(tmp_path / "q", "float32")
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    assert flat[("layers", 0, "mlp", "experts", "up_proj")].get_value().dtype == quant.WEIGHT_DTYPES[kind]
    tokens = np.random.default_rng(4).integers(3, 300, size=(1, 32), dtype=np.int32)
    got = teacher_forced_logits(str(tmp_path / "q"), tokens)
    want = teacher_forced_logits(str(ref), tokens)
    tol = 1e-3 if kind == "int8" else 1e-4
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    deq = load_file(ref / "model.safetensors")
    for path, hf in ((("layers", 0, "mlp", "gate", "weight"), "model.layers.0.mlp.gate.weight"),
                     (("layers", 1, "mlp", "shared_expert_gate", "weight"),
                      "model.layers.1.mlp.shared_expert_gate.weight")):
        assert path[:-1] + ("weight_scale",) not in flat and flat[path].get_value().dtype == np.float32
        np.testing.assert_array_equal(np.asarray(flat[path].get_value()), deq[hf].T)  # the published values


def test_other_quant_methods_are_refused_in_one_line(models, tmp_path):
    for method in ("awq", "gptq", "bitsandbytes"):
        hf = json.loads((models["qwen3"] / "config.json").read_text())
        hf["quantization_config"] = {"quant_method": method, "bits": 4}
        with pytest.raises(ValueError, match=rf"quant_method='{method}' is not supported; supported: .*fp8") as e:
            quant.checkpoint_quant(hf)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="already quantized"):
        dst = tmp_path / "fp8"
        _prequantize(models["qwen3"], dst, "fp8", block=32)
        load_model(dst, "float32", quantization="int8")


def test_capacity_counts_8_bit_pages_and_their_scales(models):
    from jaxserve.tools.capacity import capacity
    from sharding.config import MeshConfig

    cfg = ModelConfig.from_pretrained(models["qwen3"])
    kw = dict(hbm_gb=1, dtype="bfloat16", page_size=16, mesh=MeshConfig.parse(None), utilization=0.9,
              max_model_len=256)
    bf16, int8 = capacity(cfg, **kw), capacity(cfg, kv_cache_dtype="int8", quantization="int8", **kw)
    per = 2 * cfg.num_layers * cfg.num_kv_heads
    assert bf16["kv_bytes_per_token"] == per * cfg.head_dim * 2
    assert int8["kv_bytes_per_token"] == per * (cfg.head_dim + 4)
    assert int8["weights_gib_per_device"] < bf16["weights_gib_per_device"]
    assert int8["pages_per_replica"] > bf16["pages_per_replica"]


TARGETS = {"w_int8": 0.97, "kv_int8": 0.98, "w_fp8": 0.93, "kv_fp8": 0.93}
ALL_MODES = tuple(TARGETS)
# The families and modes whose targets hold, on the tiny models trained on a peaked Markov chain
# (docs/benchmarks/quantization.md, "Quality — teacher-forced agreement", trained models): every family in every
# mode (gpt-oss, added later, is not measured there yet). The random models' misses on near-ties of nearly flat
# distributions are reported there, not tested.
HOLDS = {family: ALL_MODES for family in FAMILIES if family != "gpt_oss"}
# Tested here (each family costs a training run and five compiles): the random models' misses, one family per kind
# of layer: llama (llama3 rope), gemma3 (Gemma norms, and q/k norms: qwen3's), qwen2_moe (routed top-2 experts,
# mixtral's kind, beside a shared expert); llama_mha_bias is llama's layer. The others reach every target in
# docs/benchmarks/quantization.md as well.
TESTED = ("llama", "gemma3", "qwen2_moe")
TRAIN_STEPS = 200  # as in docs/benchmarks/quantization.md: quant_quality.py --train-steps 200


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """family -> a tiny model at weight std 0.08 trained TRAIN_STEPS steps on the Markov corpus, built once."""
    root, tok, built = tmp_path_factory.mktemp("quant_trained"), train_tokenizer(), {}

    def get(family):
        if family not in built:
            built[family] = build_tiny_model(family, root / family, tokenizer=tok, init_std=0.08,
                                             train_steps=TRAIN_STEPS)
        return built[family]
    return get


@pytest.mark.parametrize("family", [f for f in TESTED if f in HOLDS])
def test_quality_targets_hold_on_tiny_families(trained, family):
    path = trained(family)
    tokens = held_out_markov(ModelConfig.from_pretrained(path).vocab_size, 2, 128)
    got = evaluate(str(path), list(HOLDS[family]), tokens=tokens)
    for mode in HOLDS[family]:
        assert got[mode]["p_top1"] > 0.3, (family, got[mode])  # peaked, not a random model's flat predictions
        assert got[mode]["top1"] >= TARGETS[mode], (family, mode, got[mode])
        assert got[mode]["kl"] < 0.01, (family, mode, got[mode])


def test_noise_diagnostic_perturbs_the_quantized_weights_by_int8s_rounding_error(models):
    from quant_quality import noisy_copy

    src = load_file(models["qwen2_moe"] / "model.safetensors")
    with noisy_copy(str(models["qwen2_moe"])) as noisy:
        got = load_file(Path(noisy) / "model.safetensors")
    for name, w in src.items():
        quantized = name.endswith("_proj.weight") and w.ndim == 2
        if not quantized:  # routers, shared-expert gate, norms, embedding, head: untouched
            np.testing.assert_array_equal(got[name], w, err_msg=name)
            continue
        want = np.abs(w).max(axis=1, keepdims=True) / 127 / np.sqrt(12)  # HF [out, in]: per output channel
        ratio = np.std((got[name] - w) / want)
        assert 0.8 < ratio < 1.2, (name, ratio)


def test_quality_against_transformers_on_natural_text(models):
    """The script's natural-text workload is the text in the model's tokenizer, and each mode is compared with fp32
    transformers as well as the unquantized engine: the engine itself ("none") agrees with transformers at every
    position (a shifted or misaligned reference would not). The mode is fp8 KV, which the CPU pool holds as bytes:
    written by the engine's KV write and read back by the prompt chunks' context walk."""
    from transformers import AutoTokenizer

    path = models["qwen2"]
    tok = AutoTokenizer.from_pretrained(path)
    tokens = text_workload(tok, 2, 48)
    assert tokens.shape == (2, 48)
    assert tok.decode(tokens[0], skip_special_tokens=True) in TEXT.read_text()
    got = evaluate(str(path), ["kv_fp8"], tokens=tokens, against_transformers=True)
    assert got["none"]["hf"]["top1"] == 1.0 and got["none"]["hf"]["kl"] < 1e-6, got["none"]["hf"]
    assert abs(got["kv_fp8"]["hf"]["top1"] - got["kv_fp8"]["top1"]) <= 2 / tokens.size, got["kv_fp8"]
    assert got["kv_fp8"]["top1"] >= 0.9 and 0 < got["kv_fp8"]["hf"]["kl"] < 0.01, got["kv_fp8"]


def test_compare_counts_agreement_kl_and_near_ties():
    a = np.log(np.array([[[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.41, 0.39, 0.2]]]))
    b = np.log(np.array([[[0.7, 0.2, 0.1], [0.6, 0.1, 0.3], [0.39, 0.41, 0.2]]]))
    r = compare(a, b)
    assert r["top1"] == pytest.approx(1 / 3)
    assert r["kl"] == pytest.approx((0.1 * np.log(0.1 / 0.6) + 0.8 * np.log(0.8 / 0.3)
                                     + 0.41 * np.log(0.41 / 0.39) + 0.39 * np.log(0.39 / 0.41)) / 3)
    # each position's top-1/top-2 gap moves by 0, log(0.3/0.1) - log(0.8/0.1), and -2 log(0.41/0.39)
    moves = np.array([0.0, np.log(0.3 / 0.1) - np.log(0.8 / 0.1), -2 * np.log(0.41 / 0.39)])
    assert r["pert"] == pytest.approx(np.sqrt(np.mean(moves ** 2)))
    # only the third gap (log(0.41/0.39)) is below it; one of the two disagreements is there
    assert r["near_ties"] == pytest.approx(1 / 3) and r["flips_in_ties"] == 0.5
    # the reference's confidence: mean top-1 probability and the gap's quantiles
    assert r["p_top1"] == pytest.approx((0.7 + 0.8 + 0.41) / 3)
    gaps = [np.log(0.7 / 0.2), np.log(0.8 / 0.1), np.log(0.41 / 0.39)]
    assert r["gap_q50"] == pytest.approx(np.median(gaps)) and r["gap_q5"] == pytest.approx(np.quantile(gaps, 0.05))


def test_markov_corpus_follows_its_chain_in_one_topic_per_sequence():
    from tiny import markov_chain, markov_corpus

    ids, probs = markov_chain(384)
    np.testing.assert_allclose(probs.sum(-1), 1.0)
    seqs = markov_corpus(384, 64, 48, seed=5)
    np.testing.assert_array_equal(seqs, markov_corpus(384, 64, 48, seed=5))  # deterministic
    assert not np.array_equal(seqs, held_out_markov(384, 64, 48))  # the held-out seed draws other sequences
    assert seqs.min() >= 3  # never a special token
    for seq in seqs:  # every step is a successor of the previous id in one topic, the same all along
        topics = [t for t in range(len(ids)) if all(b in ids[t, a] for a, b in zip(seq[:-1], seq[1:]))]
        assert len(topics) == 1, seq


def test_int8_rows_matmul_matches_the_float_product():
    import jax.numpy as jnp

    from jaxserve.models import layers

    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.08, size=(96, 40)).astype(np.float32)
    q, scale = quant.quantize(w, "int8")
    x = rng.normal(0, 1, size=(3, 96)).astype(np.float32)
    x[1] *= 100.0  # each row has its own activation scale
    want = x @ quant.dequantize_host(q, scale)
    got = np.asarray(layers.int8_rows_matmul(jnp.asarray(x), jnp.asarray(q)) * scale)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())  # activations to ~14 bits
    one = np.asarray(layers.int8_rows_matmul(jnp.asarray(x[2:]), jnp.asarray(q)))  # the padded one-row path
    np.testing.assert_array_equal(one[0], np.asarray(layers.int8_rows_matmul(jnp.asarray(x), jnp.asarray(q)))[2])


def test_int8_kv_with_preemption_prefix_caching_chunked_prefill_and_nan_scales(tmp_path):
    """The same int8-KV tokens whether prompts are chunked, share cached pages or are preempted and recomputed,
    and whatever the free pages' scales hold."""
    import jax.numpy as jnp

    from jaxserve.engine.engine import Engine
    from test_engine import random_workload, run

    path = build_tiny_model("llama", tmp_path / "m")
    common = dict(model=str(path), page_size=4, max_model_len=64, max_num_seqs=8, seed=0, warmup=False,
                  compilation_cache_dir=None, kv_cache_dtype="int8", quantization="int8")
    tight = Engine(EngineConfig(num_pages=24, max_num_batched_tokens=16, debug_checks=True, **common))
    roomy = Engine(EngineConfig(num_pages=256, max_num_batched_tokens=128, enable_prefix_caching=False, **common))
    arrivals = random_workload(np.random.default_rng(0), tight.model_config.vocab_size, n=10)
    got, want = run(tight, arrivals), run(roomy, arrivals)
    assert tight.scheduler.num_preemptions > 0 and tight.stats()["prefix_cache_hits"] > 0
    for rid, out in want.items():
        assert got[rid].outputs[0].token_ids == out.outputs[0].token_ids, rid
    runner = tight.executor.runner
    tight.scheduler.block_manager.reset_prefix_cache()
    runner.kv_cache = [tuple(p.with_arrays(p.values, jnp.full_like(p.scales, jnp.nan)) for p in layer)
                       for layer in runner.kv_cache]
    again = run(tight, [[(rid + "-again", p, sp) for rid, p, sp in wave] for wave in arrivals])
    for rid, out in want.items():
        assert again[rid + "-again"].outputs[0].token_ids == out.outputs[0].token_ids, rid


def test_tpu_kernel_over_int8_pages_gives_the_reference_paths_greedy_tokens(models):
    """The whole engine with an int8 KV cache: the Pallas TPU kernel (interpret mode on CPU) reading the 8-bit
    pages, on a tensor=2 mesh (each shard's kernel gets its own quantized pages inside shard_map), gives the
    tokens of the reference path on one device, over chunked prompts and decodes."""
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    prompts = [[0, 5, 6, 7, 8, 9] * 4, [3, 9, 27, 81, 50, 11, 7]]  # 24 tokens: two chunks
    got = {}
    for backend, mesh in (("reference", None), ("pallas_tpu", "tensor=2")):
        llm = LLM(str(models["qwen3"]), kv_cache_dtype="int8", attention_backend=backend, warmup=False,
                  num_pages=32, page_size=4, max_model_len=48, max_num_batched_tokens=16, max_num_seqs=4,
                  compilation_cache_dir=None, mesh=mesh, num_devices=2 if mesh else None)
        assert llm.engine.executor.cache_dtype == np.int8
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        got[backend] = [o.outputs[0].token_ids for o in outs]
    assert got["pallas_tpu"] == got["reference"]
