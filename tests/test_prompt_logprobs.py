"""Prompt logprobs offline (``SamplingParams.prompt_logprobs``) against transformers' log-probabilities, for
prompts chunked over several steps beside other requests, with n > 1, and after a preemption."""

import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams
from tiny import build_tiny_model, hf_model, train_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("qwen3", tmp_path_factory.mktemp("plp"), tokenizer=train_tokenizer())


@torch.no_grad()
def hf_prompt_logprobs(model, prompt: list[int]) -> np.ndarray:
    lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1).numpy()
    return lp


def test_prompt_logprobs_match_transformers(model_dir):
    # Few pages and slots: prompts are chunked, share steps with decodes, and the pool preempts.
    llm = LLM(str(model_dir), page_size=4, num_pages=16, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=16, warmup=False, compilation_cache_dir=None)
    hf = hf_model(model_dir)
    rng = np.random.default_rng(0)
    vocab = llm.model_config.vocab_size
    prompts = [rng.integers(3, vocab, int(n)).tolist() for n in (37, 5, 22, 2, 30)]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=k)
              for k in (0, 3, 1, 20, 2)]
    params[2] = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=1, ignore_eos=True, prompt_logprobs=1)
    params.append(SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))  # no prompt logprobs
    prompts.append(rng.integers(3, vocab, 20).tolist())
    outs = llm.generate(prompts, params)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert outs[-1].prompt_logprobs is None
    for prompt, p, out in zip(prompts, params, outs):
        if p.prompt_logprobs is None:
            continue
        ref = hf_prompt_logprobs(hf, prompt)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for pos in range(1, len(prompt)):
            entry = out.prompt_logprobs[pos]
            token = prompt[pos]
            assert next(iter(entry)) == token
            np.testing.assert_allclose(entry[token], ref[pos - 1, token], atol=1e-4)
            top = np.argsort(-ref[pos - 1])[: p.prompt_logprobs]
            others = {t: v for t, v in entry.items() if t != token}
            assert set(others) <= set(top.tolist()) and len(entry) in (p.prompt_logprobs, p.prompt_logprobs + 1)
            for t, v in entry.items():
                np.testing.assert_allclose(v, ref[pos - 1, t], atol=1e-4)
