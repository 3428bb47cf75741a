"""Decode batches from persistent rows (``jaxserve.executor.decode_rows``): the same arrays as ``StepBatch.build`` over the
scheduler's real plans (joins, finishes, preemption, prefix caching, aborts, pages released behind a window),
with only the changed page-table rows rewritten. Host-only, no jax, no model."""

import random

import numpy as np
import pytest
from test_scheduler import VOCAB, FakeModel, abort, make_config, seq

from jaxserve.executor.batch import StepBatch, bucket
from jaxserve.executor.decode_rows import DecodeRows
from jaxserve.scheduler.plan import ScheduledSequence
from jaxserve.scheduler.scheduler import Scheduler

pytestmark = pytest.mark.quick


def both(rows: DecodeRows, entries, max_seqs: int, pages: int):
    args = ([e.token_ids for e in entries], [e.kv_len for e in entries], [e.page_table for e in entries])
    got = rows.build(*args, [e.seq.seq_id for e in entries], [e.table_version for e in entries],
                     max_seqs=max_seqs, pages_per_seq=pages)
    want = StepBatch.build(*args, num_tokens=max_seqs, max_seqs=max_seqs, pages_per_seq=pages)
    return got, want


def assert_same(got: StepBatch, want: StepBatch):
    for name, a, b in [("token_ids", got.token_ids, want.token_ids), ("logits_indices", got.logits_indices,
                                                                       want.logits_indices),
                       *[(f, getattr(got.md, f), getattr(want.md, f)) for f in
                         ("cu_q_lens", "kv_lens", "page_indices", "num_seqs")]]:
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("seed, window, caching", [(0, None, True), (1, None, False), (2, 6, True)])
def test_decode_rows_match_a_fresh_build_under_random_load(seed, window, caching):
    rng = random.Random(seed)
    cfg = make_config(num_pages=12, page_size=4, max_model_len=40, max_num_seqs=6, max_num_batched_tokens=24,
                      enable_prefix_caching=caching, attention_window=window)
    sched = Scheduler(cfg)
    model = FakeModel(sched)
    rows = DecodeRows()
    systems = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 14))] for _ in range(3)]
    pending, steps, decodes = 40, 0, 0
    while pending or sched.has_unfinished():
        for _ in range(rng.choice([0, 0, 0, 1])):
            if pending:
                pending -= 1
                prompt = rng.choice(systems + [[]]) + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 12))]
                sched.add(seq(f"r{pending}", prompt, max_tokens=rng.randrange(1, 40 - len(prompt) + 1),
                              n=rng.choice([1, 1, 2]), ignore_eos=True))
        out = sched.schedule()
        if out.scheduled and all(e.num_new_tokens == 1 for e in out.scheduled):
            decodes += 1
            assert all(e.table_version >= 0 for e in out.scheduled)
            assert_same(*both(rows, out.scheduled, bucket(len(out.scheduled), 1, 8), cfg.pages_per_seq))
        sched.update(out, model.run(out))
        if rng.random() < 0.03 and sched.running:
            abort(sched, rng.choice(sched.running).request_id)
        steps += 1
        assert steps < 5000
    assert sched.num_preemptions > 0 and decodes > 50


def test_a_steady_batch_rewrites_only_the_rows_that_gained_a_page():
    """8 sequences decoding 12 steps on 4-token pages: each row is written when it first appears and again
    only when its sequence crosses into a new page (every 4 steps), not every step."""
    cfg = make_config(num_pages=64, page_size=4, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64)
    sched = Scheduler(cfg)
    model = FakeModel(sched)
    for i in range(8):
        sched.add(seq(f"r{i}", [1 + i, 2, 3], max_tokens=30, ignore_eos=True))
    sched.update(prefill := sched.schedule(), model.run(prefill))
    rows = DecodeRows()
    for _ in range(12):
        out = sched.schedule()
        assert len(out.scheduled) == 8 and all(e.num_new_tokens == 1 for e in out.scheduled)
        assert_same(*both(rows, out.scheduled, 8, cfg.pages_per_seq))
        sched.update(out, model.run(out))
    assert rows.rows_written == 8 + 8 * 3  # first sight, then tokens 5, 9 and 13 each open a page


def test_entries_without_a_version_are_always_rewritten_and_bad_batches_are_refused():
    sched = Scheduler(make_config())
    s = sched.add(seq("a", [1, 2, 3], max_tokens=5))[0]
    rows = DecodeRows()
    e = ScheduledSequence(s, [3], 3, [5], True)  # no table_version: -1
    assert_same(*both(rows, [e], 1, 4))
    e2 = ScheduledSequence(s, [3], 3, [6], True)  # same sequence, another table, still no version
    got, want = both(rows, [e2], 1, 4)
    assert_same(got, want)
    assert got.md.page_indices[0, 0] == 6 and rows.rows_written == 2
    with pytest.raises(ValueError, match="one new token"):
        rows.build([[1, 2]], [3], [[5]], [s.seq_id], [1], max_seqs=1, pages_per_seq=4)
    with pytest.raises(ValueError, match="pages_per_seq=1"):
        rows.build([[1]], [3], [[5, 6]], [s.seq_id], [7], max_seqs=1, pages_per_seq=1)
    with pytest.raises(ValueError, match="do not fit"):
        rows.build([[1], [2]], [3, 3], [[5], [6]], [1, 2], [1, 1], max_seqs=1, pages_per_seq=4)
