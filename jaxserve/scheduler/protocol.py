"""What the engine needs of its scheduler(s), as protocols: ``ReplicatedScheduler`` implements both, and
disaggregation's stage objects (``jaxserve.disagg``), which route each sequence to the stage holding it, implement
``RequestScheduler``. And what a scheduler needs of the speculation planner it is built with (``DraftPlanner``,
implemented by ``jaxserve.spec_decode.planner.SpecPlanner``).

The engine keeps a request's bookkeeping (add, look up, finish, count) through ``Engine.scheduler``, a
``RequestScheduler``; a step plans, records and recovers through a ``StepScheduler``: the engine's own scheduler
when colocated, each stage's when staged. Host-only: no jax import.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

from jaxserve.scheduler.plan import ReplicatedPlan, UpdateResult
from jaxserve.scheduler.sequence import Sequence


class DraftPlanner(Protocol):
    """Draft tokens for decodes to verify (a ``Scheduler`` asks while it plans a step, and reports what each
    verified run kept)."""

    def active(self, num_decodes: int) -> bool:
        """Whether a step with ``num_decodes`` decodes proposes at all."""
        ...

    def propose(self, seq: Sequence, budget: int) -> list[int]:
        """The draft tokens to verify after ``seq``'s last token this step (at most ``budget``)."""
        ...

    def record(self, proposed: int, accepted: int, emitted: int) -> None:
        """A verified run: ``proposed`` drafts, ``accepted`` of them kept, ``emitted`` tokens appended."""
        ...


class RequestScheduler(Protocol):
    """Requests in and out, and what the engine and the server count of them."""

    def add(self, seq: Sequence) -> list[Sequence]:
        """Queue a new request; its sequences (``n`` of them, ``seq`` first). ValueError naming the field for a
        request that could never run."""
        ...

    def get_request(self, request_id: str) -> list[Sequence]:
        """The request's live sequences, wherever they are."""
        ...

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Finish a sequence for a reason found elsewhere and release what it holds; no-op if finished."""
        ...

    def has_unfinished(self) -> bool:
        ...

    @property
    def num_waiting(self) -> int:
        ...

    @property
    def num_running(self) -> int:
        ...

    @property
    def max_num_running(self) -> int:
        """How many sequences may run at once: ``max_num_seqs`` of every replica of every stage counted in
        ``num_running`` (the server's admission check weighs ``num_running`` against it)."""
        ...

    @property
    def running(self) -> list[Sequence]:
        """The sequences in the batches a step runs (what a step that raised takes down: ``AsyncEngine``)."""
        ...

    def stats(self) -> dict[str, int]:
        ...


class StepScheduler(RequestScheduler, Protocol):
    """A scheduler one step plans, runs and records on (``Engine._step_on``)."""

    def schedule(self) -> ReplicatedPlan:
        ...

    def update(self, plan: ReplicatedPlan, sampled_token_ids: Seq) -> UpdateResult:
        """Record a step whose tokens are on the host (a synchronous step)."""
        ...

    def commit(self, plan: ReplicatedPlan) -> None:
        """Record a launched step before its tokens are known (async scheduling)."""
        ...

    def resolve(self, plan: ReplicatedPlan, token_ids) -> tuple[UpdateResult, list[int]]:
        """Fill in a committed step's tokens; the update and each updated sequence's token."""
        ...

    def drop_cache(self) -> list[Sequence]:
        """The KV cache is lost: every running sequence goes back to recompute; returns them."""
        ...
