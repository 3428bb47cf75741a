"""Every model family against Hugging Face transformers on tiny random checkpoints."""

import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams
from jaxserve.executor.batch import StepKind
from tiny import FAMILIES, build_tiny_model, hf_greedy, hf_last_logits, hf_model, train_tokenizer

PAGE = 4
# Prompt lengths around page edges (k * PAGE - 1, k * PAGE, k * PAGE + 1) plus short and odd ones;
# with 32 new tokens each sequence spans up to 14 pages.
PROMPT_LENS = [1, 7, 19, 20, 21]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, tokenizer):
    path = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param), tokenizer=tokenizer)
    llm = LLM(str(path), dtype="float32", page_size=PAGE, max_num_seqs=8, max_num_batched_tokens=32,
              debug_checks=True, warmup=False, compilation_cache_dir=None)
    return request.param, path, llm, hf_model(path)


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, vocab, n).tolist() for n in PROMPT_LENS]


def jax_last_logits(llm: LLM, prompt: list[int]) -> np.ndarray:
    """Prefill logits straight from the runner, on pages borrowed from the idle engine's pool."""
    bm = llm.engine.scheduler.block_manager
    bm.reset_prefix_cache()
    local_pool = llm.engine.executor.runner.local_pool  # Gemma: the windowed layers' own pool
    pools = [bm.full.pool, bm.windowed.pool] if local_pool else [bm.pool]
    tables = [pool.allocate(-(-len(prompt) // PAGE)) for pool in pools]
    try:
        batch = llm.engine.executor.make_batch([prompt], [len(prompt)], tables[:1], kind=StepKind.PREFILL,
                                               local_page_tables=tables[1:] or None)
        return np.asarray(llm.engine.executor.runner.run(StepKind.PREFILL, batch).logits)[0]
    finally:
        for pool, table in zip(pools, tables):
            pool.free(table)


def test_prefill_logits_match(family):
    _, _, llm, hf = family
    for prompt in prompts(llm.model_config.vocab_size):
        want = hf_last_logits(hf, prompt)
        assert want.std() > 0.5, "logits too flat to compare"
        np.testing.assert_allclose(jax_last_logits(llm, prompt), want, rtol=1e-4, atol=1e-4)


def test_greedy_tokens_identical_in_a_batch_and_alone(family):
    _, _, llm, hf = family
    ps = prompts(llm.model_config.vocab_size)
    batched = llm.generate(ps, GREEDY)
    for prompt, out in zip(ps, batched):
        completion = out.outputs[0]
        assert out.prompt_token_ids == prompt
        assert completion.finish_reason == "length"
        assert completion.token_ids == hf_greedy(hf, prompt, 32)
    for prompt, out in zip(ps[::2], batched[::2]):
        assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == out.outputs[0].token_ids
    bm = llm.engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_pages == bm.num_pages


def test_long_prompt_chunked_prefill_matches(family):
    """A prompt longer than max_num_batched_tokens is prefilled in chunks across steps."""
    _, _, llm, hf = family
    prompt = np.random.default_rng(7).integers(3, llm.model_config.vocab_size, 75).tolist()
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 8)


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen2_moe"])
def test_bfloat16_logits_close(name, tmp_path, tokenizer):
    path = build_tiny_model(name, tmp_path / name, tokenizer=tokenizer)
    llm = LLM(str(path), dtype="bfloat16", page_size=PAGE, max_num_seqs=2, max_num_batched_tokens=32,
              warmup=False, compilation_cache_dir=None)
    assert llm.engine.executor.runner.params["embed_tokens"]["embedding"].get_value().dtype == np.dtype("bfloat16")
    hf = hf_model(path, torch.float32)
    for prompt in prompts(llm.model_config.vocab_size)[1:3]:
        want = hf_last_logits(hf, prompt)
        got = jax_last_logits(llm, prompt)
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, atol=0.05 * scale)
        assert np.corrcoef(got, want)[0, 1] > 0.995


def test_text_prompt_and_eos_stop(family, tokenizer):
    _, _, llm, hf = family
    text = "The quick brown fox"
    out = llm.generate(text, SamplingParams(max_tokens=5, temperature=0.0))[0]
    ids = tokenizer(text).input_ids
    assert out.prompt_token_ids == ids and out.prompt == text
    want = hf_greedy(hf, ids, 5)
    if 1 in want:  # EOS (id 1) ends the request with "stop" and is kept as its last token
        want = want[: want.index(1) + 1]
    comp = out.outputs[0]
    assert comp.token_ids == want
    assert comp.finish_reason == ("stop" if want[-1] == 1 and len(want) <= 5 and 1 in want else "length")
    assert comp.text == tokenizer.decode(want, skip_special_tokens=True)
