"""Scheduler: chunked prefill, budgets, preemption by recomputation, stops, aborts, n > 1, against a fake model.

The fake model's "KV" at position p is a fingerprint of tokens 0..p, computed like attention would: from
the fingerprint at p - 1 read back through the page table, and the token at p. The sampled token is a
function of the last fingerprint. Any scheduling or page-sharing mistake (a wrong page, a shared page
overwritten, a page reused under a different prefix, a skipped or repeated token) changes the generated
tokens, which are compared with plain generation without a scheduler.
"""

import os
import random
import subprocess
import sys

import numpy as np
import pytest

from jaxserve.config.scheduler import SchedulerConfig
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.scheduler import Scheduler
from jaxserve.scheduler.sequence import Sequence, SequenceStatus
from jaxserve.scheduler.window_pool import window_pages_needed

pytestmark = pytest.mark.quick

EOS = 0
VOCAB = 40


FP0, MOD = 17, 1_000_003



def abort(sched, request_id: str) -> list:
    """Finish every live sequence of a request with reason "abort" (what the engine does on an abort)."""
    seqs = sched.get_request(request_id)
    for s in seqs:
        sched.finish(s, "abort")
    return seqs

def extend(fp, token):
    return (fp * 31 + int(token) + 1) % MOD


def fingerprint(tokens):
    fp = FP0
    for t in tokens:
        fp = extend(fp, t)
    return fp


