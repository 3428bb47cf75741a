"""Every rope type against transformers' own rotary embedding, at positions far beyond the original context, and
through the whole engine against transformers' greedy tokens."""

import inspect
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from jaxserve import LLM, SamplingParams
from jaxserve.models import layers
from jaxserve.models.config import ModelConfig
from jaxserve.models.loader import load_model
from jaxserve.models.rope import ROPE_TYPES, RopeConfig

from tiny import build_tiny_model, hf_greedy, hf_model, train_tokenizer

HEAD_DIM = 16
ORIGINAL = 32  # the pre-training context of every case below; positions are checked up to 8x past it
RNG = np.random.default_rng(0)
LONGROPE = dict(short_factor=(1 + RNG.random(HEAD_DIM // 2)).round(3).tolist(),
                long_factor=(1 + 8 * RNG.random(HEAD_DIM // 2)).round(3).tolist())
# rope type -> (rope_parameters, max_position_embeddings)
CASES = {
    "default": (dict(rope_type="default", rope_theta=10000.0), 256),
    "linear": (dict(rope_type="linear", rope_theta=10000.0, factor=4.0), ORIGINAL),
    "dynamic": (dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0), ORIGINAL),
    "yarn": (dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=ORIGINAL), 256),
    "yarn_mscale": (dict(rope_type="yarn", rope_theta=500.0, factor=4.0, original_max_position_embeddings=ORIGINAL,
                         mscale=0.7, mscale_all_dim=1.0, beta_fast=16.0, beta_slow=2.0), 128),
    "longrope": (dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=ORIGINAL,
                      **LONGROPE), 256),
    "llama3": (dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=ORIGINAL), 256),
}


def hf_config(name: str) -> LlamaConfig:
    params, mpe = CASES[name]
    return LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=mpe,
                       rope_parameters=dict(params))


def our_rope(name: str) -> RopeConfig:
    cfg = hf_config(name)
    return ModelConfig.from_hf_dict(dict(cfg.to_dict(), architectures=["LlamaForCausalLM"])).rope


def hf_tables(cfg: LlamaConfig, positions: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """transformers' cos/sin for each position as the last token of its own sequence (seq_len = position + 1),
    each from a fresh rotary module (dynamic rope keeps state between calls)."""
    cos, sin = [], []
    for p in positions:
        rotary = LlamaRotaryEmbedding(cfg)
        c, s = rotary(torch.zeros(1, 1, HEAD_DIM), torch.tensor([[p]]))
        cos.append(c[0, 0].numpy())
        sin.append(s[0, 0].numpy())
    return np.stack(cos), np.stack(sin)


@pytest.mark.quick
def test_every_rope_type_is_covered():
    assert {CASES[n][0]["rope_type"] for n in CASES} == set(ROPE_TYPES)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.quick
def test_tables_match_transformers_beyond_the_original_context(name):
    positions = [0, 1, 5, ORIGINAL - 2, ORIGINAL - 1, ORIGINAL, ORIGINAL + 1, 2 * ORIGINAL + 3, 4 * ORIGINAL,
                 8 * ORIGINAL - 1]
    want_cos, want_sin = hf_tables(hf_config(name), positions)
    rope = our_rope(name)
    cos, sin = layers.rope_tables(jnp.asarray(positions, jnp.int32), rope, HEAD_DIM)
    # f32 angles of up to ~256 radians: a 1-ulp frequency difference moves them by ~3e-5.
    np.testing.assert_allclose(np.asarray(cos), want_cos, atol=2e-4)
    np.testing.assert_allclose(np.asarray(sin), want_sin, atol=2e-4)
    if name in ("yarn", "yarn_mscale", "longrope"):
        assert rope.attention_factor != 1.0  # the attention factor is part of what was compared


@pytest.mark.quick
def test_unsupported_rope_type_is_refused_naming_the_supported_ones(tmp_path):
    path = build_tiny_model("llama", tmp_path / "m", tokenizer=train_tokenizer(), num_hidden_layers=1)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = dict(rope_type="mrope", rope_theta=10000.0, mrope_section=[2, 2, 4])
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope type 'mrope' is not supported.*'default'.*'yarn'.*'longrope'"):
        load_model(str(path))
    cfg["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
        load_model(str(path))


@torch.no_grad()
def hf_cached_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens from transformers' own KV-cached generation: each decoded token is rotated with the
    frequencies of the sequence it ends (what dynamic and longrope rope are defined by here)."""
    # transformers renames past_key_values to cache (5.x, the old name warns until 5.40): pass the one it takes.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(torch.tensor([prompt]), use_cache=True)
    ids = [int(torch.argmax(out.logits[0, -1]))]
    for _ in range(max_tokens - 1):
        cache = out.past_key_values if getattr(out, "cache", None) is None else out.cache
        out = model(torch.tensor([[ids[-1]]]), use_cache=True, **{name: cache})
        ids.append(int(torch.argmax(out.logits[0, -1])))
    return ids


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.mark.parametrize("name", ["linear", "dynamic", "yarn", "longrope"])
def test_engine_tokens_match_transformers_past_the_original_context(name, tmp_path, tokenizer):
    """A prompt inside the original context and generation far past it. Static scalings (linear, yarn; llama3 is
    the tiny Llama's own) against transformers recomputing the whole sequence each step; position-dependent ones
    (dynamic, longrope) against transformers' cached generation, which rotates each new token for the sequence it
    ends, as we do."""
    params, mpe = CASES[name]
    path = build_tiny_model("llama", tmp_path / name, tokenizer=tokenizer, num_hidden_layers=1, head_dim=HEAD_DIM,
                            max_position_embeddings=mpe, rope_parameters=dict(params))
    llm = LLM(str(path), dtype="float32", page_size=4, max_num_seqs=2, max_num_batched_tokens=32,
              max_model_len=ORIGINAL * 3, warmup=False, compilation_cache_dir=None)
    hf = hf_model(path)
    prompt = np.random.default_rng(3).integers(3, llm.model_config.vocab_size, ORIGINAL - 7).tolist()
    new = ORIGINAL + 8  # positions up to 2x the original context
    got = llm.generate(prompt, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))[0].outputs[0]
    want = hf_cached_greedy(hf, prompt, new) if our_rope(name).per_position else hf_greedy(hf, prompt, new)
    assert got.token_ids == want
