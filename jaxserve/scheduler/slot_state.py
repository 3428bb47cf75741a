"""Per-slot state of a scheduler's live sequences, as host NumPy arrays (host-only: NumPy, no jax): their stop
state (``StopSlots``) and, for the running ones, what a decode step reads (``DecodeSlots``).

Each step's read-back asks, for every sequence that got a token, whether it stops there: a stop token id or an EOS
(counted only after ``min_tokens`` outputs, unless ``ignore_eos``), ``max_tokens``, or ``max_model_len``. What
that check reads about a sequence never changes while it lives (its prompt length and sampling parameters), so
``StopSlots`` writes it once, into a slot of a few arrays, when the sequence is first seen, and frees the slot when
it finishes or leaves. A step's check is then a handful of NumPy operations over the step's rows (``candidates``);
Python runs the exact per-sequence check (``Scheduler._check_stop``) only for the rows it flags, which are a
superset of the rows that stop.
"""

from __future__ import annotations

import numpy as np

from jaxserve.scheduler.sequence import Sequence


class StopSlots:
    """Stop state by slot: ``end[s]`` (the token count at which slot ``s``'s sequence stops by length),
    ``after[s]`` (stop ids count once the token count exceeds it: prompt + ``min_tokens``), ``ids[s]`` (its stop
    token ids, then its EOS ids unless ``ignore_eos``, padded with -1)."""

    def __init__(self, max_model_len: int, slots: int = 64, width: int = 4):
        if slots < 2:
            raise ValueError(f"slots={slots} must be >= 2 (slot 0 is scratch)")
        self.max_model_len = max_model_len
        self._slot_of: dict[int, int] = {}  # seq_id -> slot
        self._free: list[int] = []
        self._used = 1  # slots ever handed out (the arrays' rows below it are or were in use); slot 0 is scratch
        self.end = np.zeros(slots, np.int64)  # i64[S]
        self.after = np.zeros(slots, np.int64)  # i64[S]
        self.ids = np.full((slots, width), -1, np.int64)  # i64[S, K]

    def __len__(self) -> int:
        return len(self._slot_of)

    def slot(self, seq: Sequence) -> int:
        """The sequence's slot, written on first sight; a finished sequence (whose rows nobody reads) that has
        none gets the scratch slot 0, so that no slot is taken that nothing would free."""
        s = self._slot_of.get(seq.seq_id)
        if s is None:
            if seq.is_finished:
                return 0
            s = self._slot_of[seq.seq_id] = self._assign(seq)
        return s

    def slots(self, seqs) -> np.ndarray:
        """i64[len(seqs)]: the slot of each sequence (new ones written first)."""
        slot_of = self._slot_of
        try:
            return np.fromiter([slot_of[s.seq_id] for s in seqs], np.int64, len(seqs))
        except KeyError:
            return np.fromiter([self.slot(s) for s in seqs], np.int64, len(seqs))

    def release(self, seq: Sequence) -> None:
        s = self._slot_of.pop(seq.seq_id, None)
        if s is not None:
            self._free.append(s)

    def candidates(self, slots: np.ndarray, num_tokens: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """bool[n]: the rows that may stop, sequence ``slots[i]`` having ``num_tokens[i]`` tokens, the last of which
        is ``tokens[i]``. Every row that stops is flagged (rows of a finished or changed sequence may be too)."""
        tokens = np.asarray(tokens, np.int64)
        hit = num_tokens >= self.end[slots]
        hit |= (num_tokens > self.after[slots]) & (self.ids[slots] == tokens[:, None]).any(axis=1)
        return hit

    def _assign(self, seq: Sequence) -> int:
        if self._free:
            s = self._free.pop()
        else:
            s = self._used
            self._used += 1
            if s == len(self.end):
                self._grow(rows=2 * len(self.end))
        p = seq.sampling_params
        stop = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(seq.eos_token_ids))
        if len(stop) > self.ids.shape[1]:
            self._grow(width=max(len(stop), 2 * self.ids.shape[1]))
        prompt = seq.num_prompt_tokens
        end = self.max_model_len if p.max_tokens is None else min(prompt + p.max_tokens, self.max_model_len)
        self.end[s], self.after[s] = end, prompt + p.min_tokens
        self.ids[s] = -1
        self.ids[s, : len(stop)] = stop
        return s

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        rows, width = rows or len(self.end), width or self.ids.shape[1]
        end, after, ids = self.end, self.after, self.ids
        self.end, self.after = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
        self.ids = np.full((rows, width), -1, np.int64)
        self.end[: len(end)], self.after[: len(after)] = end, after
        self.ids[: ids.shape[0], : ids.shape[1]] = ids