def sample(fp, index):
    return (fp // 7 + 11 * index) % VOCAB


def next_token(context, index=0):
    return sample(fingerprint(context), index)


def reference(prompt, params, max_model_len, index=0):
    """Plain generation, no cache: what every scheduled run must reproduce."""
    tokens, out = list(prompt), []
    while True:
        t = next_token(tokens, index)
        tokens.append(t)
        out.append(t)
        if len(out) > params.min_tokens and (t in params.stop_token_ids or (t == EOS and not params.ignore_eos)):
            return out, "stop"
        if (params.max_tokens is not None and len(out) >= params.max_tokens) or len(tokens) >= max_model_len:
            return out, "length"


class FakeModel:
    def __init__(self, sched):
        self.sched = sched
        cfg = sched.config
        self.ps = cfg.page_size
        self.kv = np.full((cfg.num_pages, cfg.page_size), -1, np.int64)

    def _read(self, table, pos):
        return FP0 if pos < 0 else int(self.kv[table[pos // self.ps], pos % self.ps])

    def run(self, out):
        bm, ps, sampled = self.sched.block_manager, self.ps, []
        for e in out.scheduled:
            assert len(e.page_table) == -(-e.kv_len // ps)
            for j, t in enumerate(e.token_ids):
                pos = e.num_computed_before + j
                page = e.page_table[pos // ps]
                # A sequence aborted after schedule() still has its step run; its pages went back to the pool.
                owners = 0 if e.seq.is_finished else 1
                assert bm.refcount(page) == owners and not bm.is_cached(page), "write into a shared or cached page"
                self.kv[page, pos % ps] = extend(self._read(e.page_table, pos - 1), t)
            if e.needs_sample:
                fp = self._read(e.page_table, e.kv_len - 1)
                assert fp == fingerprint(e.seq.token_ids(0, e.kv_len)), "KV read back is not this sequence's"
                sampled.append(sample(fp, e.seq.index))
            else:
                sampled.append(-1)
        return sampled


def check_step(sched, out, running_before):
    cfg = sched.config
    if out.preempted:  # no admissions right after a preemption
        assert all(e.seq in running_before for e in out.scheduled)
        assert not {e.seq.seq_id for e in out.scheduled} & {s.seq_id for s in out.preempted}
    assert out.num_batched_tokens == sum(e.num_new_tokens for e in out.scheduled) <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= len(sched.running) <= cfg.max_num_seqs
    assert len({e.seq.seq_id for e in out.scheduled}) == len(out.scheduled)
    for e in out.scheduled:
        assert e.seq.status is SequenceStatus.RUNNING
        assert e.num_computed_before == e.seq.num_computed_tokens
        assert e.needs_sample == (e.kv_len == e.seq.num_tokens)
        if e.num_new_tokens > 1 and cfg.long_prefill_token_threshold:
            assert e.num_new_tokens <= cfg.long_prefill_token_threshold
    sched.block_manager.check_invariants()


def step(sched, model):
    running_before = list(sched.running)
    out = sched.schedule()
    check_step(sched, out, running_before)
    res = sched.update(out, model.run(out))
    sched.block_manager.check_invariants()
    return out, res


def make_config(**kw):
    base = dict(num_pages=64, page_size=4, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32)
    return SchedulerConfig(**{**base, **kw})


def seq(rid, prompt, **params):
    return Sequence(rid, prompt, SamplingParams(**params), eos_token_ids=EOS)


# ---- config and admission checks ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, kw",
    [
        ("num_pages", dict(num_pages=0)),
        ("page_size", dict(page_size=0)),
        ("max_num_seqs", dict(max_num_seqs=-1)),
        ("max_model_len", dict(max_model_len=1)),
        ("num_pages", dict(num_pages=15)),  # 15 * 4 < 64: one long sequence could never fit
        ("max_num_batched_tokens", dict(max_num_batched_tokens=4)),  # fewer than max_num_seqs
        ("max_num_batched_tokens", dict(enable_chunked_prefill=False)),  # 32 < max_model_len
        ("long_prefill_token_threshold", dict(long_prefill_token_threshold=-1)),
        ("enable_prefix_caching", dict(enable_prefix_caching=1)),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field, kw):
    with pytest.raises(ValueError, match=f"SchedulerConfig.{field}="):
        make_config(**kw)


def test_add_rejects_requests_that_cannot_fit():
    sched = Scheduler(make_config())
    with pytest.raises(ValueError, match="prompt_token_ids"):
        sched.add(seq("a", range(64)))
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add(seq("b", range(60), max_tokens=5))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        seq("c", [])
    sched.add(seq("d", range(60), max_tokens=4))
    with pytest.raises(ValueError, match="request_id"):
        sched.add(seq("d", range(3)))
    assert sched.num_waiting == 1


# ---- chunked prefill and budgets ------------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_while_decodes_continue():
    sched = Scheduler(make_config(max_num_batched_tokens=8))
    model = FakeModel(sched)
    short = sched.add(seq("short", [1, 2, 3], max_tokens=20, ignore_eos=True))[0]
    step(sched, model)
    long_prompt = list(range(1, 31))
    long = sched.add(seq("long", long_prompt, max_tokens=2, ignore_eos=True))[0]
    chunks = []
    while long.num_output_tokens == 0:
        out, _ = step(sched, model)
        by_seq = {e.seq.request_id: e for e in out.scheduled}
        assert by_seq["short"].num_new_tokens == 1 and by_seq["short"].needs_sample  # a decode every step
        e = by_seq["long"]
        assert e.num_new_tokens == 7 or e.needs_sample  # the budget left after the decode
        assert e.needs_sample == (e.kv_len == 30)
        chunks.append(e.token_ids)
    assert sum(chunks, []) == long_prompt and len(chunks) == 5
    assert short.num_output_tokens == 1 + 5


def test_prefill_chunk_leaves_room_for_decodes_behind_it():
    sched = Scheduler(make_config(max_num_batched_tokens=8))
    model = FakeModel(sched)
    sched.add(seq("d1", [5], max_tokens=30, ignore_eos=True))
    sched.add(seq("d2", [6], max_tokens=30, ignore_eos=True))
    sched.add(seq("p", list(range(1, 41)), max_tokens=1))
    step(sched, model)  # d1, d2 prefill 1 token each, p its first 6
    # A prefilling sequence ahead of decodes (as after a re-admission) must not take their tokens.
    sched.running.sort(key=lambda s: s.request_id != "p")
    out, _ = step(sched, model)
    assert [(e.seq.request_id, e.num_new_tokens) for e in out.scheduled] == [("p", 6), ("d1", 1), ("d2", 1)]


def test_long_prefill_threshold_lets_other_prompts_in():
    sched = Scheduler(make_config(max_num_batched_tokens=16, long_prefill_token_threshold=5))
    model = FakeModel(sched)
    sched.add(seq("a", list(range(1, 30)), max_tokens=1))
    sched.add(seq("b", list(range(1, 30)), max_tokens=1))
    out, _ = step(sched, model)
    assert [(e.seq.request_id, e.num_new_tokens) for e in out.scheduled] == [("a", 5), ("b", 5)]


def test_without_chunking_a_prompt_waits_until_it_fits_whole():
    cfg = make_config(max_num_batched_tokens=64, enable_chunked_prefill=False)
    sched = Scheduler(cfg)
    model = FakeModel(sched)
    sched.add(seq("a", list(range(1, 41)), max_tokens=10, ignore_eos=True))
    sched.add(seq("b", list(range(1, 41)), max_tokens=3))
    out, _ = step(sched, model)
    assert [(e.seq.request_id, e.num_new_tokens) for e in out.scheduled] == [("a", 40)]
    out, _ = step(sched, model)  # 63 tokens left after a's decode but b's 40 (less 36 cached) fit whole
    assert [(e.seq.request_id, e.num_new_tokens, e.needs_sample) for e in out.scheduled] == [
        ("a", 1, True), ("b", 4, True)]


def test_prefix_cache_hit_in_scheduler_skips_cached_tokens():
    sched = Scheduler(make_config())
    model = FakeModel(sched)
    system = list(range(1, 15))  # 3 full pages + 2
    a = sched.add(seq("a", system + [20, 21], max_tokens=2, ignore_eos=True))[0]
    while sched.has_unfinished():
        step(sched, model)
    b = sched.add(seq("b", system + [30, 31, 32], max_tokens=2, ignore_eos=True))[0]
    out, _ = step(sched, model)
    assert b.num_cached_tokens == 12 and out.scheduled[0].token_ids == [13, 14, 30, 31, 32]
    while sched.has_unfinished():
        step(sched, model)
    assert (b.output_token_ids, b.finish_reason) == reference(b.prompt_token_ids, b.sampling_params, 64)
    assert a.finish_reason == "length"
    stats = sched.stats()
    assert stats["prefix_cache_hits"] == 12 and stats["prefix_cache_queries"] == 16 + 17


# ---- preemption -----------------------------------------------------------------------------------------


def test_preemption_takes_the_newest_and_requeues_it_first():
    sched = Scheduler(make_config(num_pages=4, max_model_len=16, max_num_batched_tokens=16))
    model = FakeModel(sched)
    seqs = [sched.add(seq(r, [1, 2, 3], max_tokens=8, ignore_eos=True))[0] for r in "abcd"]
    e = sched.add(seq("e", [4, 5, 6], max_tokens=2))[0]
    step(sched, model)  # a..d prefill into one page each; e waits (no page)
    step(sched, model)  # decodes fill position 3 of each page
    out, _ = step(sched, model)  # a and b need a second page: d, then c, give theirs up
    assert [s.request_id for s in out.preempted] == ["d", "c"]
    assert [e.seq.request_id for e in out.scheduled] == ["a", "b"]
    assert list(sched.waiting) == [seqs[2], seqs[3], e]
    assert all(s.page_table == [] and s.num_computed_tokens == 0 for s in seqs[2:])
    assert sched.num_preemptions == 2
    while sched.has_unfinished():
        step(sched, model)
    for s in seqs + [e]:
        assert (s.output_token_ids, s.finish_reason) == reference(s.prompt_token_ids, s.sampling_params, 16)
    assert seqs[2].num_preemptions >= 1


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("caching, chunking", [(True, True), (False, True), (True, False)])
def test_random_load_on_a_tiny_pool_finishes_every_request_exactly(seed, caching, chunking):
    rng = random.Random(seed)
    cfg = make_config(
        num_pages=12, page_size=4, max_model_len=40, max_num_seqs=6,
        max_num_batched_tokens=24 if chunking else 40,
        enable_prefix_caching=caching, enable_chunked_prefill=chunking,
        long_prefill_token_threshold=rng.choice([0, 9]) if chunking else 0,
    )
    sched = Scheduler(cfg)
    model = FakeModel(sched)
    systems = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 14))] for _ in range(3)]
    pending = 40
    requests, steps = [], 0
    while pending or sched.has_unfinished():
        for _ in range(rng.choice([0, 0, 1, 2])):
            if pending:
                pending -= 1
                prompt = rng.choice(systems + [[]]) + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 12))]
                params = dict(max_tokens=rng.randrange(1, 40 - len(prompt) + 1), n=rng.choice([1, 1, 1, 2]),
                              ignore_eos=rng.random() < 0.5, min_tokens=rng.choice([0, 2]))
                requests.extend(sched.add(seq(f"r{pending}", prompt, **params)))
        out, _ = step(sched, model)
        if rng.random() < 0.03 and sched.running:  # an abort from outside, any moment
            victim = rng.choice(sched.running + list(sched.waiting))
            abort(sched, victim.request_id)
        steps += 1
        assert steps < 5000
    assert sched.num_preemptions > 0
    for s in requests:
        if s.finish_reason == "abort":
            continue
        want = reference(s.prompt_token_ids, s.sampling_params, cfg.max_model_len, s.index)
        assert (s.output_token_ids, s.finish_reason) == want, s
    bm = sched.block_manager
    assert bm.num_used_pages == 0 and bm.num_free_pages == cfg.num_pages
    bm.reset_prefix_cache()
    assert bm.pool.num_free == cfg.num_pages


