"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5 dense and MoE) against transformers, and their state pool.

The delta rule's chunked form is checked against its token-by-token recurrence (the spec) on packed sequences;
the models' logits against transformers' PyTorch implementation; the engine's greedy tokens (ragged prefill and
decode, chunked prefill continuing a state across steps, n > 1) against transformers' greedy tokens; the state
pool's bookkeeping (admission, preemption, abort) on the host.
"""

import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams
from jaxserve.config.scheduler import SchedulerConfig
from jaxserve.scheduler.scheduler import Scheduler
from jaxserve.scheduler.sequence import Sequence, SequenceStatus

from tiny import HYBRID_FAMILIES, build_tiny_model, hf_greedy, hf_model, train_tokenizer

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def test_chunked_delta_rule_matches_the_recurrence():
    """Three sequences packed in 37 rows (a chunk holds parts of two), one resuming from a state, padding after."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models import gated_deltanet as gd

    rng = np.random.default_rng(0)
    hv, dk, dv, lens = 2, 4, 3, (13, 9, 11)
    t = sum(lens) + 4
    q, k = (gd.l2norm(jnp.asarray(rng.normal(size=(t, hv, dk)), jnp.float32)) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(t, hv, dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.01, 1.0, size=(t, hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, size=(t, hv)), jnp.float32)
    seq = np.repeat(np.arange(3), lens).tolist() + [2] * 4
    valid = np.arange(t) < sum(lens)
    g, beta = g * valid[:, None], beta * valid[:, None]  # rows of no sequence leave the states alone
    init = jnp.asarray(rng.normal(size=(3, hv, dk, dv)), jnp.float32)
    out, final = jax.jit(gd.chunked_delta_rule)(q, k, v, g, beta, jnp.asarray(seq, jnp.int32), init)
    start = 0
    for s, n in enumerate(lens):
        part = slice(start, start + n)
        want_out, want_final = gd.delta_rule_reference(q[part], k[part], v[part], g[part], beta[part], init[s])
        np.testing.assert_allclose(out[part], want_out, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(final[s], want_final, rtol=1e-4, atol=1e-4)
        start += n


@pytest.mark.parametrize("name", sorted(HYBRID_FAMILIES))
def test_logits_match_transformers(name, tokenizer, tmp_path):
    """Whole-sequence logits of every hybrid family (the model code itself, without the engine)."""
    import jax.numpy as jnp

    from jaxserve.models.full_sequence import _one
    from jaxserve.models.loader import load_model

    path = build_tiny_model(name, tmp_path / name, tokenizer=tokenizer)
    model, cfg, _ = load_model(path, "float32")
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, 37)
    want = hf_model(path)(torch.tensor(ids[None])).logits[0].detach().numpy()
    got = np.asarray(_one(model, jnp.asarray(ids)))
    assert want.std() > 0.5, "logits too flat to compare"
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tokenizer):
    path = build_tiny_model("qwen3_5", tmp_path_factory.mktemp("qwen3_5"), tokenizer=tokenizer)
    # 12 pages: two sequences of 30 tokens (8 pages each) do not fit at once, so one is preempted. Two tensor
    # shards: attention heads and the delta-rule states' value heads split over them. Prompt-lookup speculation
    # (steps of at most two decodes): a verifying step must not advance the recurrent state.
    llm = LLM(str(path), dtype="float32", page_size=4, num_pages=12, max_num_seqs=2, max_num_batched_tokens=16,
              max_model_len=48, mesh="tensor=2", num_devices=2, debug_checks=True, warmup=False,
              compilation_cache_dir=None, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                              "prompt_lookup_min": 1, "disable_by_batch_size": 2})
    return llm, hf_model(path)


def test_engine_greedy_matches_transformers(engine):
    """Ragged prefill beside decodes, a prompt longer than the step's budget (its state continued across steps),
    and n = 2 (siblings recompute the prompt): every token as transformers', then every slot and page free."""
    llm, hf = engine
    assert not llm.engine.scheduler.config.enable_prefix_caching
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, llm.model_config.vocab_size, n).tolist() for n in (1, 6, 23)]
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)
    pair = llm.generate(prompts[1], SamplingParams(n=2, max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert [o.token_ids for o in pair.outputs] == [outs[1].outputs[0].token_ids[:6]] * 2
    assert llm.engine.executor.runner.kv_cache[0][1].sharding.spec[1] == "tensor"  # the linear layer's state
    bm = llm.engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_pages == bm.num_pages and bm.stats()["state_slots_used"] == 0


def test_engine_preemption_recomputes_the_state(engine):
    """A preempted sequence gives back its slot and pages; readmitted, it starts its state afresh and recomputes:
    the same tokens as transformers."""
    llm, hf = engine
    before = llm.engine.scheduler.num_preemptions
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, llm.model_config.vocab_size, 20).tolist() for _ in range(2)]
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > before
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)
    assert llm.engine.scheduler.block_manager.stats()["state_slots_used"] == 0


