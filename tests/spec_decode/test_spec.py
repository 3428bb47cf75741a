"""Speculative decoding: configuration, the n-gram proposer, verification on device (exactness of the
rejection-sampling rule), and end to end against the same engine without speculation."""

import json

import numpy as np
import pytest

from jaxserve import SamplingParams

from jaxserve.executor.runner import CompileCounter
from jaxserve.engine.engine import Engine
from jaxserve.config.args import add_engine_args, engine_config_from_args
from jaxserve.config.engine import EngineConfig
from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.spec_decode.ngram import propose
from tiny import build_tiny_model, train_tokenizer

# Compilations in this process from here on (the tests read differences).
compile_counter = CompileCounter()

PAGE = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
         "disable_by_batch_size": 64}


# ---- configuration (host only) -------------------------------------------------------------------------------
@pytest.mark.quick
def test_config_accepts_vllm_keys_and_refuses_bad_ones():
    c = SpeculativeConfig.parse(json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                            "prompt_lookup_min": 2}))
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 4, 4, 2)
    assert SpeculativeConfig.parse({"model": "/x", "num_speculative_tokens": 3}).method == "draft_model"
    for bad, field in [({"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}, "lookahead"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
                       ({"method": "ngram"}, "num_speculative_tokens"),
                       ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
                         "prompt_lookup_max": 3}, "prompt_lookup_min"),
                       ("{not json", "JSON"), ("[1]", "JSON object")]:
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig.parse(bad)
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert engine_config_from_args(args).speculative_config.num_speculative_tokens == 3
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(speculative_config={"num_speculative_tokens": 3, "foo": 1})


@pytest.mark.quick
def test_ngram_proposes_the_continuation_of_the_latest_match():
    t = np.array([1, 2, 3, 4, 5, 1, 2, 3], np.int32)
    assert propose(t, 4, 1, 4) == [4, 5, 1, 2]
    assert propose(t, 2, 1, 4) == [4, 5]
    assert propose(np.array([1, 2, 9, 8, 1, 2, 7, 1, 2], np.int32), 3, 1, 2) == [7, 1, 2]  # latest match wins
    assert propose(np.array([1, 2, 3], np.int32), 3, 1, 3) == []
    assert propose(np.array([1, 2, 3, 2], np.int32), 3, 2, 3) == []  # shorter than prompt_lookup_min


# ---- verification on device: the rejection-sampling rule keeps the target's distribution ---------------------
def test_rejection_sampling_keeps_the_target_distribution():
    """Chi-square over 4000 seeded draws on a 6-token vocabulary: the first emitted token (accepted draft, or
    the draw from the residual) and, when the draft was accepted, the bonus token follow the target's p."""
    import jax
    from scipy.stats import chisquare

    from jaxserve.executor.sampler import SamplingTensors
    from jaxserve.executor.verify import verify

    e, vocab = 4000, 6
    logits0 = np.array([1.0, 0.2, -0.5, 0.7, 0.0, -1.0], np.float32)
    logits1 = np.array([-0.3, 0.9, 0.1, 0.0, 0.5, -0.2], np.float32)
    logits = np.stack([logits0, logits1])
    rows = np.tile(np.array([[0, 1]], np.int32), (e, 1))
    drafts = np.full((e, 1), 3, np.int32)  # an n-gram draft: one-hot q on token 3
    tensors = SamplingTensors.build([SamplingParams(temperature=0.8, seed=s) for s in range(e)], num_slots=e,
                                    seeds=list(range(e)), num_generated=[0] * e)
    out = jax.jit(verify)(logits, rows, drafts, np.ones(e, np.int32), tensors)
    tokens, accepted = np.asarray(out.tokens), np.asarray(out.num_accepted)
    p0, p1 = (np.exp(x / 0.8) / np.exp(x / 0.8).sum() for x in (logits0.astype(np.float64), logits1.astype(np.float64)))
    first = np.bincount(tokens[:, 0], minlength=vocab)
    assert chisquare(first, p0 * e).pvalue > 1e-3
    assert abs(accepted.mean() - p0[3]) < 4 * np.sqrt(p0[3] * (1 - p0[3]) / e)
    bonus = np.bincount(tokens[accepted == 1, 1], minlength=vocab)
    assert chisquare(bonus, p1 * bonus.sum()).pvalue > 1e-3
    assert (tokens[accepted == 0, 1] == -1).all()
    # greedy rows accept exactly the argmax and emit the argmax after it
    greedy = SamplingTensors.build([SamplingParams(temperature=0.0)] * 2, num_slots=2, seeds=[0, 0],
                                   num_generated=[0, 0])
    g = jax.jit(verify)(logits, rows[:2], np.array([[0], [3]], np.int32), np.ones(2, np.int32), greedy)
    assert np.asarray(g.tokens).tolist() == [[0, 1], [0, -1]]