def test_a_sequence_that_cannot_fit_even_alone_finishes_with_error_instead_of_hanging():
    sched = Scheduler(make_config(num_pages=16))
    model = FakeModel(sched)
    s = sched.add(seq("a", [1, 2, 3, 4], max_tokens=10, ignore_eos=True))[0]
    step(sched, model)
    hog = Sequence("outside", range(100))  # pages held outside the scheduler: only a bug could do this
    sched.block_manager.admit(hog, [], 15 * 4)
    out = sched.schedule()
    assert out.is_empty and s.finish_reason == "error" and not sched.has_unfinished()
    res = sched.update(out, [])
    assert res.finished == [s] and s.page_table == []
    sched.block_manager.free(hog)
    assert sched.block_manager.num_used_pages == 0


# ---- stops, finishes and aborts -------------------------------------------------------------------------


def run_with_tokens(tokens, max_model_len=64, **params):
    """Feed a fixed token stream as the samples of a 3-token prompt; return the finished sequence."""
    sched = Scheduler(make_config(max_model_len=max_model_len))
    s = sched.add(seq("a", [1, 2, 3], **params))[0]
    for t in tokens:
        out = sched.schedule()
        res = sched.update(out, [t])
        if s in res.finished:
            break
    assert sched.block_manager.num_used_pages == 0 or not s.is_finished
    return s


