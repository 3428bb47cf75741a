"""What crosses from the host loop to the compiled steps: one frozen dataclass of NumPy arrays."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """A padded ragged batch for ``prefill_step`` / ``decode_step``.

    Rows ``cu_q_lens[s] : cu_q_lens[s + 1]`` of ``token_ids`` are sequence ``s``'s new tokens (a prompt chunk,
    or one token when decoding); their K/V are written at positions ``kv_lens[s] - q_len .. kv_lens[s] - 1``.
    Padding rows and slots carry zeros (``cu_q_lens`` stays flat past ``num_seqs``).
    """

    token_ids: np.ndarray  # i32[T]
    cu_q_lens: np.ndarray  # i32[S + 1]
    kv_lens: np.ndarray  # i32[S]
    page_indices: np.ndarray  # i32[S, P]
    num_seqs: np.ndarray  # i32[1]
    logits_indices: np.ndarray  # i32[S]  row whose logits each sequence needs (its last new token)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def max_seqs(self) -> int:
        return int(self.kv_lens.shape[0])

    @classmethod
    def build(
        cls,
        chunks: list[list[int]],
        kv_lens: list[int],
        page_tables: list[list[int]],
        *,
        num_tokens: int,
        max_seqs: int,
        pages_per_seq: int,
    ) -> "StepBatch":
        """Pack per-sequence new tokens, cache lengths (after this step) and page tables into padded arrays.

        Raises:
          ValueError: if the sequences do not fit the requested padded shape.
        """
        n = len(chunks)
        total = sum(len(c) for c in chunks)
        if n > max_seqs or total > num_tokens:
            raise ValueError(f"{n} sequences / {total} tokens do not fit a batch of {max_seqs} / {num_tokens}")
        token_ids = np.zeros(num_tokens, np.int32)
        cu = np.zeros(max_seqs + 1, np.int32)
        kv = np.zeros(max_seqs, np.int32)
        pages = np.zeros((max_seqs, pages_per_seq), np.int32)
        logits_indices = np.zeros(max_seqs, np.int32)
        offset = 0
        for s, (chunk, kv_len, table) in enumerate(zip(chunks, kv_lens, page_tables, strict=True)):
            if not chunk:
                raise ValueError(f"sequence {s} has no new tokens")
            if len(table) > pages_per_seq:
                raise ValueError(f"sequence {s} holds {len(table)} pages, more than pages_per_seq={pages_per_seq}")
            token_ids[offset : offset + len(chunk)] = chunk
            offset += len(chunk)
            cu[s + 1] = offset
            kv[s] = kv_len
            pages[s, : len(table)] = table
            logits_indices[s] = offset - 1
        cu[n + 1 :] = offset
        return cls(token_ids, cu, kv, pages, np.array([n], np.int32), logits_indices)