class DecodeSlots:
    """What a decode step reads about a running sequence, by slot (the scheduler's ``StopSlots`` slot, so both
    are freed together): ``tokens[s]`` its last token id (an async placeholder while the step that samples it is
    in flight), ``num_tokens[s]``, ``computed[s]`` (``num_computed_tokens``), ``pages[s, :num_pages[s]]`` its page
    table (zeros past it) and ``versions[s]`` the ``table_version`` that row is.

    ``Sequence`` stays the truth; these mirror it for the running sequences, so that a step of plain decodes is
    planned, built and committed with NumPy over slot indices. The scheduler writes a slot in place where the
    change is made in bulk (a decode run's tokens and positions at commit or update, a page added in the bulk
    plan) and rewrites it whole (``write``) where a sequence changed otherwise (admission, prefill chunks,
    speculation, a token read back after the step that would have carried it)."""

    def __init__(self, width: int, slots: int = 64):
        self.tokens = np.zeros(slots, np.int64)  # i64[S]
        self.num_tokens = np.zeros(slots, np.int64)  # i64[S]
        self.computed = np.zeros(slots, np.int64)  # i64[S]
        self.num_pages = np.zeros(slots, np.int64)  # i64[S]
        self.versions = np.full(slots, -1, np.int64)  # i64[S]
        self.pages = np.zeros((slots, width), np.int32)  # i32[S, P]

    def write(self, s: int, seq: Sequence) -> None:
        """Slot ``s`` from ``seq``: its tokens, position and page table."""
        if s >= len(self.tokens):
            self._grow(rows=max(s + 1, 2 * len(self.tokens)))
        self.tokens[s], self.num_tokens[s], self.computed[s] = seq.last_token, seq.num_tokens, seq.num_computed_tokens
        self.write_pages(s, seq)

    def write_pages(self, s: int, seq: Sequence) -> None:
        """Slot ``s``'s page-table row from ``seq`` (the arrays widen for a longer table)."""
        table = seq.page_table
        if len(table) > self.pages.shape[1]:
            self._grow(width=max(len(table), 2 * self.pages.shape[1]))
        self.pages[s, : len(table)] = table
        self.pages[s, len(table) :] = 0
        self.num_pages[s], self.versions[s] = len(table), seq.table_version

    def decoded(self, slots: np.ndarray, kv_lens: np.ndarray, tokens: np.ndarray) -> None:
        """Slots ``slots`` computed their tokens up to ``kv_lens`` and got one more token each, ``tokens``."""
        self.computed[slots] = kv_lens
        self.num_tokens[slots] = kv_lens + 1
        self.tokens[slots] = tokens

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        rows, width = rows or len(self.tokens), width or self.pages.shape[1]
        for name in ("tokens", "num_tokens", "computed", "num_pages", "versions"):
            old = getattr(self, name)
            new = np.full(rows, -1 if name == "versions" else 0, np.int64)
            new[: len(old)] = old
            setattr(self, name, new)
        pages = np.zeros((rows, width), np.int32)
        pages[: self.pages.shape[0], : self.pages.shape[1]] = self.pages
        self.pages = pages
