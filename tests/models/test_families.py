"""The family registry and the family files' reading of configs in every format they come in."""

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.models.config import ModelConfig
from jaxserve.models import registry
from tiny import build_tiny_model, hf_greedy, hf_model, train_tokenizer

SHAPE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16)


def test_every_family_file_is_registered_once():
    names = [f.name for f in registry.FAMILIES]
    assert len(set(names)) == len(names)
    assert {"Gemma2ForCausalLM", "Gemma3ForCausalLM", "LlamaForCausalLM"} <= set(registry.SUPPORTED_ARCHITECTURES)
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel.*supported: .*Gemma3ForCausalLM"):
        ModelConfig.from_hf_dict(dict(SHAPE, architectures=["GPT2LMHeadModel"], num_hidden_layers=2))


def test_config_without_architectures_is_read_by_its_model_type():
    for model_type, arch in registry.BY_MODEL_TYPE.items():
        hf = dict(SHAPE, model_type=model_type, num_hidden_layers=2)
        if "moe" in model_type or model_type in ("mixtral", "gpt_oss"):
            hf.update(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        cfg = ModelConfig.from_hf_dict(hf)
        assert cfg.architecture == arch and cfg.family == registry.BY_ARCHITECTURE[arch].name
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported; supported model types: llama"):
        ModelConfig.from_hf_dict(dict(SHAPE, model_type="gpt2", num_hidden_layers=2))
    with pytest.raises(ValueError, match="neither 'architectures' nor 'model_type'"):
        ModelConfig.from_hf_dict(dict(SHAPE, num_hidden_layers=2))
    # A listed architecture decides: a head jaxserve does not serve is refused even when model_type is known.
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForSequenceClassification"):
        ModelConfig.from_hf_dict(dict(SHAPE, architectures=["LlamaForSequenceClassification"], model_type="llama",
                                      num_hidden_layers=2))


def test_gemma3_config_without_layer_types_in_the_older_rope_format():
    """Configs on the hub predate layer_types and rope_parameters: sliding_window_pattern (default 6),
    rope_theta with rope_scaling for global layers, rope_local_base_freq for windowed ones."""
    hf = dict(SHAPE, architectures=["Gemma3ForCausalLM"], num_hidden_layers=12, sliding_window=512,
              rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rope_scaling=dict(rope_type="linear", factor=8.0),
              query_pre_attn_scalar=16, max_position_embeddings=131072)
    cfg = ModelConfig.from_hf_dict(hf)
    assert cfg.sliding_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(12))
    assert cfg.local_window == 512 and cfg.attention_window is None
    assert cfg.layer_rope(5) == cfg.rope and cfg.rope.kind == "linear" and cfg.rope.factor == 8.0
    assert cfg.layer_rope(0).theta == 10_000.0 and cfg.layer_rope(0).kind == "default"
    assert cfg.qk_norm and cfg.norm_offset == 1.0 and cfg.sandwich_norms and cfg.tie_word_embeddings
    assert cfg.attn_soft_cap is None and cfg.sm_scale == 16**-0.5
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_dict(dict(hf, use_bidirectional_attention=True))


def test_gemma2_defaults_window_every_other_layer_and_soft_caps():
    cfg = ModelConfig.from_hf_dict(dict(SHAPE, architectures=["Gemma2ForCausalLM"], num_hidden_layers=4,
                                        sliding_window=4096, attn_logit_softcapping=50.0,
                                        final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh"))
    assert cfg.sliding_windows == (4096, None, 4096, None)
    assert (cfg.attn_soft_cap, cfg.final_soft_cap, cfg.hidden_act) == (50.0, 30.0, "gelu_pytorch_tanh")
    assert cfg.sm_scale == 256**-0.5  # query_pre_attn_scalar's default, not head_dim
    with pytest.raises(ValueError, match="hidden activation 'relu' is not supported"):
        ModelConfig.from_hf_dict(dict(SHAPE, architectures=["Gemma2ForCausalLM"], num_hidden_layers=2,
                                      hidden_activation="relu"))


def test_qwen3_attention_bias_includes_the_output_projection(tmp_path):
    """Qwen3 with attention_bias has a bias on o_proj too (transformers' Qwen3Attention); it used to be
    refused as an unexpected tensor."""
    path = build_tiny_model("qwen3", tmp_path / "m", tokenizer=train_tokenizer(), num_hidden_layers=1,
                            attention_bias=True)
    assert ModelConfig.from_pretrained(path).o_bias
    llm = LLM(str(path), page_size=4, max_num_seqs=1, max_num_batched_tokens=32, max_model_len=48, warmup=False,
              compilation_cache_dir=None)
    prompt = [5, 17, 99, 23, 4, 250, 31]
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == hf_greedy(hf_model(path), prompt, 8)
