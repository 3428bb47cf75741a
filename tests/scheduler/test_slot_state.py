"""Per-slot stop state (``jaxserve.scheduler.slot_state``) and the async host loop built on it: the vectorised stop checks
flag exactly the rows the per-sequence check stops, and random runs through ``commit``/``resolve`` (joins, stops,
preemptions, aborts) reproduce plain generation token for token, and decode runs planned and packed from the
slot arrays (``DecodeSlots``, ``DecodeRun``) equal the one-by-one planner's entries and their list-built batch.
Then the engine's offline fast path (only the sequences that finished get a look) against its per-sequence
path, on a tiny model."""

import random

import numpy as np
import pytest
from test_scheduler import VOCAB, FakeModel, abort, extend, fingerprint, make_config, reference, sample, seq

from jaxserve.scheduler.replicas import ReplicatedScheduler
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.scheduler import Scheduler
from jaxserve.scheduler.slot_state import StopSlots


@pytest.mark.quick
def test_candidates_are_exactly_the_rows_that_stop():
    """Random parameters (up to 12 stop ids, so the arrays widen), slots freed and reused, against
    ``Scheduler._check_stop`` on the same sequence, token and length."""
    rng = random.Random(0)
    sched = Scheduler(make_config(max_model_len=40))
    stops = StopSlots(40, slots=2, width=1)  # both widen
    live = []
    for _ in range(300):
        if live and rng.random() < 0.4:
            stops.release(live.pop(rng.randrange(len(live))))
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 10))]
        params = dict(max_tokens=rng.choice([None, rng.randrange(1, 40 - len(prompt) + 1)]),
                      min_tokens=rng.choice([0, 0, 2, 5]), ignore_eos=rng.random() < 0.3,
                      stop_token_ids=tuple(rng.sample(range(VOCAB), rng.choice([0, 1, 3, 12]))))
        s = seq(f"r{len(live)}", prompt, **params)
        for _ in range(rng.randrange(0, 40 - len(prompt))):
            s.append_token(rng.randrange(VOCAB))
        live.append(s)
        rows = [rng.randrange(len(live)) for _ in range(8)]
        seqs = [live[r] for r in rows]
        got = stops.candidates(stops.slots(seqs), np.array([x.num_tokens for x in seqs]),
                               np.array([x.last_token for x in seqs]))
        want = [sched._check_stop(x) is not None for x in seqs]
        assert got.tolist() == want
    for s in live:
        stops.release(s)
    assert len(stops) == 0 and stops.end.shape[0] >= 8 and stops.ids.shape[1] >= 12


