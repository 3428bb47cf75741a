"""Continuous batching: which sequences run each step, with how many tokens, in which pages."""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Sequence as Seq

import numpy as np

from jaxserve.config.scheduler import SchedulerConfig
from jaxserve.scheduler.block_hash import BlockHasher
from jaxserve.scheduler.block_manager import BlockManager, PageHolder
from jaxserve.scheduler.plan import DecodeRun, ScheduledSequence, SchedulerOutput, UpdateResult, placeholder
from jaxserve.scheduler.protocol import DraftPlanner
from jaxserve.scheduler.sequence import Sequence, SequenceStatus
from jaxserve.scheduler.slot_state import DecodeSlots, StopSlots
from jaxserve.scheduler.state_pool import StateBlockManager
from jaxserve.scheduler.window_pool import WindowedBlockManager
from jaxserve.text.request_checks import check_fits

__all__ = ["Scheduler"]


class Scheduler:
    """FIFO continuous batching with chunked prefill, prefix caching and preemption by recomputation.

    Each ``schedule`` serves running sequences first, in admission order (a decode token each, or the next
    chunk of an unfinished prefill), then admits waiting sequences while sequence slots, the step's token
    budget and free pages allow. When a running sequence needs a page and none is free, the most recently
    admitted running sequence is preempted: its pages are released and it returns to the front of the
    waiting queue, to be recomputed from prompt + tokens generated so far.

    A request with ``n > 1`` becomes n sequences (``Sequence.make_sibling``). Output 0 prefills the prompt;
    the others wait until it has, then share its full prompt pages by reference and each recompute the
    prompt's last, partial page into a page of their own, so no page is ever written by two sequences.
    """

    def __init__(self, config: SchedulerConfig, *, spec: DraftPlanner | None = None, bulk_decodes: bool = True):
        """``spec``: the speculation planner that proposes draft tokens for decodes (None: no speculation).
        ``bulk_decodes``: plan plain decodes in bulk, as a ``DecodeRun`` (False: one by one, the reference the
        bulk planner must equal)."""
        self.config = config
        self.spec = spec
        self.bulk_decodes = bulk_decodes
        hasher = BlockHasher(config.prefix_caching_hash_algo)
        if config.state_slots:
            self.block_manager = StateBlockManager(config.num_pages, config.state_slots, config.page_size)
        elif config.local_pages:
            self.block_manager = WindowedBlockManager(
                config.num_pages, config.local_pages, config.page_size, window=config.local_window,
                enable_prefix_caching=config.enable_prefix_caching, hasher=hasher)
        else:
            self.block_manager = BlockManager(
                config.num_pages, config.page_size, enable_prefix_caching=config.enable_prefix_caching,
                attention_window=config.attention_window, hasher=hasher,
            )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: preemption takes from the end
        self._requests: dict[str, list[Sequence]] = {}  # live request id -> its sequences
        self._finished_in_schedule: list[Sequence] = []
        self.num_preemptions = 0
        self.stops = StopSlots(config.max_model_len)  # live sequences' stop state, for vectorised stop checks
        self.slots = DecodeSlots(config.pages_per_seq)  # running sequences' tokens, positions, page tables
        # Running sequences changed other than in bulk since their slot was last written: rewritten at the next
        # schedule (finished ones, and preempted ones, which are rewritten when admitted again, are skipped).
        self._stale: list[Sequence] = []
        self._slots_of: tuple[list[Sequence], np.ndarray] = ([], _NO_SLOTS)  # running -> their slots

    # ---- queries ------------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def get_request(self, request_id: str) -> list[Sequence]:
        """The live sequences of a request (empty once all finished)."""
        return list(self._requests.get(request_id, ()))

    def stats(self) -> dict[str, int]:
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_preemptions": self.num_preemptions,
            **self.block_manager.stats(),
        }

    # ---- requests in and out ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> list[Sequence]:
        """Queue a new request; returns its sequences (``sampling_params.n`` of them, ``seq`` first).

        Requests are checked at intake (``jaxserve.text.request_checks``); what this refuses guards the queue
        and the pages for callers that skip it: a sequence that is not new, a request id in use, and (with
        intake's own ``check_fits``, O(1)) a request that could never run within ``max_model_len``.

        Raises:
          ValueError: naming the field.
        """
        if seq.status is not SequenceStatus.WAITING or seq.num_output_tokens or seq.page_table:
            raise ValueError(f"{seq} is not a fresh waiting sequence")
        if seq.request_id in self._requests:
            raise ValueError(f"request_id={seq.request_id!r} is already in use")
        check_fits(seq.num_prompt_tokens, seq.sampling_params.max_tokens, self.config.max_model_len,
                   "prompt_token_ids")
        seqs = [seq] + [seq.make_sibling(i) for i in range(1, seq.sampling_params.n)]
        self._requests[seq.request_id] = seqs
        self.waiting.extend(seqs)
        return list(seqs)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Finish a sequence for a reason found elsewhere (e.g. a stop string) and release its pages.

        A token scheduled for it but not yet passed to ``update`` is discarded.
        """
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self._release(seq)
        seq.set_finished(reason, stop_reason)
        siblings = self._requests.get(seq.request_id, [])
        if seq in siblings:
            siblings.remove(seq)
            if not siblings:
                del self._requests[seq.request_id]

    # ---- hand-over between engines (prefill/decode disaggregation) -----------------------------------------
    def detach(self, seq: Sequence) -> PageHolder:
        """Take a running sequence out of this scheduler without finishing it: another engine continues it. Its
        pages stay held by the returned holder (the caller copies their KV out, then ``block_manager.free``s
        the holder); ``seq`` keeps its tokens and ``num_computed_tokens``, with empty page tables."""
        self.running.remove(seq)
        siblings = self._requests.get(seq.request_id, [])
        if seq in siblings:
            siblings.remove(seq)
            if not siblings:
                del self._requests[seq.request_id]
        self._release(seq)
        holder = PageHolder(seq.seq_id, seq.page_table, seq.local_page_table)
        self.block_manager.hand_over(seq, holder)
        seq.page_table, seq.local_page_table = [], []
        seq.table_version += 1
        seq.status = SequenceStatus.WAITING
        return holder

    def adopt(self, seq: Sequence) -> bool:
        """Run a sequence another engine computed (``detach``): pages for its ``num_computed_tokens`` tokens of
        KV are allocated now (the caller copies the KV into ``seq.page_table``) and it continues from its next
        token. False, with nothing changed, when the pages are not free."""
        bm, computed, cached = self.block_manager, seq.num_computed_tokens, seq.num_cached_tokens
        if seq.status is not SequenceStatus.WAITING or seq.page_table:
            raise ValueError(f"{seq} is not a detached sequence")
        if len(self.running) >= self.config.max_num_seqs or not bm.can_allocate(bm.pages_for(computed + 1)):
            return False
        bm.admit(seq, [], computed + 1)
        seq.num_computed_tokens, seq.num_cached_tokens = computed, cached
        bm.release_behind(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._stale.append(seq)
        self._requests.setdefault(seq.request_id, []).append(seq)
        return True

    def drop_cache(self) -> list[Sequence]:
        """The KV cache's contents are gone (a failed step took it): every running sequence goes back to the
        front of the queue to recompute its tokens, and the prefix cache forgets every page. Returns them."""
        victims = list(reversed(self.running))  # newest first, as preemption takes them
        for seq in victims:
            self.running.remove(seq)
            self._preempt(seq)
        self.block_manager.reset_prefix_cache()
        return victims

    def forget_prefixes(self) -> None:
        """New weights: no KV computed before now is reused by a later admission (``BlockManager.forget_prefixes``;
        the page keys do not depend on the weights, so waiting sequences keep theirs). Running sequences keep the
        KV they have."""
        self.block_manager.forget_prefixes()

    # ---- one step -----------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan the next step (see ``SchedulerOutput``); running sequences first, then admissions."""
        cfg, bm = self.config, self.block_manager
        budget = cfg.max_num_batched_tokens
        plan: list[ScheduledSequence] = []
        preempted: list[Sequence] = []
        run = None
        self._refresh_slots()
        # Prefill chunks leave one token of budget for each decode queued behind them, so decodes keep going.
        bulk = self.bulk_decodes and bool(self.running)
        counts = self._slot_counts() if bulk else _decode_counts(self.running)
        decodes_left = int(counts[0].sum())
        speculating = self.spec is not None and self.spec.active(decodes_left)
        # A decode whose next token fits the pages it holds, in a pool without a window to release behind, needs
        # no page bookkeeping: the common case of a running batch, kept to a few operations per sequence.
        plain_pages = 0 if speculating or type(bm) is not BlockManager or bm.attention_window else cfg.page_size
        if plain_pages and bulk:
            run = self._plan_decode_run(counts, plain_pages, budget)
            if run is not None:
                decodes_left -= len(run)
                budget -= len(run)
        budget, extra_rows = self._plan_running(0 if run is None else len(run), budget, decodes_left, speculating,
                                                plain_pages, plan, preempted)
        if not preempted:  # admitting right after a preemption would only take back the pages just freed
            budget = self._plan_admissions(budget, extra_rows, plan)
        return SchedulerOutput(tuple(plan), tuple(preempted), cfg.max_num_batched_tokens - budget, run)

    def _plan_decode_run(self, counts, plain_pages: int, budget: int) -> DecodeRun | None:
        """The leading running sequences that decode with no page bookkeeping (``plain_pages`` tokens a page), as
        a ``DecodeRun``; None if the first running sequence is not one.

        Such decodes are found with NumPy over the running sequences' slots and planned in bulk, as slot arrays:
        all running sequences when every one decodes, the budget takes them all and the free pages cover one more
        page for each that needs one (nothing is preempted, so growing those first, in order, takes the same
        pages as ``_plan_running`` would); else the leading run of them, ``_plan_running`` taking the rest."""
        bm = self.block_manager
        decoding, num_tokens, num_pages, slots = counts
        fast = decoding & (num_tokens <= num_pages * plain_pages)
        i = min(budget, len(fast) if fast.all() else int(fast.argmin()))
        if i < len(fast) <= budget and decoding.all():
            grows = np.flatnonzero(~fast)
            if len(grows) <= bm.num_free_pages and (num_tokens[grows] <= num_pages[grows] * plain_pages + 1).all():
                for j in grows.tolist():
                    bm.grow(self.running[j], int(num_tokens[j]))
                    self.slots.write_pages(int(slots[j]), self.running[j])
                i = len(fast)
        if not i:
            return None
        mine, sl = self.slots, slots[:i]
        return DecodeRun(self.running[:i], sl, mine.tokens[sl], num_tokens[:i], mine.pages[sl], mine.num_pages[sl],
                         mine.versions[sl])

    def _plan_running(self, i: int, budget: int, decodes_left: int, speculating: bool, plain_pages: int,
                      plan: list[ScheduledSequence], preempted: list[Sequence]) -> tuple[int, int]:
        """Plan the running sequences from the ``i``-th on (a decode token each, drafts to verify, or a prefill
        chunk), preempting the newest ones where pages run out; appends to ``plan`` and ``preempted`` and returns
        (the budget left, the extra logits rows taken by prompts that score their tokens).

        ``decodes_left``: the decodes not planned yet, each of which keeps one token of the budget from the prefill
        chunks ahead of it. A prompt that reports prompt_logprobs needs a logits row per token of its chunk, not
        one: its chunk takes logits rows (at most max_num_seqs per step) from the sequences scheduled with it."""
        cfg, bm = self.config, self.block_manager
        extra_rows = 0
        decode_entry = ScheduledSequence.decode
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens = seq.num_tokens
            if (plain_pages and num_tokens - seq.num_computed_tokens == 1
                    and num_tokens <= len(seq.page_table) * plain_pages):
                decodes_left -= 1
                self._stale.append(seq)
                plan.append(decode_entry(seq, seq.last_token, num_tokens, list(seq.page_table), seq.table_version))
                budget -= 1
                i += 1
                continue
            draft: list[int] = []
            if seq.num_uncomputed_tokens == 1:
                decodes_left -= 1
                if speculating:
                    draft = self._draft(seq, budget - decodes_left - 1)
                n = 1 + len(draft)
            else:
                n = self._chunk(seq.num_uncomputed_tokens, budget - decodes_left)
                if n and scores_prompt(seq):
                    n = min(n, max(1, cfg.max_num_seqs - len(self.running) + 1 - extra_rows))
                    extra_rows += n - 1
                if n == 0:
                    i += 1
                    continue
            kv_len = seq.num_computed_tokens + n
            bm.release_behind(seq)  # pages every layer's window has passed come back before any new one
            decodes_left -= self._make_room(seq, kv_len, i == 0, preempted)
            if seq.status is not SequenceStatus.RUNNING:
                break  # seq was the last running sequence
            bm.grow(seq, kv_len)
            self._stale.append(seq)
            plan.append(self._entry(seq, n, kv_len) if not draft else ScheduledSequence(
                seq, [seq.last_token, *draft], kv_len, BlockManager.readable_table(seq.page_table), True,
                self._verify_table(seq), num_proposed=len(draft)))
            budget -= n
            i += 1
        return budget, extra_rows

    def _verify_table(self, seq: Sequence) -> list[int]:
        """The second table of an entry that verifies drafts; a hybrid's state slot negated: the step reads the
        sequence's recurrent state but does not write it back, and the accepted run is replayed from it next step
        (``_update_speculated``), so rejected drafts never advance the state."""
        table = BlockManager.readable_table(seq.local_page_table)
        return [-s for s in table] if self.config.state_slots else table

    def _draft(self, seq: Sequence, room: int) -> list[int]:
        """Speculation's draft tokens for a decoding sequence (at most ``room``); none where they would need pages
        that are not free: never preempt anyone for a speculation."""
        draft = self.spec.propose(seq, room)
        if draft and not self.block_manager.can_grow(seq, seq.num_computed_tokens + 1 + len(draft)):
            return []
        return draft

    def _make_room(self, seq: Sequence, kv_len: int, first: bool, preempted: list[Sequence]) -> int:
        """Preempt the newest running sequences (appended to ``preempted``) until ``seq`` can grow to ``kv_len``
        tokens, ``seq`` itself last; ``first``: it is the first running sequence. Returns how many of the
        preempted were decodes (their reserved budget tokens are no longer needed)."""
        decodes = 0
        while not self.block_manager.can_grow(seq, kv_len):
            victim = self.running[-1]
            if victim is seq and first:
                # Alone and still short of pages: cannot happen within a valid config; fail loudly, not forever.
                self.finish(seq, "error")
                self._finished_in_schedule.append(seq)
                break
            self.running.pop()
            if victim is not seq and victim.num_uncomputed_tokens == 1:
                decodes += 1
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                break
        return decodes

    def _plan_admissions(self, budget: int, extra_rows: int, plan: list[ScheduledSequence]) -> int:
        """Admit waiting sequences, in order, while sequence slots, the budget and free pages allow (appended to
        ``plan``); returns the budget left."""
        cfg, bm = self.config, self.block_manager
        while self.waiting and budget > 0 and len(self.running) + extra_rows < cfg.max_num_seqs:
            seq = self.waiting[0]
            leader = self._running_leader(seq)
            if leader is not None and self._waits_for_leader(seq, leader):
                break  # keeps FIFO order; the leader is running its prefill, so this resolves
            if seq.adapter is not None and not self._adapter_fits(seq.adapter):
                break  # its adapter would exceed max_loras: it waits (in order) for one of them to finish
            scoring = scores_prompt(seq)
            prefix = [] if scoring else bm.match_prefix(seq, share_with=leader)  # every prompt row is needed
            computed = len(prefix) * cfg.page_size
            n = self._chunk(seq.num_tokens - computed, budget)
            if n and scoring:
                n = min(n, cfg.max_num_seqs - len(self.running) - extra_rows)
            if n == 0 or not bm.can_allocate(bm.pages_for(computed + n) - len(prefix), prefix):
                break
            self.waiting.popleft()
            bm.admit(seq, prefix, computed + n)
            bm.release_behind(seq)  # prefix pages already outside the window are not held
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._stale.append(seq)
            plan.append(self._entry(seq, n, computed + n))
            budget -= n
            if scoring:
                extra_rows += n - 1
        return budget

    def _adapter_fits(self, adapter: str) -> bool:
        """Whether a sequence of ``adapter`` may run with the running ones within ``max_loras`` adapters."""
        running = {s.adapter for s in self.running if s.adapter is not None}
        return adapter in running or len(running) < self.config.max_loras

    def update(self, output: SchedulerOutput, sampled_token_ids: Seq[int]) -> UpdateResult:
        """Record a finished step: one sampled token per entry of ``output.scheduled`` (ignored where
        ``needs_sample`` is false, or where the sequence was aborted/finished since ``schedule``); an entry that
        verified draft tokens gets a list instead: the accepted drafts, then the correction or bonus token."""
        if len(sampled_token_ids) != output.num_entries:
            raise ValueError(
                f"got {len(sampled_token_ids)} sampled tokens for {output.num_entries} scheduled sequences"
            )
        bm = self.block_manager
        updated: list[Sequence] = []
        finished, self._finished_in_schedule = self._finished_in_schedule, []
        maybe = self._stop_candidates(output, sampled_token_ids)
        run, skip = output.run, 0
        if run is not None:
            skip = len(run)
            tokens = np.asarray(sampled_token_ids[:skip], np.int64)
            done = []
            for i, (seq, kv, token) in enumerate(zip(run.seqs, run.kv_lens.tolist(), tokens.tolist())):
                if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens != kv - 1:
                    continue
                done.append(i)
                self._record_token(seq, kv, token, maybe[i], updated, finished)
            # (a finished sequence's slot is free: written whole before anyone reads it again)
            self.slots.decoded(run.slots[done], run.kv_lens[done], tokens[done])
        for i, (entry, token) in enumerate(zip(output.entries, sampled_token_ids[skip:]), skip):
            seq = entry.seq
            if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens != entry.num_computed_before:
                continue
            if entry.num_proposed:
                self._update_speculated(entry, list(token), updated, finished)
                continue
            if not entry.needs_sample:
                seq.num_computed_tokens = entry.kv_len
                bm.register(seq)
                continue
            self._record_token(seq, entry.kv_len, int(token), maybe[i], updated, finished)
        return UpdateResult(updated, finished)

    def _record_token(self, seq: Sequence, kv_len: int, token: int, may_stop: bool, updated: list[Sequence],
                      finished: list[Sequence]) -> None:
        """A step computed ``seq``'s KV up to ``kv_len`` and sampled ``token``: full pages go to the prefix cache,
        the token is appended, and the stop check runs where ``may_stop`` (``_stop_candidates``)."""
        seq.num_computed_tokens = kv_len
        self.block_manager.register(seq)
        seq.append_token(token)
        updated.append(seq)
        stop = self._check_stop(seq) if may_stop else None
        if stop is not None:
            self.finish(seq, *stop)
            finished.append(seq)

    def _update_speculated(self, entry: ScheduledSequence, tokens: list[int], updated: list[Sequence],
                           finished: list[Sequence]) -> None:
        """Roll a verified run back to what was accepted: the KV of the last token and of the accepted drafts
        stays, that of rejected drafts is dropped (length cut, pages past the tokens returned to the pool), and
        the tokens are appended one by one, each checked for a stop, so nothing past a stop is kept."""
        seq, bm = entry.seq, self.block_manager
        accepted = len(tokens) - 1
        # A hybrid's state was not advanced by the verifying step (``_verify_table``): its last token and the
        # accepted drafts are computed again, from that state, as the next step's chunk.
        seq.num_computed_tokens = entry.num_computed_before + (0 if self.config.state_slots else 1 + accepted)
        emitted = 0
        for token in tokens:
            seq.append_token(int(token))
            emitted += 1
            stop = self._check_stop(seq)
            if stop is not None:
                self.finish(seq, *stop)
                finished.append(seq)
                break
        updated.append(seq)
        if not seq.is_finished:
            bm.register(seq)  # full pages of accepted tokens only: num_computed_tokens ends at the accepted run
            bm.shrink(seq, seq.num_tokens)
        if self.spec is not None:
            self.spec.record(entry.num_proposed, accepted, emitted)

    # ---- async scheduling: a step recorded before its tokens are known, then filled in ---------------------
    def commit(self, plan: SchedulerOutput, first_row: int = 0) -> None:
        """Record a launched step before its tokens are known: the KV it computes (full pages go to the prefix
        cache when their tokens are all known), and a placeholder token for each entry it samples
        (``placeholder(row)``, its row in the step; this plan's first entry is row ``first_row``). A decode run's
        slots (``DecodeSlots``) advance in bulk."""
        register, row, run = self.block_manager.register, first_row, plan.run
        if run is not None:
            n = len(run)
            placeholders = placeholder(np.arange(row, row + n, dtype=np.int64))
            for seq, kv, token, ph in zip(run.seqs, run.kv_lens.tolist(), run.tokens.tolist(), placeholders.tolist()):
                seq.num_computed_tokens = kv
                if token >= 0:  # the token fed is known: offer the full pages now (see below)
                    register(seq)
                seq.append_token(ph)
            self.slots.decoded(run.slots, run.kv_lens, placeholders)
            row += n
        for entry in plan.entries:
            seq = entry.seq
            seq.num_computed_tokens = entry.kv_len
            if entry.token_ids[-1] >= 0:
                # Every computed token is known (a prompt chunk, or a decode of a token already read back):
                # offer the full pages now, before a later schedule releases them behind a window.
                register(seq)
            if entry.needs_sample:
                seq.append_token(placeholder(row))
            row += 1

    def resolve(self, plan: SchedulerOutput, token_ids, first_row: int = 0
                ) -> tuple[UpdateResult, list[int]]:
        """Fill in a committed step's tokens (``token_ids``: one per entry of ``plan.scheduled``; this plan's
        first entry is row ``first_row`` of the step), as ``update`` records a synchronous step. Returns the
        update (``updated`` in plan order, finished ones included) and the token each updated sequence got (its
        last token may already be the next step's placeholder).

        The stop checks run over the whole step at once (``StopSlots.candidates``); the exact per-sequence check
        runs only for the rows that may stop. A sequence whose filled token is still its last (no later step
        carries it yet) has its slot rewritten at the next schedule."""
        finished, self._finished_in_schedule = self._finished_in_schedule, []
        updated, tokens = [], []
        token_ids = np.asarray(token_ids)
        if not plan.num_entries:
            return UpdateResult(updated, finished), tokens
        bm, stale = self.block_manager, self._stale
        running, waiting = SequenceStatus.RUNNING, SequenceStatus.WAITING
        maybe = self._stop_candidates(plan, token_ids)
        for i, (seq, kv_len, needs_sample, token) in enumerate(zip(plan.seqs, _kv_lens(plan), _needs_sample(plan),
                                                                    token_ids.tolist())):
            status = seq.status
            if status is not running and status is not waiting:  # finished
                continue
            if needs_sample:
                # Where commit put this step's placeholder; not there any more cannot happen while steps resolve
                # in order.
                if not seq.fill_placeholder(kv_len, placeholder(first_row + i), token):
                    continue
                updated.append(seq)
                tokens.append(token)
                if maybe[i]:
                    stop = self._check_stop(seq, kv_len + 1)
                    if stop is not None:
                        self.finish(seq, *stop)
                        seq.drop_placeholder()
                        finished.append(seq)
                        continue
                if seq.num_tokens == kv_len + 1:
                    stale.append(seq)
            if status is running:  # every computed token is known now: full pages are shared
                bm.register(seq)
        return UpdateResult(updated, finished), tokens

    # ---- helpers ------------------------------------------------------------------------------------------
    def _stop_candidates(self, output: SchedulerOutput, sampled_token_ids) -> list[bool]:
        """Which entries' sampled tokens may stop their sequences (``StopSlots.candidates``); a sampled entry
        ends at ``kv_len + 1`` tokens (a speculated entry's run is checked token by token, not here)."""
        entries, run = output.entries, output.run
        n, skip = len(entries), 0 if run is None else len(run)
        kv = np.fromiter([e.kv_len for e in entries], np.int64, n)
        slots = self.stops.slots([e.seq for e in entries])
        tokens = np.fromiter([-1 if e.num_proposed else t for e, t in zip(entries, sampled_token_ids[skip:])],
                             np.int64, n)
        if run is not None:
            kv, slots = np.concatenate([run.kv_lens, kv]), np.concatenate([run.slots, slots])
            tokens = np.concatenate([np.asarray(sampled_token_ids[: len(run)], np.int64), tokens])
        if not len(kv):
            return []
        return self.stops.candidates(slots, kv + 1, tokens).tolist()

    def _refresh_slots(self) -> None:
        """Rewrite the slots of the running sequences changed other than in bulk (``DecodeSlots``)."""
        running, slot = SequenceStatus.RUNNING, self.stops.slot
        for seq in self._stale:
            if seq.status is running:
                self.slots.write(slot(seq), seq)
        self._stale = []

    def _slot_counts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``_decode_counts`` read from the running sequences' slots, and those slots (i64[n])."""
        seqs, slots = self._slots_of
        if seqs != self.running:  # (identity first: a list comparison of the same objects is a pointer walk)
            seqs, slots = list(self.running), self.stops.slots(self.running)
            self._slots_of = seqs, slots
        mine = self.slots
        num_tokens = mine.num_tokens[slots]
        return num_tokens - mine.computed[slots] == 1, num_tokens, mine.num_pages[slots], slots

    def _release(self, seq: Sequence) -> None:
        """The sequence leaves: its slot is free (and the running slots are looked up again)."""
        self.stops.release(seq)
        self._slots_of = ([], _NO_SLOTS)

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens of a prefill of ``remaining`` tokens to run now, given ``budget``; 0 means wait."""
        if budget <= 0:
            return 0
        if not self.config.enable_chunked_prefill:
            return remaining if remaining <= budget else 0
        if self.config.long_prefill_token_threshold:
            budget = min(budget, self.config.long_prefill_token_threshold)
        return min(remaining, budget)

    def _entry(self, seq: Sequence, n: int, kv_len: int) -> ScheduledSequence:
        tokens = seq.token_ids(kv_len - n, kv_len)
        return ScheduledSequence(seq, tokens, kv_len, BlockManager.readable_table(seq.page_table),
                                 kv_len == seq.num_tokens, BlockManager.readable_table(seq.local_page_table),
                                 table_version=seq.table_version)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # Victims are taken newest first, so pushing each to the front keeps admission order.
        self.waiting.appendleft(seq)

    @staticmethod
    def _running_leader(seq: Sequence) -> Sequence | None:
        lead = seq.leader
        return lead if lead is not None and lead.status is SequenceStatus.RUNNING else None

    def _waits_for_leader(self, seq: Sequence, leader: Sequence) -> bool:
        """A fresh sibling holds back until its leader has computed the full pages it can share."""
        if seq.num_output_tokens:
            return False
        shareable = (seq.num_prompt_tokens - 1) // self.config.page_size * self.config.page_size
        return leader.num_computed_tokens < shareable

    def _check_stop(self, seq: Sequence, num_tokens: int | None = None) -> tuple[str, int | None] | None:
        """Whether the sequence stops at its last token, or (async scheduling, where a token of the next step may
        already be appended) at its first ``num_tokens`` tokens."""
        n = seq.num_tokens if num_tokens is None else num_tokens
        sp, token, num_output = seq.sampling_params, seq.token_ids(n - 1, n)[0], n - seq.num_prompt_tokens
        # Stop tokens count only after min_tokens others, matching a sampler that masks them until then.
        if num_output > sp.min_tokens:
            if token in sp.stop_token_ids:
                return "stop", token
            if not sp.ignore_eos and token in seq.eos_token_ids:
                return "stop", None
        if sp.max_tokens is not None and num_output >= sp.max_tokens:
            return "length", None
        if n >= self.config.max_model_len:
            return "length", None
        return None


_NO_SLOTS = np.zeros(0, np.int64)
_NUM_TOKENS, _COMPUTED, _PAGE_TABLE = (operator.attrgetter(a) for a in ("num_tokens", "num_computed_tokens",
                                                                             "page_table"))


def _kv_lens(plan: SchedulerOutput) -> list[int]:
    head = [] if plan.run is None else plan.run.kv_lens.tolist()
    return head + [e.kv_len for e in plan.entries]


def _needs_sample(plan: SchedulerOutput) -> list[bool]:
    head = [] if plan.run is None else [True] * len(plan.run)
    return head + [e.needs_sample for e in plan.entries]


def _decode_counts(running: list[Sequence]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """bool[n]: whether each running sequence decodes (one uncomputed token); i64[n]: its tokens; i64[n]: the
    pages of its page table."""
    n = len(running)
    num_tokens = np.fromiter(map(_NUM_TOKENS, running), np.int64, n)
    computed = np.fromiter(map(_COMPUTED, running), np.int64, n)
    num_pages = np.fromiter(map(len, map(_PAGE_TABLE, running)), np.int64, n)
    return num_tokens - computed == 1, num_tokens, num_pages


def scores_prompt(seq: Sequence) -> bool:
    """Whether the sequence still has prompt tokens whose logprobs it reports (``prompt_logprobs``; output 0 of
    the request only: its siblings share its prompt)."""
    return (seq.sampling_params.prompt_logprobs is not None and seq.index == 0
            and seq.num_computed_tokens < seq.num_prompt_tokens - 1)
