"""Every attention backend gives the same greedy tokens through the whole engine (kernels in interpret mode)."""

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.attention import AttentionBackend
from tiny import build_tiny_model, train_tokenizer


def test_auto_resolves_per_platform():
    assert AttentionBackend.resolve("auto", "cpu") == AttentionBackend("reference")
    assert AttentionBackend.resolve("auto", "tpu") == AttentionBackend("pallas_tpu")
    assert AttentionBackend.resolve("auto", "gpu") == AttentionBackend("pallas_gpu")
    assert AttentionBackend.resolve("pallas_gpu", "cpu").interpret
    assert not AttentionBackend.resolve("pallas_gpu", "gpu").interpret
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        AttentionBackend.resolve("flash", "cpu")


def test_every_backend_same_greedy_tokens(tmp_path):
    path = build_tiny_model("qwen3", tmp_path / "m", tokenizer=train_tokenizer(), num_hidden_layers=1)
    prompts = [[5, 17, 99, 23, 4, 250, 31, 8, 9], [7, 7, 3], list(range(3, 23))]  # mixed lengths, page edges
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    results = {}
    for backend in ("reference", "pallas_tpu", "pallas_gpu"):
        llm = LLM(str(path), page_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=48,
                  attention_backend=backend, warmup=False, compilation_cache_dir=None)
        results[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert results["pallas_tpu"] == results["reference"]
    assert results["pallas_gpu"] == results["reference"]