def run_fake(model: FakeModel, entries, prev) -> list[int]:
    """``FakeModel.run`` as the device runs an async step: a negative token id is row ``-1 - id`` of ``prev``, the
    previous step's sampled ids."""
    ps, out = model.ps, []
    real = lambda ids: [int(prev[-1 - t]) if t < 0 else t for t in ids]  # noqa: E731
    for e in entries:
        for j, t in enumerate(real(e.token_ids)):
            pos = e.num_computed_before + j
            model.kv[e.page_table[pos // ps], pos % ps] = extend(model._read(e.page_table, pos - 1), t)
        if e.needs_sample:
            fp = model._read(e.page_table, e.kv_len - 1)
            assert fp == fingerprint(real(e.seq.token_ids(0, e.kv_len))), "KV read back is not this sequence's"
            out.append(sample(fp, e.seq.index))
        else:
            out.append(-1)
    return out


@pytest.mark.parametrize("seed, caching", [(0, True), (1, False), (2, True)])
@pytest.mark.quick
def test_async_commit_and_resolve_reproduce_plain_generation(seed, caching):
    rng = random.Random(seed)
    cfg = make_config(num_pages=12, page_size=4, max_model_len=40, max_num_seqs=6, max_num_batched_tokens=24,
                      enable_prefix_caching=caching)
    sched = ReplicatedScheduler(cfg)
    inner = sched.replicas[0]
    model = FakeModel(inner)
    systems = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 14))] for _ in range(3)]
    pending_requests, requests, pending, steps, reasons = 40, [], None, 0, set()
    while pending_requests or sched.has_unfinished() or pending is not None:
        for _ in range(rng.choice([0, 0, 1, 2])):
            if pending_requests:
                pending_requests -= 1
                prompt = rng.choice(systems + [[]]) + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 12))]
                params = dict(max_tokens=rng.choice([None, rng.randrange(1, 40 - len(prompt) + 1)]),
                              n=rng.choice([1, 1, 1, 2]), ignore_eos=rng.random() < 0.5,
                              min_tokens=rng.choice([0, 2]), stop_token_ids=tuple(rng.sample(range(1, VOCAB), 2)))
                requests.extend(sched.add(seq(f"r{pending_requests}", prompt, **params)))
        plan = sched.schedule()
        if plan.is_empty:
            if pending is not None:
                sched.resolve(*pending)
                pending = None
            else:
                sched.update(plan, [])
            continue
        sampled = run_fake(model, plan.scheduled, None if pending is None else pending[1])
        sched.commit(plan)
        if pending is not None:
            update, tokens = sched.resolve(*pending)
            row = {e.seq.seq_id: r for r, e in enumerate(pending[0].scheduled)}
            assert tokens == [int(pending[1][row[s.seq_id]]) for s in update.updated]
        pending = (plan, np.array(sampled, np.int32))
        if rng.random() < 0.03 and inner.running:  # an abort from outside, any moment
            for s in abort(sched, rng.choice(inner.running).request_id):
                s.drop_placeholder()
        inner.block_manager.check_invariants()
        steps += 1
        assert steps < 5000
    assert inner.num_preemptions > 0
    for s in requests:
        reasons.add(s.finish_reason)
        if s.finish_reason == "abort":
            continue
        want = reference(s.prompt_token_ids, s.sampling_params, cfg.max_model_len, s.index)
        assert (s.output_token_ids, s.finish_reason) == want, s
    assert {"stop", "length"} <= reasons
    assert len(inner.stops) == 0  # every slot came back
    bm = inner.block_manager
    assert bm.num_used_pages == 0 and bm.num_free_pages == cfg.num_pages


# ---- the engine's offline fast path -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tiny import build_tiny_model, train_tokenizer

    from jaxserve.engine.engine import Engine
    from jaxserve.config.engine import EngineConfig

    folder = build_tiny_model("llama", tmp_path_factory.mktemp("llama"), tokenizer=train_tokenizer(),
                              num_hidden_layers=1, init_std=0.08)
    return Engine(EngineConfig(model=str(folder), page_size=4, num_pages=48, max_model_len=48, max_num_seqs=8,
                               max_num_batched_tokens=64, skip_tokenizer_init=True, warmup=False, seed=0,
                               compilation_cache_dir=None))


def run_engine(engine, requests, *, final_only: bool, async_on: bool) -> dict:
    engine.final_outputs_only, engine._async = final_only, async_on
    try:
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params)
        results = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
    finally:
        engine.final_outputs_only, engine._async = False, True
    bm = engine.scheduler.block_manager
    assert bm.num_free_pages == bm.num_pages, "pages leaked"
    return {rid: (out.metrics.first_token_time is not None,
                  [(c.token_ids, c.finish_reason, c.stop_reason) for c in out.outputs]) for rid, out in results.items()}


def test_offline_fast_path_matches_the_per_sequence_path(engine):
    """Greedy requests with stop token ids, EOS, min_tokens, max_tokens, max_model_len and n=2: the outputs of
    the offline fast path (async, final outputs only, no text: only finished sequences get a look) equal those
    of the per-sequence paths (every output built; synchronous steps)."""
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    requests = []
    for i in range(12):
        prompt = rng.integers(3, vocab, int(rng.integers(2, 12))).tolist()
        params = SamplingParams(
            temperature=0.0, max_tokens=None if i % 5 == 0 else int(rng.integers(1, 30)), n=2 if i % 4 == 0 else 1,
            stop_token_ids=rng.integers(3, vocab, 6).tolist(), min_tokens=int(rng.integers(0, 4)),
            ignore_eos=bool(i % 3))
        requests.append((f"r{i}", prompt, params))
    fast = run_engine(engine, requests, final_only=True, async_on=True)
    assert fast == run_engine(engine, requests, final_only=False, async_on=True)
    assert fast == run_engine(engine, requests, final_only=True, async_on=False)
    reasons = {c[1] for _, outs in fast.values() for c in outs}
    assert len(fast) == 12 and all(stamped for stamped, _ in fast.values()) and {"stop", "length"} <= reasons
    assert any(c[2] is not None for _, outs in fast.values() for c in outs)  # a stop token id ended one


