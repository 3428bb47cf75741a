"""What one step plans and what recording it yields: a sequence's share of the step (``ScheduledSequence``),
plain decodes planned in bulk (``DecodeRun``), a scheduler's plan (``SchedulerOutput``), the replicas' plans
side by side (``ReplicatedPlan``), and the sequences a recorded step updated and finished (``UpdateResult``).

A plan's entries have rows, in order: ``scheduled`` (replica by replica). Under async scheduling a sequence whose
token of a launched step is still on the device holds ``placeholder(row)`` in its place (``Scheduler.commit``);
the next step's compiled program replaces each negative token id by that row of the launched step's sampled ids.
Host-only: no jax import.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxserve.scheduler.sequence import Sequence

__all__ = ["DecodeRun", "ReplicatedPlan", "ScheduledSequence", "SchedulerOutput", "UpdateResult", "placeholder"]


def placeholder(row):
    """The token id standing for row ``row`` of the previous step's sampled ids (an int, or rows as an array)."""
    return -1 - row


@dataclasses.dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step: KV for ``token_ids`` is written at ``kv_len - len(token_ids) ..``."""

    seq: Sequence
    token_ids: list[int]  # a prompt (or recompute) chunk, or the one token to decode
    kv_len: int  # tokens in the cache after this step
    page_table: list[int]  # snapshot of seq.page_table, covering kv_len tokens
    needs_sample: bool  # the step reaches the end of the sequence's tokens, so its last row's logits are sampled
    local_page_table: list[int] = dataclasses.field(default_factory=list)  # the windowed layers' pool, if any
    num_proposed: int = 0  # speculation: the last this-many token_ids are draft tokens the step verifies
    table_version: int = -1  # seq.table_version of the snapshot (-1: not known); the executor reuses rows by it

    @classmethod
    def decode(cls, seq: Sequence, token: int, kv_len: int, page_table: list[int], table_version: int):
        """A decode entry (one token, sampled), built without the frozen dataclass's per-field ``__setattr__``:
        the scheduler makes one per running sequence per step."""
        entry = object.__new__(cls)
        entry.__dict__.update(seq=seq, token_ids=[token], kv_len=kv_len, page_table=page_table, needs_sample=True,
                              local_page_table=[], num_proposed=0, table_version=table_version)
        return entry

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_computed_before(self) -> int:
        return self.kv_len - len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class DecodeRun:
    """Plain decodes planned in bulk, as arrays: sequence ``seqs[i]`` (slot ``slots[i]`` of its scheduler's
    ``DecodeSlots``) feeds ``tokens[i]`` and has ``kv_lens[i]`` tokens of KV after the step, in the pages
    ``pages[i, :num_pages[i]]`` (zeros past them; ``versions[i]`` the table's ``table_version``). Each decodes
    one token, sampled. The arrays are copies taken when the step was planned."""

    seqs: list[Sequence]
    slots: np.ndarray  # i64[n]
    tokens: np.ndarray  # i64[n]
    kv_lens: np.ndarray  # i64[n]
    pages: np.ndarray  # i32[n, P]
    num_pages: np.ndarray  # i64[n]
    versions: np.ndarray  # i64[n]

    def __len__(self) -> int:
        return len(self.seqs)

    def entries(self) -> list[ScheduledSequence]:
        """The run as one ``ScheduledSequence`` per sequence, as the one-by-one planner makes them."""
        pages, widths = self.pages.tolist(), self.num_pages.tolist()
        return [ScheduledSequence.decode(seq, token, kv, row[:w], version) for seq, token, kv, row, w, version in
                zip(self.seqs, self.tokens.tolist(), self.kv_lens.tolist(), pages, widths, self.versions.tolist())]


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan: ``run`` (plain decodes planned in bulk, if any) then ``entries`` run in this order
    (``scheduled`` lists both as entries); ``preempted`` lost their pages this step."""

    entries: tuple[ScheduledSequence, ...]
    preempted: tuple[Sequence, ...]
    num_batched_tokens: int
    run: DecodeRun | None = None

    # Cached: built only when a reader needs entries for the run's sequences (the decode fast paths read ``run``).
    @functools.cached_property
    def scheduled(self) -> tuple[ScheduledSequence, ...]:
        return self.entries if self.run is None else (*self.run.entries(), *self.entries)

    @property
    def num_entries(self) -> int:
        return len(self.entries) + (0 if self.run is None else len(self.run))

    @property
    def seqs(self) -> list[Sequence]:
        """Each entry's sequence, in order."""
        head = [] if self.run is None else list(self.run.seqs)
        return head + [e.seq for e in self.entries]

    @property
    def is_empty(self) -> bool:
        return not self.num_entries


@dataclasses.dataclass(frozen=True)
class UpdateResult:
    """``updated``: sequences that got a token this step (finished ones included); ``finished``: every
    sequence that finished since the previous update, except through ``abort``/``finish`` calls."""

    updated: list[Sequence]
    finished: list[Sequence]


@dataclasses.dataclass(frozen=True)
class ReplicatedPlan:
    """One step's plans, one per replica; ``scheduled`` lists them replica by replica."""

    plans: tuple[SchedulerOutput, ...]

    # Cached: the host loop reads these several times a step, and a plan never changes.
    @functools.cached_property
    def scheduled(self) -> tuple[ScheduledSequence, ...]:
        return self.plans[0].scheduled if len(self.plans) == 1 else tuple(e for p in self.plans for e in p.scheduled)

    @functools.cached_property
    def replicas(self) -> list[int]:
        """The replica of each entry of ``scheduled``."""
        return [r for r, p in enumerate(self.plans) for _ in range(p.num_entries)]

    @property
    def num_entries(self) -> int:
        return sum(p.num_entries for p in self.plans)

    @functools.cached_property
    def seqs(self) -> list[Sequence]:
        """The sequence of each entry of ``scheduled`` (without building the entries of decode runs)."""
        return [seq for p in self.plans for seq in p.seqs]

    @property
    def preempted(self) -> tuple[Sequence, ...]:
        return tuple(s for p in self.plans for s in p.preempted)

    @property
    def num_batched_tokens(self) -> int:
        return sum(p.num_batched_tokens for p in self.plans)

    @property
    def is_empty(self) -> bool:
        return all(p.is_empty for p in self.plans)
