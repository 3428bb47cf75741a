"""Windowed models through the engine under preemption and prefix caching, against transformers: Mistral with
every layer windowed (pages behind the window are released while sequences run) and Gemma 3 (windowed and
global layers interleaved; the windowed layers keep their pages in a pool of their own, recycled behind the
window)."""

import numpy as np
import pytest

from jaxserve.engine.engine import Engine
from jaxserve.config.engine import EngineConfig
from test_engine import random_workload, run
from tiny import build_tiny_model, hf_greedy, hf_model, train_tokenizer

PAGE = 4


@pytest.mark.parametrize("family, window", [("mistral", 6), ("gemma3", 6)])
def test_random_arrivals_with_preemption_and_prefix_hits_match_transformers(family, window, tmp_path):
    path = build_tiny_model(family, tmp_path / family, tokenizer=train_tokenizer(), sliding_window=window)
    engine = Engine(EngineConfig(model=str(path), page_size=PAGE, num_pages=16, max_model_len=64, max_num_seqs=8,
                                 max_num_batched_tokens=64, debug_checks=True, seed=0, warmup=False,
                                 compilation_cache_dir=None))
    bm = engine.scheduler.block_manager
    assert bm.attention_window == (window if family == "mistral" else None)  # Gemma 3 has global layers
    arrivals = random_workload(np.random.default_rng(0), engine.model_config.vocab_size, n=10)
    results = run(engine, arrivals)
    # Mistral releases pages of its one pool; Gemma 3's windowed layers have a pool of their own, which does.
    released = bm.num_released_pages if family == "mistral" else bm.windowed.num_released_pages
    assert released > 0
    if family == "gemma3":
        assert bm.full.num_released_pages == 0
        assert [k.shape[1] for k, _ in engine.executor.runner.kv_cache] == [bm.windowed.num_pages, bm.full.num_pages]
    assert engine.scheduler.num_preemptions > 0 and bm.prefix_cache_hits > 0
    hf = hf_model(path)
    for wave in arrivals:
        for rid, prompt, params in wave:
            assert results[rid].outputs[0].token_ids == hf_greedy(hf, prompt, params.max_tokens), rid


def test_windowed_pool_warms_up_and_serves_without_compiling(tmp_path):
    """The two-table page rows are part of every compiled shape: warm-up compiles them all, serving nothing."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.executor.runner import CompileCounter
    path = build_tiny_model("gemma2", tmp_path / "g", tokenizer=train_tokenizer(), sliding_window=5)
    llm = LLM(str(path), max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, compilation_cache_dir=None)
    assert llm.engine.executor.runner.local_pool
    compile_counter = CompileCounter()
    before = compile_counter.count()
    prompts = [list(range(5, 23)), [7, 7, 3]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert compile_counter.count() == before, "compiled while serving"
    hf = hf_model(path)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 20) for p in prompts]
