"""Prefill/decode disaggregation in one process (jaxserve/disagg/staged.py): two meshes on the 8 emulated devices, KV
pages copied between the two engines' pools; outputs identical to the colocated engine's."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve import LLM
from jaxserve.config.engine import EngineConfig
from jaxserve.sampling_params import SamplingParams
from tiny import FAMILIES, build_tiny_model, hf_greedy, hf_model

SHAPES = dict(page_size=8, max_model_len=96, max_num_seqs=3, max_num_batched_tokens=24, num_pages=48,
              warmup=False, compilation_cache_dir=None)
PROMPTS = [[5 + i + 3 * j for j in range(4 + 13 * i)] for i in range(5)]  # 4..56 tokens: chunked, several pages


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("disagg") / "llama")


@pytest.fixture(scope="module")
def colocated(llama):
    return LLM(str(llama), mesh="tensor=2", num_devices=2, **SHAPES)


@pytest.fixture(scope="module")
def disagg(llama):
    # data on the decode side; tensor 2 -> 4 with 2 KV heads: the decode cache stores each head twice (remapped).
    return LLM(str(llama), prefill_mesh="tensor=2", decode_mesh="data=2,tensor=2", max_pending_transfers=2,
               **SHAPES)


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_greedy_seeded_penalties_logprobs_and_n_match_colocated(colocated, disagg):
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=8, temperature=1.0, n=2, repetition_penalty=1.3, frequency_penalty=0.5,
                             ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.7, ignore_eos=True)]  # unseeded: the request index's seed
    for sp in params:
        want, got = colocated.generate(PROMPTS, sp), disagg.generate(PROMPTS, sp)
        assert _tokens(got) == _tokens(want), sp
        if sp.logprobs:
            for a, b in zip(want, got):
                for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                    assert x.keys() == y.keys() and all(abs(x[k].logprob - y[k].logprob) < 1e-4 for k in x)
    s = disagg.engine.stats()
    assert s["kv_transfers"] > 0 and s["kv_transfer_bytes"] > 0 and s["decode_steps"] > 0
    # Requests beyond the decode side's max_num_seqs waited for room (held their prefill pages), none dropped.
    assert s["kv_transfer_queue_seconds"] > 0


def test_prefix_cache_on_prefill_side_and_first_token_finish(disagg, colocated):
    prompt = list(range(10, 50))
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    before = disagg.engine.stats()["prefix_cache_hits"]
    a = disagg.generate([prompt], sp)[0]
    b = disagg.generate([prompt], sp)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == colocated.generate([prompt], sp)[0].outputs[0].token_ids
    # 40 tokens: 4 of the 5 full pages are reused (the last prompt token is always computed).
    assert b.metrics.num_cached_tokens == 32 and disagg.engine.stats()["prefix_cache_hits"] - before == 32
    moved = disagg.engine.stats()["kv_transfers"]
    one = disagg.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert disagg.engine.stats()["kv_transfers"] == moved  # finished by its first token: nothing to move
    assert one.outputs[0].finish_reason == "length" and one.outputs[0].token_ids == a.outputs[0].token_ids[:1]


def _pages(engine):
    e = engine
    used = [r.block_manager.num_used_pages for r in e.prefill_scheduler.replicas]
    used += [r.block_manager.num_used_pages for r in e.decode_scheduler.replicas]
    return sum(used)


def test_abort_in_every_stage_frees_pages_on_both_sides(disagg):
    e = disagg.engine
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    prompts = [[(101 + 11 * i + 5 * j) % 370 + 3 for j in range(4 + 13 * i)] for i in range(5)]  # not cached
    for i, p in enumerate(prompts):
        e.add_request(f"ab{i}", p, sp)
    seen = set()
    for _ in range(200):
        e.step()
        where = {"prefill": e.prefill_scheduler.num_running, "moving": len(e.handoffs),
                 "decode": e.decode_scheduler.num_running}
        seen |= {k for k, v in where.items() if v}
        if where["moving"] and where["decode"]:
            break
    assert {"prefill", "moving", "decode"} <= seen
    for i in range(len(prompts)):
        e.abort_request(f"ab{i}")
    e.drain_transfers()
    assert not e.has_unfinished() and not e.handoffs and _pages(e) == 0
    for r in (*e.prefill_scheduler.replicas, *e.decode_scheduler.replicas):
        r.block_manager.check_invariants()


def test_stages_count_the_running_slots_of_both_sides(disagg):
    """The server's admission check weighs the engine's running sequences (both sides) against the sequences it
    may run at once: max_num_seqs per replica of each side (prefill data=1, decode data=2)."""
    stages = disagg.engine.scheduler
    assert stages.max_num_running == 3 * (1 + 2) == disagg.engine.stats()["max_num_running"]
    assert stages.running == [] and stages.num_running == 0


@pytest.mark.quick
def test_disaggregated_config_is_checked():
    with pytest.raises(ValueError, match="prefill_mesh and decode_mesh go together"):
        EngineConfig(prefill_mesh="tensor=2")
    with pytest.raises(ValueError, match="decode_mesh: "):
        EngineConfig(prefill_mesh="tensor=2", decode_mesh="tensor=x")
    with pytest.raises(ValueError, match="mesh/num_devices cannot be combined"):
        EngineConfig(prefill_mesh="tensor=2", decode_mesh="tensor=2", mesh="tensor=4")


@pytest.mark.quick
def test_too_many_devices_is_refused(llama):
    with pytest.raises(ValueError, match="need 12 devices; 8 are available"):
        LLM(str(llama), prefill_mesh="tensor=4", decode_mesh="data=2,tensor=4", **SHAPES)


# What moves between the pools is each layer's pages, shaped by the family's head layout and window: every
# KV head count (1, 2, 4) and head_dim (8, 16, 24) runs, and each kind of pool. qwen2, qwen2_moe and mixtral have
# llama's layout (2 KV heads of 16), qwen3_moe llama_tied_headdim's (one KV head of 24), qwen3 one KV head
# (llama_tied_headdim's) of 16 (llama's); their models run against transformers in test_models_vs_transformers.py,
# colocated and disaggregated engines share them. gpt_oss's pages are laid out as gemma2's (a windowed pool beside
# the global one); sinks are weights, not pages. deepseek_v3 stands for the latent-cache layout (deepseek_v2
# shares it).
DISAGG_FAMILIES = sorted(set(FAMILIES) - {"qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss",
                                          "deepseek_v2"})


@pytest.mark.parametrize("family", DISAGG_FAMILIES)
def test_every_family_greedy_matches_transformers(family, tmp_path):
    path = build_tiny_model(family, tmp_path / family)
    llm = LLM(str(path), prefill_mesh="tensor=1", decode_mesh="tensor=1", page_size=4, max_model_len=48,
              max_num_seqs=2, max_num_batched_tokens=8, num_pages=24, warmup=False, compilation_cache_dir=None)
    prompt = [3 + 7 * j % 300 for j in range(19)]  # chunked over 3 steps; windowed families release pages
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got = llm.generate([prompt], sp)[0].outputs[0].token_ids
    assert got == hf_greedy(hf_model(path), prompt, 6)
    assert llm.engine.stats()["kv_transfers"] == 1


def test_decode_side_full_prefills_wait_bounded_and_nothing_is_dropped(disagg, colocated):
    e = disagg.engine
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[7 + i + 5 * j for j in range(9 + 3 * i)] for i in range(9)]  # 9 requests, 6 decode slots
    for i, p in enumerate(prompts):
        e.add_request(f"full{i}", p, sp)
    done, most_waiting = {}, 0
    while e.has_unfinished():
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        most_waiting = max(most_waiting, sum(h.staged is None for h in e.handoffs))
    # They waited for room, and the wait is bounded: prefill pauses once max_pending_transfers wait (one last
    # prefill step may add up to max_num_seqs more).
    assert 1 <= most_waiting < e.config.max_pending_transfers + e.config.max_num_seqs
    want = _tokens(colocated.generate(prompts, sp))
    assert [[done[f"full{i}"]] for i in range(len(prompts))] == want


@pytest.fixture(scope="module")
def colocated_int8(llama):
    return LLM(str(llama), kv_cache_dtype="int8", **SHAPES)


INT8_PARAMS = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
               SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)]


def test_8bit_kv_cache_pages_move_with_their_scales(llama, colocated_int8):
    # tensor 1 -> 4 with 2 KV heads: the decode pool stores each head twice, so values and scales are remapped.
    disagg = LLM(str(llama), prefill_mesh="tensor=1", decode_mesh="tensor=4", kv_cache_dtype="int8", **SHAPES)
    for sp in INT8_PARAMS:
        assert _tokens(disagg.generate(PROMPTS[:3], sp)) == _tokens(colocated_int8.generate(PROMPTS[:3], sp)), sp
    s = disagg.engine.stats()
    # Every byte moved is counted: int8 values plus one f32 scale per token and head, K and V.
    assert s["kv_transfers"] == 6 and s["kv_transfer_bytes"] % (2 * 2 * 2 * 8 * (16 + 4)) == 0


def _run(engine, prompts, sp):
    ids = [engine.add_request(None, p, sp) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def test_8bit_kv_cache_across_processes(llama, colocated_int8):
    """--role prefill/decode with both ends in this process: 8-bit values and their scales travel together,
    pulled through JAX's transfer server and as bytes over the gRPC stream, to a decode side that speculates; a
    decode side with another KV dtype is refused by the prefill server, naming the flag."""
    from jaxserve.disagg.prefill import PrefillServer
    from jaxserve.disagg.remote import RemotePrefillEngine

    cfg = EngineConfig(model=str(llama), kv_cache_dtype="int8", **SHAPES)
    server = PrefillServer(cfg, "127.0.0.1", 0, kv_transfer="jax")
    server.start()
    engines = []
    try:
        url = [f"127.0.0.1:{server.port}"]
        # The decode side speculates (n-gram; greedy output unchanged), the prefill side does not.
        decode = RemotePrefillEngine(dataclasses.replace(cfg, speculative_config=NGRAM), prefill_urls=url,
                                     kv_transfer="jax")
        engines.append(decode)  # closed at the end: each probes its prefill servers on a thread until closed
        prompts = PROMPTS[:2] + [[5, 6, 7, 8] * 5]
        want = _tokens(colocated_int8.generate(prompts, INT8_PARAMS[0]))
        # Pulled through JAX's transfer server (values and scales as two arrays), then over the byte stream.
        assert [[c.token_ids for c in o.outputs] for o in _run(decode, prompts, INT8_PARAMS[0])] == want
        assert decode.stats()["kv_transfer_pulls"] == 3 and server.engine.stats()["kv_transfer_offers"] == 3
        decode.remote.transfer = None
        assert [[c.token_ids for c in o.outputs] for o in _run(decode, prompts, INT8_PARAMS[0])] == want
        assert decode.stats()["kv_transfers"] == 6 and decode.stats()["kv_transfer_pulls"] == 3
        assert decode.stats()["spec_proposed_tokens"] > 0
        with pytest.raises(ValueError, match="start the prefill process without --speculative-config"):
            PrefillServer(dataclasses.replace(cfg, speculative_config=NGRAM), "127.0.0.1", 0)
        plain = RemotePrefillEngine(dataclasses.replace(cfg, kv_cache_dtype="auto"), prefill_urls=url,
                                    kv_transfer="grpc")
        engines.append(plain)
        out = _run(plain, PROMPTS[:1], INT8_PARAMS[0])[0]
        assert out.outputs[0].finish_reason == "error" and "--kv-cache-dtype" in out.error
    finally:
        for engine in engines:
            engine.close()
        server.stop()


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_ngram_speculation_on_the_decode_side(llama, colocated):
    llm = LLM(str(llama), prefill_mesh="tensor=1", decode_mesh="tensor=1", speculative_config=NGRAM, **SHAPES)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 4 + [12]]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    got, want = llm.generate(prompts, sp), colocated.generate(prompts, sp)
    assert _tokens(got) == _tokens(want)
    for a, b in zip(want, got):
        assert len(b.outputs[0].logprobs) == 12
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[k].logprob - y[k].logprob) < 1e-4 for k in x)
    s = llm.engine.stats()
    assert s["spec_proposed_tokens"] > 0 and s["kv_transfers"] == 2
    with pytest.raises(ValueError, match="a draft model cannot be combined with prefill_mesh"):
        EngineConfig(prefill_mesh="tensor=1", decode_mesh="tensor=1",
                     speculative_config={"model": str(llama), "num_speculative_tokens": 2})
