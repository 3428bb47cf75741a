"""One generation stream: its tokens, sampling parameters, lifecycle status and KV-cache bookkeeping."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Iterable

from jaxserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        # Identity tests, not a set lookup: Enum hashes in Python, and this is asked per sequence per step.
        return self is not SequenceStatus.RUNNING and self is not SequenceStatus.WAITING


_REASON_OF = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}
_STATUS_OF = {reason: status for status, reason in _REASON_OF.items()}
FINISH_REASONS = tuple(_STATUS_OF)

# Ids unique within the process: request ids repeat across the n children of one request.
_seq_ids = itertools.count()


class Sequence:
    """The tokens of one output stream and where their KV lives.

    Tokens are ``prompt_token_ids + output_token_ids``. The first ``num_computed_tokens`` of them have their
    KV in the pages of ``page_table`` (``page_size`` tokens per page, in order). A decoding sequence has
    exactly one uncomputed token: the last sampled one, fed to the model on the next step. After preemption
    ``num_computed_tokens`` drops to 0 and all tokens (prompt and generated) are recomputed as a prefill.

    ``page_table``, ``page_hashes`` and ``num_computed_tokens`` belong to the scheduler and block manager;
    callers read them and never write them. Whoever changes a page table bumps ``table_version``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        sampling_params: SamplingParams | None = None,
        *,
        eos_token_ids: int | Iterable[int] = (),
        arrival_time: float | None = None,
        index: int = 0,
        request_index: int = 0,
        adapter: str | None = None,
        adapter_id: int | None = None,
        adapter_path: str = "",
    ):
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        if isinstance(eos_token_ids, int):
            eos_token_ids = (eos_token_ids,)
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n outputs this is
        self.request_index = request_index  # the engine's arrival counter: seeds unseeded sampling
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.prompt_token_ids = prompt
        self.output_token_ids: list[int] = []
        self._token_ids = list(prompt)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any
        self.page_table: list[int] = []
        self.local_page_table: list[int] = []  # the windowed layers' own pool, for models that interleave them
        self.table_version = 0  # bumped whenever page_table or local_page_table changes (executor/decode_rows.py)
        # vLLM's chained block hash of each full page (jaxserve/scheduler/block_hash.py): tokens, cache_salt, adapter
        self.page_hashes: list[bytes] = []
        self.adapter = adapter  # the LoRA adapter it runs with (None: the base model); part of its pages' keys
        self.adapter_id = adapter_id  # its lora_int_id, and its folder (in the keys, as vLLM's)
        self.adapter_path = adapter_path
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix reused at the latest admission
        self.num_preemptions = 0
        self.leader: Sequence | None = None  # output 0 of the same request, whose prompt pages this one may share

    def __repr__(self) -> str:
        return (
            f"Sequence(request_id={self.request_id!r}, index={self.index}, status={self.status.name}, "
            f"tokens={self.num_prompt_tokens}+{self.num_output_tokens}, computed={self.num_computed_tokens})"
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not in the cache yet: the rest of a prefill, or 1 when decoding."""
        return len(self._token_ids) - self.num_computed_tokens

    @property
    def last_token(self) -> int:
        return self._token_ids[-1]

    @property
    def is_finished(self) -> bool:
        status = self.status
        return status is not SequenceStatus.RUNNING and status is not SequenceStatus.WAITING

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``start .. end - 1`` of prompt + output."""
        return self._token_ids[start:end]

    def append_token(self, token_id: int) -> None:
        """Record one sampled token."""
        self._token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def set_token(self, index: int, token_id: int) -> None:
        """Fill in token ``index`` (of prompt + output), a placeholder appended before its value was known
        (async scheduling: ``-1 - row``, the row of the step that samples it)."""
        self._token_ids[index] = token_id
        self.output_token_ids[index - len(self.prompt_token_ids)] = token_id

    def fill_placeholder(self, index: int, placeholder: int, token_id: int) -> bool:
        """``set_token(index, token_id)`` if token ``index`` is still ``placeholder``; whether it was."""
        if index >= len(self._token_ids) or self._token_ids[index] != placeholder:
            return False
        self.set_token(index, token_id)
        return True

    def drop_placeholder(self) -> None:
        """Remove a trailing placeholder token (a finished sequence's token of a step launched after its last)."""
        if self._token_ids and self._token_ids[-1] < 0 and self.output_token_ids:
            self._token_ids.pop()
            self.output_token_ids.pop()

    def truncate(self, num_output_tokens: int) -> None:
        """Keep only the first ``num_output_tokens`` output tokens (a stop string matched inside a run of
        several tokens that one step emitted); the caller finishes the sequence."""
        del self.output_token_ids[num_output_tokens:]
        del self._token_ids[self.num_prompt_tokens + num_output_tokens:]

    def set_finished(self, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark finished with reason ``stop``, ``length``, ``abort`` or ``error`` (pages are the caller's business)."""
        if reason not in _STATUS_OF:
            raise ValueError(f"finish reason {reason!r} is not one of {FINISH_REASONS}")
        self.status = _STATUS_OF[reason]
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def make_sibling(self, index: int) -> Sequence:
        """Output ``index`` of the same request: same prompt and parameters, its own tokens from here on."""
        if self.num_output_tokens or self.status is not SequenceStatus.WAITING:
            raise ValueError("siblings can only be made from a fresh waiting sequence")
        sib = Sequence(
            self.request_id,
            self.prompt_token_ids,
            self.sampling_params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=self.arrival_time,
            index=index,
            request_index=self.request_index,
            adapter=self.adapter,
            adapter_id=self.adapter_id,
            adapter_path=self.adapter_path,
        )
        sib.leader = self
        return sib
