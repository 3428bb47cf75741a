"""Data parallelism on the host: one ``Scheduler`` (with its own page pool) per data replica, one host loop.

Each data replica of the mesh owns a block of the KV cache's pages (``sharding.rules``: ``cache_pages`` ->
``data``). A request is placed on one replica when it arrives (the one with the fewest unfinished sequences,
lowest index on ties) and stays there: its sequences (all ``n`` of them, which share prompt pages) are
scheduled by that replica's ``Scheduler`` and get page ids local to its block. Every step, each replica plans
its share within its own limits; the runner lays the shares side by side in one ``MeshBatch``.

Host-only: no jax import.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from jaxserve.config.scheduler import SchedulerConfig
from jaxserve.scheduler.plan import ReplicatedPlan, UpdateResult
from jaxserve.scheduler.protocol import DraftPlanner
from jaxserve.scheduler.scheduler import Scheduler
from jaxserve.scheduler.sequence import Sequence


class ReplicatedScheduler:
    """The ``Scheduler`` interface over ``num_replicas`` schedulers of ``config`` each (limits per replica): the
    engine's ``StepScheduler`` (``jaxserve.scheduler.protocol``)."""

    def __init__(self, config: SchedulerConfig, num_replicas: int = 1, *, spec: DraftPlanner | None = None,
                 bulk_decodes: bool = True):
        """``spec``: the speculation planner every replica proposes drafts with (None: no speculation)."""
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas} must be >= 1")
        self.config = config
        self.replicas = [Scheduler(config, spec=spec, bulk_decodes=bulk_decodes) for _ in range(num_replicas)]
        self._replica_of: dict[str, int] = {}  # live request id -> replica

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def block_manager(self):
        """The block manager of a single-replica engine."""
        if len(self.replicas) != 1:
            raise AttributeError("a data-parallel engine has one block manager per replica: use .replicas[r]")
        return self.replicas[0].block_manager

    # ---- queries ------------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas)

    @property
    def num_running(self) -> int:
        return sum(r.num_running for r in self.replicas)

    @property
    def max_num_running(self) -> int:
        """``max_num_seqs`` per replica: the sequences all replicas may run at once."""
        return self.config.max_num_seqs * len(self.replicas)

    @property
    def running(self) -> list[Sequence]:
        return [s for r in self.replicas for s in r.running]

    @property
    def num_preemptions(self) -> int:
        return sum(r.num_preemptions for r in self.replicas)

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)

    def get_request(self, request_id: str) -> list[Sequence]:
        r = self._replica_of.get(request_id)
        return [] if r is None else self.replicas[r].get_request(request_id)

    def stats(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for r in self.replicas:
            for k, v in r.stats().items():
                total[k] = total.get(k, 0) + v
        total["max_num_running"] = self.max_num_running
        return total

    # ---- requests in and out ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> list[Sequence]:
        if seq.request_id in self._replica_of:
            raise ValueError(f"request_id={seq.request_id!r} is already in use")
        load = [r.num_running + r.num_waiting for r in self.replicas]
        target = load.index(min(load))
        seqs = self.replicas[target].add(seq)
        self._replica_of[seq.request_id] = target
        return seqs

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        r = self._replica_of.get(seq.request_id)
        if r is None:
            return
        self.replicas[r].finish(seq, reason, stop_reason)
        self._forget(seq.request_id)

    def _forget(self, request_id: str) -> None:
        r = self._replica_of.get(request_id)
        if r is not None and not self.replicas[r].get_request(request_id):
            del self._replica_of[request_id]

    def detach(self, seq: Sequence):
        """``Scheduler.detach`` on the sequence's replica; returns (replica, page holder)."""
        r = self._replica_of[seq.request_id]
        holder = self.replicas[r].detach(seq)
        self._forget(seq.request_id)
        return r, holder

    def adopt(self, seq: Sequence) -> int | None:
        """``Scheduler.adopt`` on the least loaded replica that has room (a request's sequences stay on one
        replica); the replica, or None when none has room."""
        r = self._replica_of.get(seq.request_id)
        order = [r] if r is not None else sorted(range(len(self.replicas)), key=lambda i: (
            self.replicas[i].num_running + self.replicas[i].num_waiting, i))
        for i in order:
            if self.replicas[i].adopt(seq):
                self._replica_of[seq.request_id] = i
                return i
        return None

    def drop_cache(self) -> list[Sequence]:
        """Every replica's ``Scheduler.drop_cache``; returns the sequences sent back to recompute."""
        return [seq for r in self.replicas for seq in r.drop_cache()]

    def forget_prefixes(self) -> None:
        """Every replica's ``Scheduler.forget_prefixes``."""
        for r in self.replicas:
            r.forget_prefixes()

    # ---- one step -----------------------------------------------------------------------------------------
    def schedule(self) -> ReplicatedPlan:
        return ReplicatedPlan(tuple(r.schedule() for r in self.replicas))

    def update(self, plan: ReplicatedPlan, sampled_token_ids: Seq[int]) -> UpdateResult:
        """Record a step: one token per entry of ``plan.scheduled`` (replica by replica)."""
        if len(sampled_token_ids) != plan.num_entries:
            raise ValueError(f"got {len(sampled_token_ids)} sampled tokens for {plan.num_entries} scheduled "
                             "sequences")
        updated: list[Sequence] = []
        finished: list[Sequence] = []
        offset = 0
        for replica, p in zip(self.replicas, plan.plans, strict=True):
            n = p.num_entries
            result = replica.update(p, list(sampled_token_ids[offset : offset + n]))
            offset += n
            updated += result.updated
            finished += result.finished
        for seq in finished:
            self._forget(seq.request_id)
        return UpdateResult(updated, finished)

    def commit(self, plan: ReplicatedPlan) -> None:
        """Record a launched step before its tokens are known (``Scheduler.commit`` on each replica, its entries'
        rows counted across the replicas, as the step lays them out)."""
        row = 0
        for replica, p in zip(self.replicas, plan.plans, strict=True):
            replica.commit(p, row)
            row += p.num_entries

    def resolve(self, plan: ReplicatedPlan, token_ids) -> tuple[UpdateResult, list[int]]:
        """Fill in a committed step's tokens, one per entry of ``plan.scheduled`` (``Scheduler.resolve`` on each
        replica). Returns the update and the token each updated sequence got."""
        token_ids = np.asarray(token_ids)
        updated: list[Sequence] = []
        finished: list[Sequence] = []
        tokens: list[int] = []
        row = 0
        for replica, p in zip(self.replicas, plan.plans, strict=True):
            n = p.num_entries
            result, mine = replica.resolve(p, token_ids[row : row + n], row)
            row += n
            updated += result.updated
            finished += result.finished
            tokens += mine
        for seq in finished:
            self._forget(seq.request_id)
        return UpdateResult(updated, finished), tokens
