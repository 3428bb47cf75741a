"""Decode batches from host arrays that live across steps (host-only: NumPy, no jax).

A running batch changes little from one decode step to the next: the same sequences, each one token further, and
only a sequence that crosses into a new page (one in ``page_size`` steps), or joins, finishes or is preempted,
changes its page table. ``DecodeRows`` keeps one ``[slots, pages]`` page-table array per decode bucket and, each
step, rewrites only the rows whose sequence or table changed since that array last held them. Which rows changed
is found with NumPy over two small per-row keys, the sequence id and its ``table_version`` (bumped by the block
manager on every change of the sequence's page tables), not by flattening every table into a fresh array.
The row index of a sequence is its position in the step (entry order), as ``StepBatch.build`` lays it out, so
the result is the same batch, array for array (``tests/executor/test_decode_rows.py`` checks it against
``StepBatch.build`` over random runs).
"""

from __future__ import annotations

import numpy as np

from jaxserve.executor.batch import StepBatch
from jaxserve.models.attention import AttentionMetadata


class _Bucket:
    """The persistent arrays of one decode shape (``slots`` rows of ``width`` pages)."""

    def __init__(self, slots: int, width: int):
        self.pages = np.zeros((slots, width), np.int32)  # i32[S, P]  row s: the table of the sequence in slot s
        self.seq_ids = np.full(slots, -1, np.int64)  # the sequence each row holds (-1: a zero row)
        self.versions = np.full(slots, -1, np.int64)  # that sequence's table_version when its row was written
        self.cu_q_lens = np.arange(slots + 1, dtype=np.int32)  # decode: one row per sequence, rows in order
        self.logits_indices = np.arange(slots, dtype=np.int32)


class DecodeRows:
    """Builds decode ``StepBatch`` es (one row per sequence) reusing the previous steps' page-table rows.

    Each sequence comes with a key, its id and its ``table_version``; a negative version (not known) always gets
    its row rewritten.
    """

    def __init__(self) -> None:
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self.rows_written = 0  # page-table rows rewritten over the object's life (tests, benchmarks)

    def build(self, chunks: list[list[int]], kv_lens: list[int], page_tables: list[list[int]], seq_ids: list[int],
              versions: list[int], *, max_seqs: int, pages_per_seq: int) -> StepBatch:
        """``StepBatch.build`` of a decode step (one new token per sequence, ``max_seqs`` rows and slots).

        Raises:
          ValueError: if the sequences do not fit the shape or one has other than one new token.
        """
        n = len(chunks)
        if n > max_seqs:
            raise ValueError(f"{n} sequences do not fit a decode batch of {max_seqs}")
        if len(kv_lens) != n or len(page_tables) != n or len(seq_ids) != n or len(versions) != n:
            raise ValueError(f"{n} chunks but {len(kv_lens)} kv_lens, {len(page_tables)} page tables, "
                             f"{len(seq_ids)} sequence ids and {len(versions)} table versions")
        if sum(map(len, chunks)) != n:
            raise ValueError("a decode batch takes exactly one new token per sequence")
        b = self._buckets.get((max_seqs, pages_per_seq))
        if b is None:
            b = self._buckets[max_seqs, pages_per_seq] = _Bucket(max_seqs, pages_per_seq)
        ids = np.fromiter(seq_ids, np.int64, n)
        vers = np.fromiter(versions, np.int64, n)
        stale = np.flatnonzero((ids != b.seq_ids[:n]) | (vers != b.versions[:n]) | (vers < 0))
        for i in stale.tolist():
            table = page_tables[i]
            if len(table) > pages_per_seq:
                b.seq_ids[i] = -1  # (the row is left half written: never reused without a rewrite)
                raise ValueError(f"sequence {i} holds {len(table)} pages, more than pages_per_seq={pages_per_seq}")
            b.pages[i, : len(table)] = table
            b.pages[i, len(table) :] = 0
        self.rows_written += len(stale)
        b.seq_ids[:n], b.versions[:n] = ids, vers
        if n < max_seqs and (b.seq_ids[n:] != -1).any():  # rows a longer batch used: padding slots carry zeros
            b.pages[n:] = 0
            b.seq_ids[n:] = -1
            b.versions[n:] = -1
        tokens = np.zeros(max_seqs, np.int32)
        tokens[:n] = np.fromiter([c[0] for c in chunks], np.int32, n)
        kv = np.zeros(max_seqs, np.int32)
        kv[:n] = np.fromiter(kv_lens, np.int32, n)
        cu = b.cu_q_lens.copy()
        cu[n + 1 :] = n
        logits = np.zeros(max_seqs, np.int32)
        logits[:n] = b.logits_indices[:n]
        # The page array is copied: a batch is a value, and the rows change in later steps.
        return StepBatch(tokens, AttentionMetadata(cu, kv, b.pages.copy(), np.array([n], np.int32)), logits)
