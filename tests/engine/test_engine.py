"""The continuous-batching engine end to end on a tiny model, against transformers as the oracle."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxserve import LLM, SamplingParams

from jaxserve.executor.runner import CompileCounter
from jaxserve.engine.engine import Engine
from jaxserve.config.engine import EngineConfig
from tiny import build_tiny_model, hf_greedy, hf_model, train_tokenizer

# Compilations in this process from here on (the tests read differences).
compile_counter = CompileCounter()

PAGE = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), tokenizer=train_tokenizer())


@pytest.fixture(scope="module")
def hf(model_dir):
    return hf_model(model_dir)


@pytest.fixture(scope="module")
def shared_engine(model_dir, tmp_path_factory):
    """A warmed-up engine with a pool small enough that the random workload must preempt."""
    return Engine(EngineConfig(model=str(model_dir), page_size=PAGE, num_pages=24, max_model_len=64,
                               max_num_seqs=8, max_num_batched_tokens=64, debug_checks=True, seed=0,
                               compilation_cache_dir=None))


@pytest.fixture(params=["async", "sync"])
def engine(shared_engine, request):
    """The shared engine with async scheduling on, then off (both run the same compiled shapes)."""
    assert not shared_engine.has_unfinished()
    shared_engine._async = request.param == "async"
    yield shared_engine
    shared_engine._async = True


def run(engine: Engine, arrivals: list[list[tuple[str, list[int], SamplingParams]]]) -> dict:
    """Feed requests in waves (one wave before each step) and step until everything finishes."""
    results, step = {}, 0
    while step < len(arrivals) or engine.has_unfinished():
        if step < len(arrivals):
            for rid, prompt, params in arrivals[step]:
                engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        engine.scheduler.block_manager.check_invariants()
        step += 1
    bm = engine.scheduler.block_manager
    assert bm.num_free_pages == bm.num_pages, "pages leaked"
    return results


def random_workload(rng, vocab, n=14, shared_prefix_len=9):
    system = rng.integers(3, vocab, shared_prefix_len).tolist()
    arrivals = [[] for _ in range(12)]
    for i in range(n):
        body = rng.integers(3, vocab, int(rng.integers(1, 30))).tolist()
        prompt = (system + body) if i % 3 == 0 else body
        params = SamplingParams(max_tokens=int(rng.integers(1, 24)), temperature=0.0, ignore_eos=True)
        arrivals[int(rng.integers(0, len(arrivals)))].append((f"r{i}", prompt, params))
    return arrivals


def test_random_arrivals_with_preemption_match_transformers(engine, hf):
    rng = np.random.default_rng(0)
    arrivals = random_workload(rng, engine.model_config.vocab_size)
    preemptions = engine.scheduler.num_preemptions
    results = run(engine, arrivals)
    assert engine.scheduler.num_preemptions > preemptions, "the workload should force preemption"
    for wave in arrivals:
        for rid, prompt, params in wave:
            out = results[rid].outputs[0]
            assert out.token_ids == hf_greedy(hf, prompt, params.max_tokens), rid
            assert out.finish_reason == "length"


def test_nan_poisoned_free_pages_change_nothing(engine):
    rng = np.random.default_rng(1)
    arrivals = random_workload(rng, engine.model_config.vocab_size, n=8)
    clean = run(engine, arrivals)
    bm = engine.scheduler.block_manager
    bm.reset_prefix_cache()
    runner = engine.executor.runner
    runner.kv_cache = [(jnp.full_like(k, jnp.nan), jnp.full_like(v, jnp.nan)) for k, v in runner.kv_cache]
    arrivals = [[(rid + "-again", p, sp) for rid, p, sp in wave] for wave in arrivals]
    poisoned = run(engine, arrivals)
    for rid, out in clean.items():
        assert poisoned[rid + "-again"].outputs[0].token_ids == out.outputs[0].token_ids


def test_no_compiles_after_warmup(engine):
    compiled = compile_counter.count()
    rng = np.random.default_rng(2)
    arrivals = random_workload(rng, engine.model_config.vocab_size, n=10)
    arrivals[3].append(("sampled", [5, 6, 7], SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, top_k=20,
                                                                seed=3, logprobs=2, repetition_penalty=1.3)))
    arrivals[5].append(("n2", [9, 10, 11, 12, 13], SamplingParams(n=2, max_tokens=7, temperature=1.0, min_p=0.05,
                                                                   presence_penalty=0.5, stop=["ab"], min_tokens=2)))
    arrivals[6].append(("greedy-lp", [4, 4, 4], SamplingParams(max_tokens=5, temperature=0.0, logprobs=0)))
    # structured output: the mask is one more fixed-shape sampler input, constrained rows beside free ones
    arrivals[4].append(("json", [7, 8, 9], SamplingParams(max_tokens=12, temperature=1.0, seed=5,
                                                          structured_outputs={"json_object": True})))
    arrivals[6].append(("choice", [7, 8], SamplingParams(max_tokens=6, temperature=0.0,
                                                         structured_outputs={"choice": ["yes", "no"]})))
    # prompt logprobs: more logits rows of the same steps, and one more small compiled function (warmed up)
    arrivals[2].append(("prompt-lp", list(range(3, 30)), SamplingParams(max_tokens=2, temperature=0.0,
                                                                        prompt_logprobs=3)))
    arrivals[3].append(("bias", [9, 8, 7], SamplingParams(max_tokens=3, temperature=0.0, logit_bias={5: 3.0})))
    run(engine, arrivals)
    assert compile_counter.count() == compiled


def test_seeded_sampling_independent_of_batch_mates(engine):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234)
    prompt = [11, 22, 33, 44, 55]
    alone = run(engine, [[("alone", prompt, params)]])["alone"].outputs[0].token_ids
    rng = np.random.default_rng(3)
    mates = [(f"mate{i}", rng.integers(3, 300, 12).tolist(), SamplingParams(max_tokens=7, temperature=0.7,
                                                                             seed=i)) for i in range(5)]
    crowded = run(engine, [mates[:3] + [("crowded", prompt, params)] + mates[3:]])
    assert crowded["crowded"].outputs[0].token_ids == alone
    other_seed = run(engine, [[("other", prompt, SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95,
                                                                 seed=99))]])
    assert other_seed["other"].outputs[0].token_ids != alone


def test_top_k_one_equals_greedy(engine):
    prompt = [9, 8, 7, 6]
    greedy = run(engine, [[("g", prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))]])
    topk = run(engine, [[("k", prompt, SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=5,
                                                       ignore_eos=True))]])
    assert topk["k"].outputs[0].token_ids == greedy["g"].outputs[0].token_ids


def test_n_samples_logprobs_and_metrics(engine):
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=7, logprobs=3, ignore_eos=True)
    out = run(engine, [[("n3", list(range(3, 23)), params)]])["n3"]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1, "n samples should differ"
    for o in out.outputs:
        assert len(o.token_ids) == 6 and len(o.logprobs) == 6
        for token, lp in zip(o.token_ids, o.logprobs):
            assert token in lp and len(lp) >= 3 and all(v.logprob <= 0.0 for v in lp.values())
            assert all(v.decoded_token == engine.tokenizer.decode([t]) for t, v in lp.items())
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_running_requests_get_deltas_and_the_finished_one_its_whole_output(engine):
    """A running request's outputs carry only each step's news (token ids, text, TokenRecords, prompt records
    once); the final output assembles the whole, whose logprobs are the records' dicts."""
    from jaxserve.outputs import CompletionDelta, RequestDelta, RequestOutput, TokenRecord

    params = SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=3, logprobs=2, prompt_logprobs=1,
                            ignore_eos=True)
    engine.add_request("d", list(range(3, 13)), params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    *running, final = outs
    assert running and all(type(o) is RequestDelta and not o.finished for o in running)
    assert type(final) is RequestOutput and final.finished
    assert sum(o.prompt_records is not None for o in [*running, final][:-1]) == 1  # once, with the first output
    decode = engine.tokenizer.decode
    assert final.prompt_logprobs == [r.entry(lambda t: decode([t])) if r else None for r in final.prompt_records]
    for c in final.outputs:
        news = [d for o in running for d in o.outputs if d.index == c.index]
        assert all(type(d) is CompletionDelta and len(d.delta_token_ids) == len(d.delta_records) for d in news)
        ids = [t for d in news for t in d.delta_token_ids] + c.delta_token_ids
        records = [r for d in news for r in d.delta_records] + c.delta_records
        assert ids == c.token_ids and records == c.records and len(records) == 5
        assert "".join(d.delta_text for d in news) + c.delta_text == c.text
        assert c.logprobs == [r.entry(lambda t: decode([t])) for r in records]
        for token, r in zip(ids, records):
            assert type(r) is TokenRecord and r.id == token and len(r.top) == 2
            assert r.top[0][1] >= r.top[1][1] and r.logprob <= r.top[0][1]
            assert r.rank == (next((i for i, (t, _) in enumerate(r.top, 1) if t == token), None))


def test_stop_string_is_removed_and_finishes(engine, hf):
    prompt = [5, 17, 99, 23]
    full = run(engine, [[("full", prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))]])
    text = full["full"].outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    out = run(engine, [[("stop", prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                        stop=[stop]))]])["stop"].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]