def test_stop_checks():
    s = run_with_tokens([5, EOS, 6])
    assert (s.output_token_ids, s.finish_reason, s.stop_reason) == ([5, EOS], "stop", None)
    assert s.status is SequenceStatus.FINISHED_STOPPED
    s = run_with_tokens([5, EOS, 6], ignore_eos=True, max_tokens=3)
    assert (s.output_token_ids, s.finish_reason, s.status) == ([5, EOS, 6], "length", SequenceStatus.FINISHED_LENGTH)
    s = run_with_tokens([EOS, 9, EOS, EOS, 7], min_tokens=2)  # the stop token does not count toward min_tokens
    assert (s.output_token_ids, s.finish_reason) == ([EOS, 9, EOS], "stop")
    s = run_with_tokens([5, 9, 7, 8], stop_token_ids=(7,))
    assert (s.output_token_ids, s.finish_reason, s.stop_reason) == ([5, 9, 7], "stop", 7)
    s = run_with_tokens([5] * 10, max_tokens=None, max_model_len=8)
    assert (s.num_output_tokens, s.num_tokens, s.finish_reason) == (5, 8, "length")


def test_finish_from_outside_frees_pages_and_drops_the_pending_token():
    sched = Scheduler(make_config())
    s = sched.add(seq("a", [1, 2, 3], max_tokens=10))[0]
    sched.update(sched.schedule(), [5])
    out = sched.schedule()
    sched.finish(s, "stop", stop_reason="</s>")
    res = sched.update(out, [6])
    assert res.updated == [] and s.output_token_ids == [5] and (s.finish_reason, s.stop_reason) == ("stop", "</s>")
    assert sched.block_manager.num_used_pages == 0 and not sched.has_unfinished()
    with pytest.raises(ValueError, match="finish reason"):
        s.set_finished("done")


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "in_flight", "preempted"])
def test_abort_frees_pages_in_any_state(state):
    sched = Scheduler(make_config(num_pages=16, max_num_batched_tokens=8, max_model_len=32))
    model = FakeModel(sched)
    other = sched.add(seq("other", [1, 2], max_tokens=20, ignore_eos=True))[0]
    target = sched.add(seq("t", list(range(1, 21)), max_tokens=5, n=2, ignore_eos=True))
    if state != "waiting":
        step(sched, model)  # target leader prefills its first chunk
    if state in ("decoding", "in_flight", "preempted"):
        while target[1].status is not SequenceStatus.RUNNING or target[1].num_uncomputed_tokens > 1:
            step(sched, model)
    if state == "preempted":
        sched._preempt(sched.running.pop())
        assert target[1].status is SequenceStatus.WAITING
    out = sched.schedule() if state == "in_flight" else None
    assert abort(sched, "t") == target
    assert all(s.finish_reason == "abort" and s.page_table == [] for s in target)
    if out is not None:
        res = sched.update(out, model.run(out))
        assert all(s not in res.updated for s in target)
    sched.block_manager.check_invariants()
    assert sched.get_request("t") == [] and abort(sched, "t") == []
    assert sched.block_manager.num_used_pages == len(other.page_table)
    while sched.has_unfinished():
        step(sched, model)
    assert sched.block_manager.num_used_pages == 0