def plan_key(out):
    return ([(e.seq.request_id, e.seq.index, e.token_ids, e.kv_len, e.page_table, e.needs_sample, e.local_page_table,
              e.num_proposed, e.table_version) for e in out.scheduled],
            [(s.request_id, s.index) for s in out.preempted], out.num_batched_tokens)


@pytest.mark.parametrize("seed, caching", [(3, True), (4, False)])
@pytest.mark.quick
def test_bulk_decode_planning_equals_the_per_sequence_loop(seed, caching):
    """Two schedulers in lockstep on the same random load (joins, page crossings, preemption, aborts), one
    planning plain decodes in bulk, one sequence by sequence: the same plan every step (entries, page tables,
    table versions, preemptions)."""
    rng = random.Random(seed)
    cfg = make_config(num_pages=14, page_size=4, max_model_len=40, max_num_seqs=6, max_num_batched_tokens=24,
                      enable_prefix_caching=caching)
    bulk, loop = Scheduler(cfg), Scheduler(cfg, bulk_decodes=False)
    model = FakeModel(bulk)
    pending_requests, steps, bulk_steps = 40, 0, 0
    while pending_requests or bulk.has_unfinished():
        for _ in range(rng.choice([0, 0, 0, 1])):
            if pending_requests:
                pending_requests -= 1
                prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 14))]
                kw = dict(max_tokens=rng.randrange(1, 40 - len(prompt) + 1), ignore_eos=True, n=rng.choice([1, 1, 2]))
                bulk.add(seq(f"r{pending_requests}", prompt, **kw))
                loop.add(seq(f"r{pending_requests}", prompt, **kw))
        decoding = bulk.running and all(s.num_uncomputed_tokens == 1 for s in bulk.running)
        a, b = bulk.schedule(), loop.schedule()
        assert plan_key(a) == plan_key(b)
        bulk_steps += bool(decoding and len(a.scheduled) == len(bulk.running) and not a.preempted)
        tokens = model.run(a)
        bulk.update(a, tokens)
        loop.update(b, tokens)
        if rng.random() < 0.03 and bulk.running:
            rid = rng.choice(bulk.running).request_id
            abort(bulk, rid)
            abort(loop, rid)
        steps += 1
        assert steps < 5000
    assert bulk.num_preemptions == loop.num_preemptions > 0 and bulk_steps > 20


