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


@pytest.fixture(scope="module")
def llm(model_dir):
    # Few pages and slots: prompts are chunked, share steps with decodes, and the pool preempts.
    return LLM(str(model_dir), page_size=4, num_pages=16, max_model_len=64, max_num_seqs=4,
               max_num_batched_tokens=16, warmup=False, compilation_cache_dir=None)


@pytest.fixture(scope="module")
def hf(model_dir):
    return hf_model(model_dir)


def test_prompt_logprobs_match_transformers(llm, hf):
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
            np.testing.assert_allclose(entry[token].logprob, ref[pos - 1, token], atol=1e-4)
            top = np.argsort(-ref[pos - 1])[: p.prompt_logprobs]
            others = {t: v for t, v in entry.items() if t != token}
            assert set(others) <= set(top.tolist()) and len(entry) in (p.prompt_logprobs, p.prompt_logprobs + 1)
            for t, v in entry.items():
                np.testing.assert_allclose(v.logprob, ref[pos - 1, t], atol=1e-4)


def _check_vllm_entry(entry: dict, token: int, num_top: int, decode) -> None:
    """One position's logprobs in vLLM's shape: ``token`` first, then the top-n with ranks 1..n (values sorted),
    each a ``Logprob`` whose ``decoded_token`` is the token's own text; the chosen token's rank is its place among
    the top-n (None outside them)."""
    from jaxserve import Logprob

    assert next(iter(entry)) == token and all(type(v) is Logprob for v in entry.values())
    top = sorted((v.rank, t) for t, v in entry.items() if v.rank is not None)
    assert [r for r, _ in top] == list(range(1, len(top) + 1))
    values = [entry[t].logprob for _, t in top]
    assert values == sorted(values, reverse=True) and all(v <= 0.0 for v in values)
    if entry[token].rank is None:  # outside the top-n: the other n entries are the top
        assert len(top) == num_top and entry[token].logprob <= values[-1]
    else:
        assert len(top) in (num_top, num_top + 1) and entry[token].rank >= 1
        if entry[token].rank > 1:
            assert entry[token].logprob <= values[0]
    for t, v in entry.items():
        assert v.decoded_token == decode(t)


def test_logprobs_are_vllm_logprob_objects(llm, hf):
    """``LLM.generate``'s ``logprobs`` and ``prompt_logprobs`` read as vLLM's: ``.logprob``, ``.rank`` (1 = most
    likely) and ``.decoded_token``, the values those of transformers."""
    prompt = llm.tokenizer.encode("the quick brown fox jumps", add_special_tokens=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3,
                                                prompt_logprobs=2))[0]
    decode = lambda t: llm.tokenizer.decode([t])  # noqa: E731
    ref = hf_prompt_logprobs(hf, prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        _check_vllm_entry(entry, prompt[pos], 2, decode)
        best = int(np.argmax(ref[pos - 1]))
        assert next(t for t, v in entry.items() if v.rank == 1) == best
        np.testing.assert_allclose(entry[prompt[pos]].logprob, ref[pos - 1, prompt[pos]], atol=1e-4)
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 5
    full = prompt + c.token_ids
    ref = hf_prompt_logprobs(hf, full)
    for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        _check_vllm_entry(entry, token, 3, decode)
        assert entry[token].rank == 1  # greedy: the sampled token is the most likely
        np.testing.assert_allclose(entry[token].logprob, ref[len(prompt) + i - 1, token], atol=1e-4)