# ---- n > 1 ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("caching", [True, False])
def test_siblings_share_prompt_pages_and_recompute_the_partial_one(caching):
    sched = Scheduler(make_config(enable_prefix_caching=caching))
    model = FakeModel(sched)
    prompt = list(range(1, 11))  # 2 full pages + 2 tokens
    seqs = sched.add(seq("r", prompt, n=3, max_tokens=6, ignore_eos=True))
    assert [s.index for s in seqs] == [0, 1, 2] and all(s.request_id == "r" for s in seqs)
    out, _ = step(sched, model)
    assert [e.seq for e in out.scheduled] == [seqs[0]]  # siblings wait for the leader's prompt
    first = seqs[0].last_token
    out, _ = step(sched, model)
    assert [(e.seq.index, e.token_ids) for e in out.scheduled] == [(0, [first]), (1, [9, 10]), (2, [9, 10])]
    shared = seqs[0].page_table[:2]
    assert all(s.page_table[:2] == shared for s in seqs)
    assert [sched.block_manager.refcount(p) for p in shared] == [3, 3]
    assert len({s.page_table[2] for s in seqs}) == 3
    while sched.has_unfinished():
        step(sched, model)
    outs = [s.output_token_ids for s in seqs]
    assert outs == [reference(prompt, s.sampling_params, 64, s.index)[0] for s in seqs]
    assert len({tuple(o) for o in outs}) == 3
    assert sched.block_manager.num_used_pages == 0


def test_step_batch_from_output():
    sched = Scheduler(make_config())
    sched.add(seq("a", [1, 2, 3, 4, 5], max_tokens=3))
    sched.add(seq("b", [7, 8], max_tokens=3))
    out = sched.schedule()
    cfg = sched.config
    from jaxserve.executor.batch import StepBatch

    e = out.scheduled
    batch = StepBatch.build([s.token_ids for s in e], [s.kv_len for s in e], [s.page_table for s in e],
                            num_tokens=16, max_seqs=4, pages_per_seq=cfg.pages_per_seq)
    assert batch.token_ids[:7].tolist() == [1, 2, 3, 4, 5, 7, 8]
    assert batch.md.cu_q_lens.tolist() == [0, 5, 7, 7, 7] and batch.md.kv_lens.tolist() == [5, 2, 0, 0]
    assert batch.md.page_indices[0, :2].tolist() == out.scheduled[0].page_table
    assert batch.logits_indices[:2].tolist() == [4, 6]


