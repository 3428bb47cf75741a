"""Per-slot stop state of a scheduler's live sequences, as host NumPy arrays (host-only: NumPy, no jax).

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

from jaxserve.sequence import Sequence


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
