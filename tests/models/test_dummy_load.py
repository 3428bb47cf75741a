"""load_format="dummy": a folder holding only config.json, random weights drawn on the devices."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.executor.batch import StepKind
from jaxserve.models import checkpoint
from jaxserve.models.loader import load_model

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000,
          "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1,
          "eos_token_id": 2, "dtype": "bfloat16"}
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, warmup=False, compilation_cache_dir=None)


def config_only(folder: Path, **changes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(CONFIG, **changes)))
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return config_only(tmp_path_factory.mktemp("config_only"))


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), load_format="dummy", dtype="float32", **SMALL)


def flat_weights(llm: LLM) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(llm.engine.executor.runner.params)}


def test_config_only_folder_generates_text_and_ids(llm):
    assert list(Path(llm.engine.model_path).iterdir()) == [Path(llm.engine.model_path) / "config.json"]
    outs = llm.generate(["Hello world", [5, 600, 999]], GREEDY)
    for out in outs:
        assert len(out.outputs[0].token_ids) == 10
        assert all(0 <= t < CONFIG["vocab_size"] for t in out.outputs[0].token_ids)
    assert outs[0].prompt_token_ids[:1] == [256]  # the demo byte tokenizer's <s>: the folder has no tokenizer
    assert len(set(outs[1].outputs[0].token_ids)) > 1


def test_weights_are_random_scaled_and_logits_not_flat(llm):
    weights = flat_weights(llm)
    for path, w in weights.items():
        assert np.isfinite(w).all(), path
        if w.ndim == 1:  # norms scale by 1
            np.testing.assert_array_equal(w, 1.0, err_msg=str(path))
            continue
        fan_in = w.shape[-1] if path[-1] == "embedding" else w.shape[-2]
        assert w.std() == pytest.approx(fan_in ** -0.5, rel=0.15), path
    assert len({float(w.std()) for w in weights.values() if w.ndim == 2}) > 1
    # Each matrix its own draw: no two layers alike.
    q0, q1 = (weights[("layers", i, "self_attn", "q_proj", "weight")] for i in (0, 1))
    assert not np.allclose(q0, q1)
    executor = llm.engine.executor
    prompt = [5, 17, 99, 23, 4, 250, 31]
    pages = llm.engine.scheduler.block_manager.pool.allocate(1)
    try:
        batch = executor.make_batch([prompt], [len(prompt)], [pages], kind=StepKind.PREFILL)
        logits = np.asarray(executor.runner.run(StepKind.PREFILL, batch).logits)[0]
    finally:
        llm.engine.scheduler.block_manager.pool.free(pages)
    assert np.isfinite(logits).all()
    assert 0.3 < logits.std() < 10


def test_seed_decides_the_weights(folder, llm):
    again = LLM(str(folder), load_format="dummy", dtype="float32", **SMALL)
    other = LLM(str(folder), load_format="dummy", dtype="float32", seed=1, **SMALL)
    path = ("lm_head", "weight")
    np.testing.assert_array_equal(flat_weights(again)[path], flat_weights(llm)[path])
    assert not np.allclose(flat_weights(other)[path], flat_weights(llm)[path])


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantization_applies_to_dummy_weights(folder, kind):
    model, _, _ = load_model(folder, "bfloat16", quantization=kind, quantize_lm_head=True, load_format="dummy")
    flat = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
    q = flat[("layers", 0, "mlp", "down_proj", "weight")]
    scale = np.asarray(flat[("layers", 0, "mlp", "down_proj", "weight_scale")])
    assert q.dtype == (np.int8 if kind == "int8" else jax.numpy.float8_e4m3fn)
    assert q.shape == (128, 64) and scale.shape == (64,) and (scale > 0).all()
    # Dequantized, the weight has the float draw's scale: std 1/sqrt(in).
    w = np.asarray(q, np.float32) * scale[None, :]
    assert w.std() == pytest.approx(128 ** -0.5, rel=0.15)
    emb = flat[("embed_tokens", "embedding")]
    assert emb.dtype == q.dtype and flat[("embed_tokens", "embedding_scale")].shape == (1000,)


def test_quantized_dummy_model_generates(folder):
    llm = LLM(str(folder), load_format="dummy", dtype="bfloat16", quantization="int8", **SMALL)
    out = llm.generate([[5, 600, 999]], GREEDY)[0].outputs[0].token_ids
    assert len(out) == 10


def test_gemma_norms_scale_by_one(tmp_path):
    folder = config_only(tmp_path / "gemma", architectures=["Gemma2ForCausalLM"], model_type="gemma2", head_dim=16,
                         query_pre_attn_scalar=16, sliding_window=8, tie_word_embeddings=True)
    model, cfg, _ = load_model(folder, "float32", load_format="dummy")
    assert cfg.norm_offset == 1.0
    flat = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}
    norms = [w for p, w in flat.items() if w.ndim == 1]
    assert norms and all((w == 0).all() for w in norms)  # Gemma scales by 1 + w


def test_a_tokenizer_in_the_folder_or_given_is_used(folder, tmp_path):
    from tiny import train_tokenizer

    tok_dir = tmp_path / "tok"
    train_tokenizer().save_pretrained(tok_dir)
    llm = LLM(str(folder), load_format="dummy", tokenizer=str(tok_dir), **SMALL)
    assert len(llm.tokenizer) == 384
    assert llm.generate("The quick brown fox", GREEDY)[0].prompt_token_ids[0] == 0  # this tokenizer's <s>


def test_bad_load_format_is_rejected_naming_the_field(folder):
    with pytest.raises(ValueError, match=r"load_format='safetensors' must be one of 'auto', 'dummy'"):
        EngineConfig(model=str(folder), load_format="safetensors")
    with pytest.raises(ValueError, match=r"load_format='x' must be one of"):
        load_model(folder, load_format="x")
    with pytest.raises(ValueError, match=r"load_format='DUMMY'"):
        LLM(str(folder), load_format="DUMMY", **SMALL)


def test_auto_still_needs_the_weights(folder):
    with pytest.raises(ValueError, match="no \\*.safetensors checkpoint"):
        load_model(folder, "float32")


def test_hub_download_skips_weights_for_dummy(monkeypatch):
    import huggingface_hub

    seen = {}

    def snapshot_download(repo, allow_patterns, revision, cache_dir):
        seen[repo] = allow_patterns
        return "/nonexistent"

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    checkpoint.resolve_model_path("org/model")
    checkpoint.resolve_model_path("org/config-only", weights=False)
    assert "*.safetensors" in seen["org/model"]
    assert "*.json" in seen["org/config-only"] and "*.model" in seen["org/config-only"]
    assert not {"*.safetensors", "params/**", "orbax/**"} & set(seen["org/config-only"])


def test_load_format_flag(folder, capsys):
    from jaxserve.server.args import parse_args

    args = parse_args(["--model", str(folder), "--load-format", "dummy"])
    assert args.engine_config.load_format == "dummy"
    assert parse_args(["--model", str(folder)]).engine_config.load_format == "auto"
    with pytest.raises(SystemExit):
        parse_args(["--model", str(folder), "--load-format", "bogus"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--load-format: invalid choice: 'bogus'" in err and "dummy" in err