# ---- end to end -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), tokenizer=train_tokenizer())


def _config(model_dir, **kw):
    base = dict(model=str(model_dir), page_size=PAGE, num_pages=26, max_model_len=48, max_num_seqs=4,
                max_num_batched_tokens=32, debug_checks=True, seed=0, compilation_cache_dir=None)
    base.update(kw)
    return EngineConfig(**base)


@pytest.fixture(scope="module")
def plain(model_dir):
    return Engine(_config(model_dir, warmup=False))


@pytest.fixture(scope="module")
def spec(model_dir):
    return Engine(_config(model_dir, speculative_config=NGRAM))


def run(engine, requests, *, stream=None):
    """Add the requests (id, prompt, params) and step until all finish; {id: RequestOutput}."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            if stream is not None:
                stream.append(out)
            if out.finished:
                results[out.request_id] = out
        for r in engine.scheduler.replicas:
            r.block_manager.check_invariants()
    bm = engine.scheduler.block_manager
    assert bm.num_free_pages == bm.num_pages, "pages leaked"
    return results


class Oracle:
    """A proposer that knows each request's greedy continuation (from the engine without speculation) and
    proposes it, corrupting every third proposal at its third token, so runs are accepted in full and cut."""

    def __init__(self, planner, expected):
        self.planner, self.expected, self.calls = planner, expected, 0

    def __call__(self, seq, budget):
        k = min(self.planner.limit(seq), budget)
        want = self.expected.get((seq.request_id, seq.index))
        if k <= 0 or want is None:
            return []
        draft = list(want[seq.num_output_tokens: seq.num_output_tokens + k])
        self.calls += 1
        if self.calls % 3 == 0 and len(draft) >= 3:
            draft[2] = (draft[2] + 1) % 300 + 3
        return draft


def _workload():
    rng = np.random.default_rng(0)
    system = rng.integers(3, 300, 9).tolist()
    reqs = []
    for i in range(8):
        body = rng.integers(3, 300, int(rng.integers(2, 26))).tolist()
        prompt = system + body if i % 2 else body  # shared prefixes: prefix-cache hits
        reqs.append((f"r{i}", prompt, SamplingParams(max_tokens=int(rng.integers(3, 20)), temperature=0.0,
                                                     ignore_eos=True, n=2 if i == 3 else 1)))
    reqs.append(("loop", [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], SamplingParams(max_tokens=20, temperature=0.0,
                                                                           ignore_eos=True)))
    return reqs


@pytest.fixture(scope="module")
def expected(plain):
    got = run(plain, _workload())
    return {(rid, c.index): c.token_ids for rid, out in got.items() for c in out.outputs}


def _with_oracle(spec, expected, monkeypatch):
    oracle = Oracle(spec.spec, expected)
    monkeypatch.setattr(spec.spec, "propose", oracle)
    return oracle


def test_ngram_greedy_identical_with_chunks_prefix_cache_preemption_and_no_compiles(spec, expected):
    """Real n-gram proposals; a 26-page pool and 32-token steps force chunked prefill and preemption."""
    compiled = compile_counter.count()
    before = dict(spec.spec.counters.stats())
    got = run(spec, _workload())
    assert {(rid, c.index): c.token_ids for rid, out in got.items() for c in out.outputs} == expected
    assert compile_counter.count() == compiled
    assert spec.spec.counters.proposed > before["spec_proposed_tokens"]


def test_accepted_runs_identical_and_streamed_several_tokens_at_once(spec, expected, monkeypatch):
    oracle = _with_oracle(spec, expected, monkeypatch)
    accepted = spec.spec.counters.accepted
    preemptions = spec.scheduler.num_preemptions
    stream = []
    got = run(spec, _workload(), stream=stream)
    assert {(rid, c.index): c.token_ids for rid, out in got.items() for c in out.outputs} == expected
    assert oracle.calls and spec.spec.counters.accepted - accepted > 20
    assert spec.scheduler.num_preemptions > preemptions, "the workload should preempt"
    assert max(len(c.delta_token_ids) for out in stream for c in out.outputs) > 1
    stats = spec.stats()
    assert 0 < stats["spec_acceptance_rate"] <= 1 and stats["spec_mean_accepted_length"] > 1


def test_stops_and_limits_inside_an_accepted_run(spec, plain, expected, monkeypatch):
    """Stop ids, stop strings, max_tokens and max_model_len reached in the middle of an accepted run end the
    output exactly where decoding one token at a time does."""
    _with_oracle(spec, expected, monkeypatch)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    full = expected[("loop", 0)]
    text = plain.tokenizer.decode(full[4:7])
    cases = [
        ("stop_id", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[full[5]])),
        ("stop_str", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[text[len(text) // 2:]]
                                    if len(text) > 1 else [text])),
        ("max_tokens", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)),
        ("model_len", SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)),
    ]
    want = run(plain, [(rid, prompt, p) for rid, p in cases])
    oracle_want = {("loop", 0): full}
    for rid, _ in cases:
        oracle_want[(rid, 0)] = want[rid].outputs[0].token_ids if rid != "model_len" else None
    oracle_want[("model_len", 0)] = want["model_len"].outputs[0].token_ids
    monkeypatch.setattr(spec.spec, "propose", Oracle(spec.spec, {k: v + [9] * 8 for k, v in oracle_want.items()}))
    got = run(spec, [(rid, prompt, p) for rid, p in cases])
    for rid, _ in cases:
        a, b = want[rid].outputs[0], got[rid].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), rid
    assert len(got["model_len"].outputs[0].token_ids) == 48 - len(prompt)


def test_logprobs_are_the_targets_and_speculative_false_turns_it_off(spec, plain, expected, monkeypatch):
    _with_oracle(spec, expected, monkeypatch)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)
    want = run(plain, [("loop", prompt, params)])["loop"].outputs[0]
    accepted = spec.spec.counters.accepted
    got = run(spec, [("loop", prompt, params)])["loop"].outputs[0]
    assert spec.spec.counters.accepted > accepted
    assert got.token_ids == want.token_ids
    for a, b in zip(want.logprobs, got.logprobs):
        assert a.keys() == b.keys()
        assert np.allclose([v.logprob for v in a.values()], [v.logprob for v in b.values()], atol=1e-4)
        assert [v.rank for v in a.values()] == [v.rank for v in b.values()]
    proposed = spec.spec.counters.proposed
    off = run(spec, [("loop", prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                       speculative=False))])["loop"].outputs[0]
    assert spec.spec.counters.proposed == proposed and off.token_ids == want.token_ids


def test_seeded_sampling_reproducible_and_abort_frees_pages(spec, expected, monkeypatch):
    _with_oracle(spec, expected, monkeypatch)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    first = run(spec, [("s", prompt, params)])["s"].outputs[0].token_ids
    second = run(spec, [("s", prompt, params), ("other", [9, 9, 9], params)])["s"].outputs[0].token_ids
    assert first == second and len(first) == 16
    spec.add_request("a", prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        spec.step()
    spec.abort_request("a")
    bm = spec.scheduler.block_manager
    assert not spec.has_unfinished() and bm.num_free_pages == bm.num_pages


def test_draft_with_another_vocabulary_is_refused_at_start(model_dir, tmp_path):
    other = build_tiny_model("llama", tmp_path / "draft", vocab_size=200)
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(_config(model_dir, warmup=False, speculative_config={"model": str(other),
                                                                     "num_speculative_tokens": 3}))


def test_request_switch_and_prometheus_counters(spec):
    """``"speculative": false`` in an OpenAI body reaches SamplingParams (a non-bool is refused naming it); the
    engine's counters become Prometheus families."""
    from pydantic import ValidationError

    from jaxserve.server.metrics import EngineStatsCollector
    from jaxserve.server.openai.protocol import CompletionRequest

    assert CompletionRequest(prompt="hi", speculative=False).sampling_params().speculative is False
    assert CompletionRequest(prompt="hi").sampling_params().speculative is True
    with pytest.raises(ValidationError, match="speculative"):
        CompletionRequest(prompt="hi", speculative="no")
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative=1)
    families = {f.name: f for f in EngineStatsCollector(spec.stats, lambda: 0).collect()}
    for name in ("proposed_tokens", "accepted_tokens", "emitted_tokens", "acceptance_rate", "mean_accepted_length"):
        assert f"jaxserve_spec_{name}" in families, name
    assert families["jaxserve_spec_proposed_tokens"].samples[0].value == spec.spec.counters.proposed


