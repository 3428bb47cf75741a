"""Async scheduling: step N+1 is scheduled, built and launched before step N's tokens reach the host.

The engine's loop with async scheduling on, per ``Engine.step()``:

1. ``schedule()`` plans step N+1. A sequence whose step-N token is still on the device looks like any decoding
   sequence: ``commit`` appended a placeholder for it, ``-1 - i`` where ``i`` is its row in step N.
2. The executor launches N+1 with step N's sampled ids (still on the device) as an input: the step replaces
   each negative token id by that row of them (``runner.jit_step``). Nothing waits for the device.
3. ``commit(N+1)``: each entry's ``num_computed_tokens`` advances and sampled entries get a placeholder.
4. ``resolve(N)``: the host reads step N's tokens (waiting only if N is still running, while N+1 is queued
   behind it), fills the placeholders, checks stops, registers full pages with the prefix cache, and the engine
   detokenizes and publishes. All of this overlaps step N+1 on the device.

A sequence that finishes at step N (stop token, stop string, max_tokens, abort) was already in step N+1: the
token N+1 computes for it is never read, its placeholder is dropped (``Sequence.drop_placeholder``) and its
pages go back as they would have. Pages freed while a step that writes them is in flight are safe to hand out
again: steps run on the device in launch order, so a later step's writes come after the earlier step's.

Exactness: every per-step input the host builds depends only on what the scheduler knows before step N's tokens
(token counts for ``min_tokens`` bans and the seeded draw's counter, page tables, positions); penalties read
device-resident counts that the sampler updates itself. Two features need the previous token on the host before
the next step can be built, and a step with a live request using them runs synchronously (the in-flight step is
resolved first): structured output (the next allowed-token mask follows the grammar state after the token) and
prompt logprobs (scored rows are collected on the host). Multi-process runs, whose followers receive whole
batches, always run synchronously.
"""

from __future__ import annotations

import numpy as np

from jaxserve.scheduler.replicas import ReplicatedPlan, ReplicatedScheduler
from jaxserve.scheduler.scheduler import UpdateResult
from jaxserve.scheduler.sequence import SequenceStatus


def placeholder(row):
    """The token id standing for row ``row`` of the previous step's sampled ids (an int, or rows as an array)."""
    return -1 - row


def commit(scheduler: ReplicatedScheduler, plan: ReplicatedPlan) -> None:
    """Record a launched step before its tokens are known: the KV it computes (full pages go to the prefix cache
    when their tokens are all known), and a placeholder token for each entry it samples (its row in the step).
    A decode run's slots (``DecodeSlots``) advance in bulk."""
    row = 0
    for sched, p in zip(scheduler.replicas, plan.plans, strict=True):
        register = sched.block_manager.register
        run = p.run
        if run is not None:
            n = len(run)
            placeholders = placeholder(np.arange(row, row + n, dtype=np.int64))
            for seq, kv, token, ph in zip(run.seqs, run.kv_lens.tolist(), run.tokens.tolist(), placeholders.tolist()):
                seq.num_computed_tokens = kv
                if token >= 0:  # the token fed is known: offer the full pages now (see below)
                    register(seq)
                seq.append_token(ph)
            sched.slots.decoded(run.slots, run.kv_lens, placeholders)
            row += n
        for entry in p.entries:
            seq = entry.seq
            seq.num_computed_tokens = entry.kv_len
            if entry.token_ids[-1] >= 0:
                # Every computed token is known (a prompt chunk, or a decode of a token already read back):
                # offer the full pages now, before a later schedule releases them behind a window.
                register(seq)
            if entry.needs_sample:
                seq.append_token(placeholder(row))
            row += 1


def resolve(scheduler: ReplicatedScheduler, plan: ReplicatedPlan, token_ids) -> tuple[UpdateResult, list[int]]:
    """Fill in a committed step's tokens (one per entry of ``plan.scheduled``), as ``Scheduler.update`` records
    a synchronous step. Returns the update (``updated`` in plan order, finished ones included) and the token each
    updated sequence got (its last token may already be the next step's placeholder).

    The stop checks run over the whole step at once (``StopSlots.candidates``); the exact per-sequence check runs
    only for the rows that may stop. A sequence whose filled token is still its last (no later step carries it
    yet) has its slot rewritten at the next schedule."""
    updated, tokens, finished = [], [], []
    token_ids = np.asarray(token_ids)
    running, waiting = SequenceStatus.RUNNING, SequenceStatus.WAITING
    row = 0
    for sched, p in zip(scheduler.replicas, plan.plans, strict=True):
        finished += sched._finished_in_schedule
        sched._finished_in_schedule = []
        n = p.num_entries
        if not n:
            continue
        bm, stale = sched.block_manager, sched._stale
        mine = token_ids[row : row + n]
        maybe = sched._stop_candidates(p, mine)
        for i, (seq, kv_len, needs_sample, token) in enumerate(zip(p.seqs, _kv_lens(p), _needs_sample(p),
                                                                    mine.tolist())):
            status = seq.status
            if status is not running and status is not waiting:  # finished
                continue
            if needs_sample:
                # Where commit put this step's placeholder; not there any more cannot happen while steps resolve
                # in order.
                if not seq.fill_placeholder(kv_len, placeholder(row + i), token):
                    continue
                updated.append(seq)
                tokens.append(token)
                if maybe[i]:
                    stop = sched._check_stop(seq, kv_len + 1)
                    if stop is not None:
                        sched.finish(seq, *stop)
                        seq.drop_placeholder()
                        finished.append(seq)
                        continue
                if seq.num_tokens == kv_len + 1:
                    stale.append(seq)
            if status is running:  # every computed token is known now: full pages are shared
                bm.register(seq)
        row += n
    for seq in finished:
        scheduler._forget(seq.request_id)
    return UpdateResult(updated, finished), tokens


def _kv_lens(p) -> list[int]:
    head = [] if p.run is None else p.run.kv_lens.tolist()
    return head + [e.kv_len for e in p.entries]


def _needs_sample(p) -> list[bool]:
    head = [] if p.run is None else [True] * len(p.run)
    return head + [e.needs_sample for e in p.entries]