def test_speculation_replays_accepted_tokens_from_the_unadvanced_state(engine):
    """Drafts proposed from a repetitive prompt are verified, some accepted and some rejected; the state is left as
    it was and the accepted run recomputed from it: the tokens are transformers' greedy ones."""
    llm, hf = engine
    spec = llm.engine.spec.counters
    before = dict(spec.stats())
    prompt = [5, 6, 7, 8, 9] * 4
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 16)
    after = spec.stats()
    proposed = after["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert 0 < proposed and accepted < proposed  # verified drafts, some of them rejected


def test_engine_refuses_what_it_cannot_hold(engine):
    llm, _ = engine
    with pytest.raises(ValueError, match="mesh .* is not supported for Qwen3_5ForCausalLM"):
        LLM(llm.engine.executor.info.model_path, dtype="float32", max_model_len=64, warmup=False,
            compilation_cache_dir=None, mesh="data=2", num_devices=2)


def _scheduler(num_pages: int, slots: int = 3) -> Scheduler:
    return Scheduler(SchedulerConfig(num_pages=num_pages, page_size=4, max_model_len=24, max_num_seqs=2,
                                     max_num_batched_tokens=16, enable_prefix_caching=False, state_slots=slots))


def _run(sched: Scheduler, steps: int):
    for _ in range(steps):
        out = sched.schedule()
        sched.update(out, [5] * out.num_entries)
        sched.block_manager.check_invariants()
        for s in sched.running:
            assert len(s.local_page_table) == 1 and s.local_page_table[0] >= 1  # its slot (0 is scratch)


def test_state_slots_follow_admission_preemption_and_abort():
    """A slot is taken with the pages at admission and given back with them at preemption, finish and abort."""
    sched = _scheduler(num_pages=6)
    a, b = (Sequence(r, list(range(3, 10)), SamplingParams(max_tokens=12, ignore_eos=True)) for r in "ab")
    sched.add(a)
    sched.add(b)
    _run(sched, 2)
    bm = sched.block_manager
    assert bm.stats()["state_slots_used"] == 2
    assert a.local_page_table != b.local_page_table
    _run(sched, 6)  # six pages cannot hold both at 12 tokens: the newer is preempted, its slot freed with its pages
    assert sched.num_preemptions >= 1
    assert bm.slots.num_used == len(sched.running) == sum(1 for s in (a, b) if s.status is SequenceStatus.RUNNING)
    sched.finish(a, "abort")
    sched.finish(b, "abort")
    assert bm.slots.num_used == 0 and bm.num_free_pages == bm.num_pages
    assert not a.local_page_table and not b.local_page_table


def test_state_pool_shares_no_prefix_and_refuses_a_hand_over():
    sched = _scheduler(num_pages=8)
    seq = Sequence("x", [3, 4, 5, 6, 7], SamplingParams(max_tokens=2))
    sched.add(seq)
    _run(sched, 1)
    assert sched.block_manager.match_prefix(Sequence("y", [3, 4, 5, 6, 7], SamplingParams()), share_with=seq) == []
    with pytest.raises(ValueError, match="disaggregation"):
        sched.block_manager.hand_over(seq, None)


def test_capacity_sets_the_state_slots_aside(engine):
    """``capacity`` (as the engine) takes one state slot per sequence, plus the scratch slot, off the budget
    before the pages, which hold only the full-attention layers' KV."""
    from jaxserve.executor.kv_cache import bytes_per_token
    from jaxserve.tools.capacity import capacity, weights_per_device
    from sharding.config import MeshConfig

    cfg, mesh = engine[0].model_config, MeshConfig.parse(None)
    c = capacity(cfg, hbm_gb=0.01, dtype="float32", page_size=4, mesh=mesh, utilization=1.0, max_model_len=48,
                 max_num_seqs=4)
    slot = cfg.linear_attention.state_bytes
    assert (c["state_slots"], c["state_bytes_per_slot"]) == (4, slot)
    assert c["kv_bytes_per_token"] == bytes_per_token(cfg, "float32") == 2 * 1 * 2 * 16 * 4  # the one attention layer
    budget = 0.01 * 2**30 - weights_per_device(cfg, "float32", mesh) - 5 * slot
    assert c["pages_per_replica"] == int(budget // (c["kv_bytes_per_token"] * 4))