def _tiny_vocab_llama(path, *, seed=0, noise=0.0):
    """A one-layer llama over a 12-token vocabulary, no tokenizer; weights drawn wide (std 0.5) so that its
    next-token distribution is neither flat nor one-hot. ``noise`` perturbs every weight: a draft that agrees
    with the target only in part."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.5, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def test_engine_sampling_keeps_the_target_distribution_with_a_draft_model(tmp_path):
    """The whole engine at temperature 1 with a partly agreeing draft model: per-position token frequencies
    over 2000 seeded requests match those of the same engine decoding one token at a time (two-sample
    chi-square, p > 0.001), while the same statistic rejects decoding at temperature 0.85. The first output
    token comes from the prefill's sampler either way, so positions 2..6 are compared."""
    from scipy.stats import chi2_contingency

    target = _tiny_vocab_llama(tmp_path / "target")
    draft = _tiny_vocab_llama(tmp_path / "draft", noise=0.1)
    # 32 sequences a step (the 2000 requests in ~4x fewer steps than 8 a step: the host's per-step work is this
    # test's time); each needs at most 4 pages.
    engine = Engine(EngineConfig(model=target, page_size=PAGE, num_pages=160, max_model_len=16, max_num_seqs=32,
                                 max_num_batched_tokens=128, seed=0, compilation_cache_dir=None, warmup=False,
                                 skip_tokenizer_init=True,
                                 speculative_config={"model": draft, "num_speculative_tokens": 2,
                                                     "disable_by_batch_size": 64}))
    n, m, vocab = 2000, 6, 12

    def sample(temperature=1.0, speculative=True):
        got = run(engine, [(f"r{i}", [3, 7, 5], SamplingParams(max_tokens=m, temperature=temperature, seed=i,
                                                                ignore_eos=True, speculative=speculative))
                           for i in range(n)])
        tokens = np.array([got[f"r{i}"].outputs[0].token_ids for i in range(n)])
        return np.stack([np.bincount(tokens[:, j], minlength=vocab) for j in range(1, m)]).ravel()

    def pvalue(a, b):
        table = np.stack([a, b])
        return chi2_contingency(table[:, table.sum(0) > 0]).pvalue

    spec = sample()
    stats = engine.stats()
    assert 0.2 < stats["spec_acceptance_rate"] < 0.95, stats
    plain = sample(speculative=False)
    assert engine.stats()["spec_proposed_tokens"] == stats["spec_proposed_tokens"]
    assert pvalue(spec, plain) > 1e-3
    assert pvalue(spec, sample(temperature=0.85, speculative=False)) < 1e-3