def test_host_core_imports_without_jax():
    """Host-only modules import no jax: the scheduler, the engine loop and the configuration (so parsing
    flags, ``--help`` included, stays fast)."""
    modules = "jaxserve.scheduler.scheduler, jaxserve.scheduler.replicas, jaxserve.engine.engine, jaxserve.config.engine, jaxserve.server.args"
    code = f"import sys, {modules}; assert not [m for m in sys.modules if m.split('.')[0] == 'jax'], 'jax'"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("window, caching, local", [(2, True, False), (6, False, False), (9, True, False),
                                                    (6, True, True), (3, False, True)])
def test_windowed_model_releases_pages_behind_the_window_and_stays_exact(seed, window, caching, local):
    """Every layer windowed: a running sequence holds only the pages its next query can see (plus the chunk's);
    the fake model reads the previous token's KV, so a page released too early, or a released entry handed to
    the kernels as anything but a page the sequence holds, changes the tokens. Preemption, prefix caching,
    siblings and aborts as in the unwindowed random test. ``local``: windowed and global layers interleaved,
    the windowed ones in a pool of their own (the fake model reads the global table; the windowed pool's tables
    are checked for what they hold and where writes land)."""
    rng = random.Random(seed)
    extra = dict(local_window=window, local_pages=window_pages_needed(window, 4, 6, 24)) if local else \
        dict(attention_window=window)
    cfg = make_config(num_pages=12 if not local else 16, page_size=4, max_model_len=40, max_num_seqs=6,
                      max_num_batched_tokens=24, enable_prefix_caching=caching, **extra)
    sched = Scheduler(cfg)
    model = FakeModel(sched)
    bm = sched.block_manager.windowed if local else sched.block_manager
    systems = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 14))] for _ in range(3)]
    pending, requests, steps = 30, [], 0
    while pending or sched.has_unfinished():
        for _ in range(rng.choice([0, 0, 1, 2])):
            if pending:
                pending -= 1
                prompt = rng.choice(systems + [[]]) + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 12))]
                params = dict(max_tokens=rng.randrange(1, 40 - len(prompt) + 1), n=rng.choice([1, 1, 2]),
                              ignore_eos=rng.random() < 0.5)
                requests.extend(sched.add(seq(f"r{pending}", prompt, **params)))
        running_before = list(sched.running)
        out = sched.schedule()
        check_step(sched, out, running_before)
        for e in out.scheduled:
            table = e.local_page_table if local else e.page_table
            assert bm.pages_held(e.seq) <= -(-(window - 1 + e.num_new_tokens) // 4) + 1
            assert len(table) == len(e.page_table)
            for pos in range(e.num_computed_before, e.kv_len):  # writes land in pages the sequence alone holds
                assert bm.refcount(table[pos // 4]) == 1 and not bm.is_cached(table[pos // 4])
        sched.update(out, model.run(out))
        sched.block_manager.check_invariants()
        if rng.random() < 0.03 and sched.running:
            abort(sched, rng.choice(sched.running).request_id)
        steps += 1
        assert steps < 5000
    assert bm.num_released_pages > 0
    for s in requests:
        if s.finish_reason != "abort":
            assert (s.output_token_ids, s.finish_reason) == reference(s.prompt_token_ids, s.sampling_params,
                                                                      cfg.max_model_len, s.index), s
    for pool in {bm, sched.block_manager.full if local else bm}:
        assert pool.num_used_pages == 0 and pool.num_free_pages == pool.num_pages


def test_replicated_scheduler_counts_running_slots_of_every_replica():
    """A data=2 engine's scheduler may run max_num_seqs sequences per replica: it says so (``max_num_running``,
    also in its stats, which the server's admission check reads), and ``running`` lists every replica's."""
    from jaxserve.scheduler.replicas import ReplicatedScheduler

    sched = ReplicatedScheduler(make_config(max_num_seqs=2), num_replicas=2)
    for i in range(4):
        sched.add(seq(str(i), [1, 2, 3]))
    sched.schedule()
    assert sched.max_num_running == 4 and sched.stats()["max_num_running"] == 4
    assert sched.num_running == 4 and sorted(s.request_id for s in sched.running) == ["0", "1", "2", "3"]
    assert sorted(len(r.running) for r in sched.replicas) == [2, 2]