@pytest.mark.quick
def test_sampling_tensors_are_packed_column_by_column_with_each_slots_values():
    """``SamplingTensors.build`` fills whole columns at once: every slot still carries its own parameters, step,
    penalty row, seed and (before ``min_tokens``) banned ids; padding slots stay neutral."""
    from jaxserve.executor.sampler import SamplingTensors

    rng = random.Random(5)
    params = [SamplingParams(temperature=rng.choice([0.0, 0.7, 1.3]), top_p=rng.choice([1.0, 0.9]),
                             top_k=rng.choice([-1, 0, 5]), min_p=rng.choice([0.0, 0.1]),
                             repetition_penalty=rng.choice([1.0, 1.2]), presence_penalty=rng.choice([0.0, 0.5]),
                             frequency_penalty=rng.choice([0.0, 0.25]), logprobs=rng.choice([None, 0, 3]),
                             min_tokens=rng.choice([0, 4]), stop_token_ids=tuple(rng.sample(range(3, 50), 2)),
                             ignore_eos=rng.random() < 0.5) for _ in range(9)]
    seeds = [rng.randrange(-2**63, 2**64) for _ in params]
    generated = [rng.randrange(0, 8) for _ in params]
    rows = list(range(1, len(params) + 1))
    t = SamplingTensors.build(params, num_slots=12, seeds=seeds, num_generated=generated, eos_token_ids=(1, 2),
                              penalty_rows=rows)
    for s, p in enumerate(params):
        assert (t.temperature[s], t.top_p[s], t.min_p[s]) == (np.float32(p.temperature), np.float32(p.top_p),
                                                             np.float32(p.min_p))
        assert (t.repetition_penalty[s], t.presence_penalty[s], t.frequency_penalty[s]) == (
            np.float32(p.repetition_penalty), np.float32(p.presence_penalty), np.float32(p.frequency_penalty))
        assert (t.top_k[s], t.rng_step[s], t.penalty_rows[s], t.num_logprobs[s]) == (
            max(p.top_k, 0), generated[s], rows[s], p.logprobs or 0)
        word = seeds[s] & ((1 << 64) - 1)
        assert t.rng_key[s].tolist() == [word >> 32, word & 0xFFFFFFFF]
        banned = (p.stop_token_ids + (() if p.ignore_eos else (1, 2))) if generated[s] < p.min_tokens else ()
        assert [int(x) for x in t.banned_ids[s] if x >= 0] == list(banned)
    assert (t.temperature[9:] == 0).all() and (t.top_p[9:] == 1).all() and (t.banned_ids[9:] == -1).all()
    assert t.commit.tolist() == [True] * 9 + [False] * 3
    with pytest.raises(ValueError, match="penalty_rows: slot"):
        SamplingTensors.build([SamplingParams(repetition_penalty=1.1)], num_slots=2, seeds=[0], num_generated=[0])


def assert_slots_mirror(sched: Scheduler):
    """Every running sequence not waiting for a rewrite (``Scheduler._stale``) reads the same in its slot."""
    fresh = [s for s in sched.running if all(s is not t for t in sched._stale)]
    d = sched.slots
    for s, seq in zip(sched.stops.slots(fresh).tolist(), fresh):
        width = int(d.num_pages[s])
        assert (int(d.tokens[s]), int(d.num_tokens[s]), int(d.computed[s]), int(d.versions[s]),
                d.pages[s, :width].tolist(), d.pages[s, width:].any()) == (
            seq.last_token, seq.num_tokens, seq.num_computed_tokens, seq.table_version, seq.page_table, False), seq


def assert_run_batch(out, pages: int):
    """A plan that is one decode run: its batch from the slot arrays equals ``StepBatch.build`` of its entries."""
    from test_decode_rows import assert_same

    from jaxserve.executor.batch import StepBatch, bucket

    run, entries = out.run, out.scheduled
    width = bucket(len(entries), 1, 8)
    got = StepBatch.decode(run.tokens, run.kv_lens, run.pages, run.num_pages, max_seqs=width, pages_per_seq=pages)
    assert_same(got, StepBatch.build([e.token_ids for e in entries], [e.kv_len for e in entries],
                                     [e.page_table for e in entries], num_tokens=width, max_seqs=width,
                                     pages_per_seq=pages))