# ---- draft model ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A one-layer llama sharing the tiny tokenizer's vocabulary: a draft for the families it cannot copy."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("draft"), tokenizer=train_tokenizer(),
                            num_hidden_layers=1, seed=3)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_draft_model_greedy_matches_transformers(family, tmp_path, small_draft):
    """A target with global attention and one with a windowed pool beside global layers, each with a draft
    model: itself where it can be one (every draft accepted: the bonus path and the draft's one-token lag), else
    a one-layer llama (most drafts rejected). Chunked prefill: the 20-token prompt takes two steps."""
    from tiny import hf_greedy, hf_model

    target = build_tiny_model(family, tmp_path / family, tokenizer=train_tokenizer())
    draft = small_draft if family == "gemma3" else target
    engine = Engine(_config(target, warmup=False, max_num_seqs=2, max_num_batched_tokens=16, num_pages=30,
                            speculative_config={"model": str(draft), "num_speculative_tokens": 3}))
    prompts = [list(range(3, 23)), [5, 6, 7, 8, 5, 6, 7, 8, 5]]
    got = run(engine, [(f"p{i}", p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
                       for i, p in enumerate(prompts)])
    hf = hf_model(target)
    for i, p in enumerate(prompts):
        assert got[f"p{i}"].outputs[0].token_ids == hf_greedy(hf, p, 12), (family, i)
    c = engine.spec.counters
    assert c.proposed > 0
    if draft == target:
        assert c.accepted == c.proposed


def test_an_engine_with_a_draft_model_reads_each_config_once(model_dir, small_draft, monkeypatch):
    """The engine reads the target's and the draft's config.json once each and hands them down: the executor,
    its loader, the pool's sizing (num_pages unset: sized from both models' bytes per page) and the draft's
    proposer read none again."""
    from collections import Counter
    from pathlib import Path

    from jaxserve.models.config import ModelConfig

    reads = Counter()
    read = ModelConfig.from_pretrained.__func__

    def counted(cls, path):
        reads[Path(path).resolve()] += 1
        return read(cls, path)

    monkeypatch.setattr(ModelConfig, "from_pretrained", classmethod(counted))
    engine = Engine(_config(model_dir, warmup=False, num_pages=None, max_num_seqs=2, max_num_batched_tokens=16,
                            speculative_config={"model": str(small_draft), "num_speculative_tokens": 3}))
    assert engine.executor.drafter is not None
    assert reads == {Path(model_dir).resolve(): 1, Path(small_draft).resolve(): 1}


@pytest.mark.quick
def test_grpc_speculative_field_reaches_sampling_params():
    from jaxserve.server.protos import jaxserve_pb2 as pb
    from jaxserve.server.grpc_api import sampling_params_from_proto

    assert sampling_params_from_proto(pb.SamplingParams(speculative=False)).speculative is False
    assert sampling_params_from_proto(pb.SamplingParams()).speculative is True


# ---- every family ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


# What differs between families in a verify step (several drafted tokens per sequence through the target) is the
# head layout and window: the pages it reads and writes. qwen2, qwen2_moe and mixtral have llama's layout (2 KV
# heads of 16; an MoE MLP takes a verify step's rows as any other rows), qwen3_moe llama_tied_headdim's, qwen3's
# one KV head is llama_tied_headdim's and gemma3's; their models run against transformers in
# test_models_vs_transformers.py and test_moe.py; gpt_oss has gemma2's pattern of windowed and global layers (its
# sinks run in several query rows per sequence in test_attention_sinks.py). deepseek_v3 stands for the
# latent-cache layout (deepseek_v2 shares it).
SPEC_FAMILIES = [f for f in __import__("tiny").FAMILIES
                 if f not in ("qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v2")]


@pytest.mark.parametrize("family", SPEC_FAMILIES)
def test_greedy_identity_on_every_family(family, tmp_path, tokenizer, monkeypatch):
    """A one-layer model of each family (two for gemma) speculating with n-gram drafts replaced by an oracle's (transformers'
    greedy continuation, every third proposal corrupted at its third token): the output is transformers' greedy
    one. The 20-token prompt is prefilled in two chunks beside a decoding sequence."""
    from tiny import hf_greedy, hf_model

    layers = 2 if family.startswith("gemma") else 1  # gemma: a windowed layer and a global one
    target = build_tiny_model(family, tmp_path / family, tokenizer=tokenizer, num_hidden_layers=layers)
    engine = Engine(_config(target, warmup=False, max_num_seqs=2, max_num_batched_tokens=16, num_pages=16,
                            max_model_len=32, speculative_config=NGRAM))
    prompts = [list(range(3, 23)), [5, 6, 7, 8, 5, 6, 7, 8, 5]]
    hf = hf_model(target)
    want = {(f"p{i}", 0): hf_greedy(hf, p, 7) for i, p in enumerate(prompts)}
    oracle = Oracle(engine.spec, want)
    oracle.calls = 2  # the first proposal is a corrupted one: a cut run, then full ones
    monkeypatch.setattr(engine.spec, "propose", oracle)
    got = run(engine, [(f"p{i}", p, SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
                       for i, p in enumerate(prompts)])
    for i in range(len(prompts)):
        assert got[f"p{i}"].outputs[0].token_ids == want[(f"p{i}", 0)], (family, i)
    c = engine.spec.counters
    assert oracle.calls >= 4 and 0 < c.accepted < c.proposed
