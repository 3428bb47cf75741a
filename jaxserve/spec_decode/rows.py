"""The logits rows a speculative step verifies (host, NumPy): for a sequence that runs ``[last, d_1 .. d_k]``,
row ``j`` (< k) of its chunk scores draft ``d_{j+1}`` and its last row gives the bonus token when every draft is
accepted. The chunk's last row is the entry's own logits row; the k others take free rows from the top of the
step's (widened) ``logits_indices``, where prompt logprobs' rows, taken from the bottom, never reach."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SpecRows:
    """The speculating entries of one step, padded to ``num_slots`` (the verifier's compiled width)."""

    entries: list[int]  # index in the plan of each speculating entry, slot order
    rows: np.ndarray  # i32[E, K + 1]  logits row of each chunk row; past a sequence's drafts: its own row
    drafts: np.ndarray  # i32[E, K]  -1 past a sequence's drafts
    num_drafts: np.ndarray  # i32[E]

    @classmethod
    def add_rows(cls, entries, logits_indices: np.ndarray, k: int, num_slots: int) -> "SpecRows | None":
        """Set the draft rows into ``logits_indices`` (i32[L]) and list them; None if no entry speculates."""
        spec = [i for i, e in enumerate(entries) if e.num_proposed]
        if not spec:
            return None
        if len(spec) > num_slots:
            raise ValueError(f"{len(spec)} speculating sequences do not fit {num_slots} verifier slots")
        rows = np.zeros((num_slots, k + 1), np.int32)
        drafts = np.full((num_slots, k), -1, np.int32)
        num = np.zeros(num_slots, np.int32)
        free = logits_indices.shape[0] - 1
        for slot, i in enumerate(spec):
            e = entries[i]
            kp = e.num_proposed
            if kp > k:
                raise ValueError(f"entry {i} proposes {kp} tokens, more than num_speculative_tokens={k}")
            last = int(logits_indices[i])
            for j in range(kp):
                if free < len(entries):
                    raise ValueError("speculative rows do not fit the step's logits rows")
                logits_indices[free] = last - kp + j
                rows[slot, j] = free
                free -= 1
            rows[slot, kp:] = i
            drafts[slot, :kp] = e.token_ids[1:]
            num[slot] = kp
        return cls(spec, rows, drafts, num)