@pytest.mark.parametrize("seed, caching", [(5, True), (6, False)])
@pytest.mark.quick
def test_async_decode_runs_equal_the_per_sequence_loop(seed, caching):
    """Async scheduling with the decodes planned as slot arrays (``DecodeRun``, ``DecodeSlots``) in lockstep with
    the one-by-one planner, through joins, n=2, page crossings, preemption, stops, aborts mid-flight and runs of
    synchronous steps (the in-flight step resolved first, as the engine falls back): the same plan every step,
    the run's batch built from the arrays equal to the list-built one, the slots mirroring their sequences, and
    every output as plain generation's."""
    rng = random.Random(seed)
    cfg = make_config(num_pages=12, page_size=4, max_model_len=40, max_num_seqs=6, max_num_batched_tokens=24,
                      enable_prefix_caching=caching)
    bulk, loop = ReplicatedScheduler(cfg), ReplicatedScheduler(cfg, bulk_decodes=False)
    inner = bulk.replicas[0]
    model = FakeModel(inner)
    pending_requests, requests, pending, steps, runs, sync = 40, [], None, 0, 0, False
    while pending_requests or bulk.has_unfinished() or pending is not None:
        sync = rng.random() < (0.7 if sync else 0.05)
        if sync and pending is not None:
            for sched in (bulk, loop):
                sched.resolve(*pending[sched is loop])
            pending = None
        for _ in range(rng.choice([0, 0, 1])):
            if pending_requests:
                pending_requests -= 1
                prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 12))]
                kw = dict(max_tokens=rng.choice([None, rng.randrange(1, 40 - len(prompt) + 1)]),
                          n=rng.choice([1, 1, 2]), ignore_eos=rng.random() < 0.5, min_tokens=rng.choice([0, 2]),
                          stop_token_ids=tuple(rng.sample(range(1, VOCAB), 2)))
                requests.extend(bulk.add(seq(f"r{pending_requests}", prompt, **kw)))
                loop.add(seq(f"r{pending_requests}", prompt, **kw))
        a, b = bulk.schedule(), loop.schedule()
        assert plan_key(a.plans[0]) == plan_key(b.plans[0])
        assert_slots_mirror(inner)
        if a.plans[0].run is not None and not a.plans[0].entries:
            runs += 1
            assert_run_batch(a.plans[0], cfg.pages_per_seq)
        if sync or a.is_empty:
            if not a.is_empty:
                tokens = run_fake(model, a.scheduled, None)
                bulk.update(a, tokens)
                loop.update(b, tokens)
            elif pending is not None:
                for sched in (bulk, loop):
                    sched.resolve(*pending[sched is loop])
                pending = None
            else:
                bulk.update(a, [])
                loop.update(b, [])
            continue
        sampled = np.array(run_fake(model, a.scheduled, None if pending is None else pending[0][1]), np.int32)
        bulk.commit(a)
        loop.commit(b)
        if pending is not None:
            got = [sched.resolve(*pending[sched is loop]) for sched in (bulk, loop)]
            assert [([s.request_id for s in u.updated], t, [s.request_id for s in u.finished]) for u, t in got][0] \
                == [([s.request_id for s in u.updated], t, [s.request_id for s in u.finished]) for u, t in got][1]
        pending = ((a, sampled), (b, sampled))
        if rng.random() < 0.03 and inner.running:  # an abort from outside, any moment
            rid = rng.choice(inner.running).request_id
            for sched in (bulk, loop):
                for s in abort(sched, rid):
                    s.drop_placeholder()
        steps += 1
        assert steps < 5000
    assert inner.num_preemptions == loop.num_preemptions > 0 and runs > 20
    for s in requests:
        if s.finish_reason != "abort":
            want = reference(s.prompt_token_ids, s.sampling_params, cfg.max_model_len, s.index)
            assert (s.output_token_ids, s.finish_reason) == want, s
    assert len(inner.stops) == 0 and inner.block_manager.num_free_pages == cfg.num_pages


@pytest.mark.quick
def test_decode_batch_from_arrays_rejects_what_does_not_fit():
    from jaxserve.executor.batch import StepBatch

    tokens, kv, pages = np.array([5, 6]), np.array([3, 9]), np.array([[1, 0, 0], [2, 3, 4]], np.int32)
    with pytest.raises(ValueError, match="do not fit"):
        StepBatch.decode(tokens, kv, pages, np.array([1, 3]), max_seqs=1, pages_per_seq=4)
    with pytest.raises(ValueError, match="pages_per_seq=2"):
        StepBatch.decode(tokens, kv, pages, np.array([1, 3]), max_seqs=2, pages_per_seq=2)
    with pytest.raises(ValueError, match="kv_lens"):
        StepBatch.decode(tokens, kv[:1], pages, np.array([1, 3]), max_seqs=2, pages_per_seq=4)