def test_abort_frees_pages_in_any_state(engine):
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("b", [4, 5, 6], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.abort_request("a").outputs[0].finish_reason == "abort"
    assert engine.abort_request("b").finished
    assert engine.abort_request("missing") is None
    assert not engine.has_unfinished()
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_pages == bm.num_pages


def test_invalid_requests_raise_naming_the_field(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(None, [], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request(None, [1, 10**6], SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request(None, [1, 2, 3], SamplingParams(max_tokens=62))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    assert not engine.has_unfinished()


def test_llm_chat_uses_the_template(model_dir):
    llm = LLM(str(model_dir), page_size=PAGE, max_num_seqs=2, max_model_len=128, max_num_batched_tokens=64,
              warmup=False, compilation_cache_dir=None)
    messages = [{"role": "user", "content": "Hello there"}]
    ids = llm.apply_chat_template(messages)
    assert ids == llm.tokenizer.encode("<|user|>Hello there</s><|assistant|>", add_special_tokens=False)
    chat = llm.chat(messages, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    direct = llm.generate([ids], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert chat.prompt_token_ids == ids and chat.outputs[0].token_ids == direct.outputs[0].token_ids
    assert chat.num_prompt_tokens == len(ids) and chat.num_completion_tokens == 5


def test_decodes_ride_in_the_prompt_step(engine, hf, monkeypatch):
    """A step with decodes and a prompt chunk is one compiled call, on every attention backend."""
    calls = []
    runner = engine.executor.runner
    real = runner.run
    monkeypatch.setattr(runner, "run", lambda kind, batch, *prev: calls.append(kind.name.lower() + "_step") or real(kind, batch, *prev))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("first", [5, 6, 7, 8, 9], params)
    engine.step()
    engine.add_request("second", [10, 11, 12], params)
    calls.clear()
    engine.step()  # "first" decodes while "second" prefills
    assert calls == ["prefill_step"]
    results = run(engine, [])
    assert results["first"].outputs[0].token_ids == hf_greedy(hf, [5, 6, 7, 8, 9], 4)
    assert results["second"].outputs[0].token_ids == hf_greedy(hf, [10, 11, 12], 4)


def test_max_model_len_boundary_and_the_extra_token_is_dropped(engine, hf):
    """A sequence ends exactly at max_model_len; under async scheduling the step launched after its last token
    computes one more for it, which is never emitted, and every page comes back (``run`` checks)."""
    prompt = list(range(3, 63))  # 60 tokens: room for 4 more in max_model_len=64
    out = run(engine, [[("edge", prompt, SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))]])
    completion = out["edge"].outputs[0]
    assert completion.finish_reason == "length" and completion.token_ids == hf_greedy(hf, prompt, 4)


def test_async_steps_overlap_and_structured_output_runs_synchronously(engine):
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("plain", [5, 6, 7], params)
    first = engine.step()
    if engine._async:  # the step is in flight, its token not read yet; the next step launches before reading it
        assert first == [] and engine._pending is not None
    else:
        assert engine._pending is None
    run(engine, [])
    engine.add_request("json", [7, 8, 9], SamplingParams(max_tokens=3, temperature=0.0,
                                                          structured_outputs={"json_object": True}))
    engine.step()
    assert engine._pending is None, "a step with structured output needs the previous token on the host"
    assert run(engine, [])["json"].outputs[0].finish_reason in ("length", "stop")


def test_many_banned_ids_compile_nothing(engine):
    """min_tokens with more than 8 stop ids bans them through the allowed-token mask: no new sampler shape."""
    prompt = [5, 6, 7]
    free = run(engine, [[("free", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))]])
    stop_ids = tuple(sorted(set(free["free"].outputs[0].token_ids) | set(range(3, 15))))
    assert len(stop_ids) > 8
    compiled, guarded = compile_counter.count(), engine.stats()["compilations_after_warmup"]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, min_tokens=4, stop_token_ids=stop_ids)
    out = run(engine, [[("ban", prompt, params)]])["ban"].outputs[0]
    assert compile_counter.count() == compiled and engine.stats()["compilations_after_warmup"] == guarded
    assert len(out.token_ids) == 4 and not set(out.token_ids) & set(stop_ids)


def test_compile_after_warmup_is_counted_and_logged(engine, caplog, monkeypatch):
    from jaxserve.server.metrics import ServerMetrics
    from jaxserve.executor.sampler import sample

    before = engine.stats()["compilations_after_warmup"]
    monkeypatch.setattr(engine.executor, "_sample", jax.jit(lambda logits, t, p: sample(logits, t, p)))  # cold
    with caplog.at_level("WARNING", logger="jaxserve.executor.executor"):
        run(engine, [[("cold", [5, 6], SamplingParams(max_tokens=2, temperature=0.7, seed=1, ignore_eos=True))]])
    assert engine.stats()["compilations_after_warmup"] > before
    assert any("after warm-up" in r.getMessage() and "sampler (banned=8" in r.getMessage() for r in caplog.records)
    metrics = ServerMetrics()
    metrics.attach_engine(engine.stats, lambda: 0)
    assert b"jaxserve_compilations_after_warmup_total " in metrics.render()


def test_a_decode_step_runs_code_in_few_files(shared_engine):
    """A steady-state decode step (the greedy path, async scheduling) runs code in at most 11 of the project's
    files, all in the engine, executor, scheduler and text rooms: the path ``docs/architecture.md`` draws.
    ``scripts/step_files.py`` lists them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from step_files import step_files

    runner = shared_engine.executor.runner
    checks, runner.debug_checks = runner.debug_checks, False  # the fixture's value checks are not the step's
    try:
        files = step_files(shared_engine)
    finally:
        runner.debug_checks = checks
    assert len(files) <= 11, files
    assert {Path(f).parts[1] for f in files} <= {"engine", "executor", "scheduler", "text"}, files
