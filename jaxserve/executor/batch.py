"""What crosses from the host to the compiled steps: the step kind and the padded ragged batch.

A ``StepBatch`` is one data replica's share of a step; a ``MeshBatch`` lays ``R`` of them side by side in
one bucket shape. Both carry the attention metadata as one ``AttentionMetadata`` (the kernels' type, in the
kernels' field order). ``MeshBatch.pack`` is the one int32 array that crosses to the device per step, and
also what process 0 sends its followers on a multi-host run.

``StepShapes`` says which padded shapes those batches come in (host-only, no jax): token, slot and page-table
buckets that grow in powers of two, so a handful of compilations serve every batch. ``max_num_seqs`` and
``max_num_batched_tokens`` bound one data replica's share of a step.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools

import numpy as np

from jaxserve.models.attention import AttentionMetadata


class StepKind(enum.IntEnum):
    """Which compiled step a batch runs: a prefill step carries prompt chunks (and decodes along with them); a
    decode step has exactly one row per sequence slot."""

    PREFILL = 1
    DECODE = 2


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """A padded ragged batch of one data replica.

    Rows ``md.cu_q_lens[s] : md.cu_q_lens[s + 1]`` of ``token_ids`` are sequence ``s``'s new tokens (a prompt
    chunk, or one token when decoding); their K/V are written at positions ``md.kv_lens[s] - q_len ..
    md.kv_lens[s] - 1``. Padding rows and slots carry zeros (``cu_q_lens`` stays flat past ``num_seqs``).
    """

    token_ids: np.ndarray  # i32[T]
    md: AttentionMetadata  # NumPy: cu_q_lens i32[S + 1], kv_lens i32[S], page_indices i32[S, P], num_seqs i32[1]
    logits_indices: np.ndarray  # i32[S]  row whose logits each sequence needs (its last new token)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def max_seqs(self) -> int:
        return int(self.md.kv_lens.shape[0])

    @classmethod
    def build(cls, chunks: list[list[int]], kv_lens: list[int], page_tables: list[list[int]], *, num_tokens: int,
              max_seqs: int, pages_per_seq: int) -> "StepBatch":
        """Pack per-sequence new tokens, cache lengths (after this step) and page tables into padded arrays.

        Raises:
          ValueError: if the sequences do not fit the requested padded shape.
        """
        n = len(chunks)
        # Vectorised: per-step host work is a few NumPy calls over the flattened tokens and page ids, not a
        # Python loop over the batch's sequences.
        q_lens = np.fromiter(map(len, chunks), np.int64, n)
        total = int(q_lens.sum())
        if n > max_seqs or total > num_tokens:
            raise ValueError(f"{n} sequences / {total} tokens do not fit a batch of {max_seqs} / {num_tokens}")
        if len(kv_lens) != n or len(page_tables) != n:
            raise ValueError(f"{n} chunks but {len(kv_lens)} kv_lens and {len(page_tables)} page tables")
        if n and q_lens.min() == 0:
            raise ValueError(f"sequence {int(np.argmin(q_lens))} has no new tokens")
        widths = np.fromiter(map(len, page_tables), np.int64, n)
        if n and widths.max() > pages_per_seq:
            s = int(np.argmax(widths))
            raise ValueError(f"sequence {s} holds {widths[s]} pages, more than pages_per_seq={pages_per_seq}")
        token_ids = np.zeros(num_tokens, np.int32)
        token_ids[:total] = np.fromiter(itertools.chain.from_iterable(chunks), np.int32, total)
        cu = np.zeros(max_seqs + 1, np.int32)
        np.cumsum(q_lens, out=cu[1 : n + 1])
        cu[n + 1 :] = total
        kv = np.zeros(max_seqs, np.int32)
        kv[:n] = kv_lens
        pages = np.zeros((max_seqs, pages_per_seq), np.int32)
        num_ids = int(widths.sum())
        if num_ids:
            rows = np.repeat(np.arange(n), widths)
            cols = np.arange(num_ids) - np.repeat(np.cumsum(widths) - widths, widths)
            pages[rows, cols] = np.fromiter(itertools.chain.from_iterable(page_tables), np.int32, num_ids)
        logits_indices = np.zeros(max_seqs, np.int32)
        logits_indices[:n] = cu[1 : n + 1] - 1
        return cls(token_ids, AttentionMetadata(cu, kv, pages, np.array([n], np.int32)), logits_indices)

    @classmethod
    def decode(cls, tokens: np.ndarray, kv_lens: np.ndarray, pages: np.ndarray, num_pages: np.ndarray, *,
               max_seqs: int, pages_per_seq: int) -> "StepBatch":
        """``build`` of a decode step (one new token per sequence, ``max_seqs`` rows and slots) from arrays:
        ``tokens`` (i64[n]) each sequence's token, ``kv_lens`` (i64[n]), ``pages`` (i32[n, W]) the page tables,
        row ``i`` holding ``num_pages[i]`` pages then zeros. A few NumPy copies, whatever the batch size.

        Raises:
          ValueError: if the sequences do not fit the shape.
        """
        n = len(tokens)
        if n > max_seqs:
            raise ValueError(f"{n} sequences do not fit a decode batch of {max_seqs}")
        if len(kv_lens) != n or len(pages) != n or len(num_pages) != n:
            raise ValueError(f"{n} tokens but {len(kv_lens)} kv_lens, {len(pages)} page tables and "
                             f"{len(num_pages)} page counts")
        if n and num_pages.max() > pages_per_seq:
            s = int(np.argmax(num_pages))
            raise ValueError(f"sequence {s} holds {num_pages[s]} pages, more than pages_per_seq={pages_per_seq}")
        token_ids = np.zeros(max_seqs, np.int32)
        token_ids[:n] = tokens
        cu = np.arange(max_seqs + 1, dtype=np.int32)
        cu[n + 1 :] = n
        kv = np.zeros(max_seqs, np.int32)
        kv[:n] = kv_lens
        table = np.zeros((max_seqs, pages_per_seq), np.int32)
        width = min(pages.shape[1], pages_per_seq)  # (columns past a row's pages are zeros)
        table[:n, :width] = pages[:, :width]
        logits_indices = np.zeros(max_seqs, np.int32)
        logits_indices[:n] = cu[:n]
        return cls(token_ids, AttentionMetadata(cu, kv, table, np.array([n], np.int32)), logits_indices)


@dataclasses.dataclass(frozen=True)
class MeshBatch:
    """One step's batch for R data replicas: R ``StepBatch`` es of one bucket shape, side by side.

    Replica ``r``'s token rows are ``r*T .. (r+1)*T - 1`` of ``token_ids``; its metadata is block ``r`` of each
    ``md`` field (a leading replica axis) and its page ids are local to its page block. ``logits_indices`` lists,
    in the caller's entry order, the row (of all R*T) whose logits each sequence needs; its length R*S is the
    logits' row count.
    """

    token_ids: np.ndarray  # i32[R * T]
    md: AttentionMetadata  # cu_q_lens i32[R, S + 1], kv_lens i32[R, S], page_indices i32[R, S, P], num_seqs i32[R, 1]
    logits_indices: np.ndarray  # i32[R * S]

    @property
    def num_replicas(self) -> int:
        return int(self.md.kv_lens.shape[0])

    @property
    def tokens_per_replica(self) -> int:
        return int(self.token_ids.shape[0]) // self.num_replicas

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def max_seqs(self) -> int:
        """Logits rows (R * S)."""
        return int(self.logits_indices.shape[0])

    def replica(self, r: int) -> StepBatch:
        """Replica ``r``'s block (its ``logits_indices`` are not kept: zeros)."""
        t = self.tokens_per_replica
        md = AttentionMetadata(*(a[r] for a in _fields(self.md)))
        return StepBatch(self.token_ids[r * t : (r + 1) * t], md, np.zeros(self.md.kv_lens.shape[1], np.int32))

    @classmethod
    def stack(cls, batches: list[StepBatch], entries: list[tuple[int, int]] | None = None) -> "MeshBatch":
        """Side by side; ``entries[i] = (replica, slot)`` of the i-th sequence in the caller's order (default:
        replica 0's slots in order)."""
        t, s = batches[0].num_tokens, batches[0].max_seqs
        if any(b.num_tokens != t or b.max_seqs != s or b.md.page_indices.shape != batches[0].md.page_indices.shape
               for b in batches):
            raise ValueError("replica batches must share one bucket shape")
        logits = np.zeros(len(batches) * s, np.int32)
        if entries is None:
            n = int(batches[0].md.num_seqs[0])
            logits[:n] = batches[0].logits_indices[:n]
        elif len(entries):
            where = np.asarray(entries, np.int64).reshape(-1, 2)
            rows = np.stack([b.logits_indices for b in batches])
            logits[: len(where)] = where[:, 0] * t + rows[where[:, 0], where[:, 1]]
        md = AttentionMetadata(*(np.stack(fs) for fs in zip(*(_fields(b.md) for b in batches))))
        return cls(np.concatenate([b.token_ids for b in batches]), md, logits)

    @classmethod
    def padding(cls, replicas: int, *, num_tokens: int, max_seqs: int, pages_per_seq: int) -> "MeshBatch":
        """An all-padding batch (writes nothing): for compiling a shape."""
        empty = StepBatch.build([], [], [], num_tokens=num_tokens, max_seqs=max_seqs, pages_per_seq=pages_per_seq)
        return cls.stack([empty] * replicas)

    def with_logit_rows(self, num_rows: int) -> "MeshBatch":
        """The batch with ``num_rows`` logits rows (>= R * S; the new ones read row 0 until set): speculation
        verifies several rows per sequence."""
        extra = num_rows - self.logits_indices.shape[0]
        if extra < 0:
            raise ValueError(f"num_rows={num_rows} is below the batch's {self.logits_indices.shape[0]} logits rows")
        return dataclasses.replace(self, logits_indices=np.pad(self.logits_indices, (0, extra)))

    # The wire format: header fields (R, T, S, P[, L]) and one int32 payload, the arrays in field order; L, the
    # logits rows, is sent only when it is not R * S.
    def shape_fields(self) -> tuple[int, ...]:
        fields = (self.num_replicas, self.tokens_per_replica, int(self.md.kv_lens.shape[1]),
                  int(self.md.page_indices.shape[2]))
        rows = int(self.logits_indices.shape[0])
        return fields if rows == fields[0] * fields[2] else (*fields, rows)

    def pack(self) -> np.ndarray:
        arrays = (self.token_ids, *_fields(self.md), self.logits_indices)
        return np.concatenate([np.asarray(a, np.int32).reshape(-1) for a in arrays])

    @staticmethod
    def field_shapes(fields: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The shapes of the packed arrays, in field order, for header fields (R, T, S, P)."""
        r, t, s, p = fields[:4]
        rows = fields[4] if len(fields) > 4 and fields[4] else r * s
        return [(r * t,), (r, s + 1), (r, s), (r, s, p), (r, 1), (rows,)]

    @classmethod
    def unpack(cls, fields: tuple[int, ...], payload) -> "MeshBatch":
        """The inverse of ``pack`` (``payload`` a NumPy array, or a jax array inside a compiled step)."""
        arrays, offset = [], 0
        for shape in cls.field_shapes(fields):
            n = int(np.prod(shape))
            arrays.append(payload[offset : offset + n].reshape(shape))
            offset += n
        if offset != payload.shape[0]:
            raise ValueError(f"step payload of {payload.shape[0]} ints does not match shape {fields[:4]}")
        return cls(arrays[0], AttentionMetadata(*arrays[1:5]), arrays[5])


def _fields(md: AttentionMetadata) -> tuple:
    return tuple(getattr(md, f.name) for f in dataclasses.fields(md))


# ---- the padded shapes a step is compiled for ----------------------------------------------------------
def bucket(n: int, minimum: int, maximum: int, growth: int = 2) -> int:
    """The smallest ``minimum * growth**k`` >= n, capped at ``maximum``."""
    size = minimum
    while size < n:
        size *= growth
    return min(size, maximum)


def ladder(bucket_of, start: int) -> list[int]:
    """All values a bucket function takes, from ``start`` up to its cap."""
    sizes = [bucket_of(start)]
    while bucket_of(sizes[-1] + 1) != sizes[-1]:
        sizes.append(bucket_of(sizes[-1] + 1))
    return sizes


def decode_floor(platform: str) -> int:
    """The smallest decode bucket on ``platform``: 2 rows on a GPU, 1 elsewhere.

    At one row XLA's GPU compiler sees every row reduction as a reduction to a scalar: each RMSNorm becomes two
    kernels (the sum of squares, then the scaling) where at two rows it is one normalization fusion, and each
    product whose output it pads to two rows anyway gets a padding kernel before it. A second row costs the
    weight-bound products nothing (docs/benchmarks/gpu-kit.md, "batch-1 decode in a two-row bucket")."""
    return 2 if platform in ("gpu", "cuda") else 1


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """Bucket ladders of one engine: prefill steps by token count, decode steps by slot count; one page-table
    width for both."""

    max_num_seqs: int
    max_num_batched_tokens: int
    pages_per_seq: int  # page-table width that holds a max_model_len sequence
    min_token_bucket: int = 16  # speculation lowers it: a lone verified sequence runs 1 + k rows, not 16
    min_decode_seqs: int = 1  # the smallest decode bucket (``decode_floor``)
    # While start-up compiles some shapes in the background: the (decode, bucket) pairs compiled so far, the
    # largest of each kind among them. A step then takes the smallest *compiled* bucket that holds it. None: all.
    compiled: frozenset[tuple[bool, int]] | None = None

    def token_bucket(self, n: int) -> int:
        return self._compiled_at_least(False, self._token_size(n), self._token_size)

    def seq_bucket(self, n: int) -> int:
        return self._compiled_at_least(True, self._seq_size(n), self._seq_size)

    def _token_size(self, n: int) -> int:
        return bucket(n, self.min_token_bucket, max(16, self.max_num_batched_tokens))

    def _seq_size(self, n: int) -> int:
        return bucket(n, min(self.min_decode_seqs, self.max_num_seqs), self.max_num_seqs)

    def _compiled_at_least(self, decode: bool, size: int, bucket_of) -> int:
        """``size``, or while shapes are still compiling the next bucket up that is compiled (the largest is)."""
        if self.compiled is not None:
            while (decode, size) not in self.compiled and bucket_of(size + 1) != size:
                size = bucket_of(size + 1)
        return size

    def with_compiled(self, compiled) -> "StepShapes":
        """These shapes with only ``compiled``'s (decode, bucket) pairs in use; every pair of ``all_shapes``
        in it: all of them (``compiled`` None)."""
        if compiled is not None and {(s[0], s[1]) for s in self.all_shapes()} <= set(compiled):
            compiled = None
        return dataclasses.replace(self, compiled=None if compiled is None else frozenset(compiled))

    def page_bucket(self, n: int) -> int:
        return bucket(n, 16, max(16, self.pages_per_seq))

    def step_pages(self, decode: bool, n: int) -> int:
        """The page-table width of a step whose longest table has ``n`` pages: one width, the largest, for
        every step. Attention walks each row's pages only up to its length (the CPU path's online-softmax walks
        over decode rows and over a chunk's cached context, the Pallas kernels), so a wider table costs nothing
        but its few ints, and one page bucket instead of a ladder is that many fewer shapes to compile at
        start-up. (``decode`` and ``n`` stay in the signature: the callers describe their step.)"""
        return self.page_bucket(self.pages_per_seq)

    def prefill_seqs(self, num_tokens: int) -> int:
        """A prefill's slot count, a function of its token bucket: padding slots cost a few metadata entries and
        LM-head rows, and the shape count stays one per token bucket."""
        return min(self.max_num_seqs, num_tokens)

    def token_buckets(self) -> list[int]:
        return ladder(self._token_size, self.min_token_bucket)

    def decode_buckets(self) -> list[int]:
        return ladder(self._seq_size, 1)

    def all_shapes(self) -> list[tuple[bool, int, int, int]]:
        """Every shape serving compiles, as (decode, tokens, slots, pages per sequence), prefill first."""
        pages = self.step_pages(False, 1)
        shapes = [(False, t, self.prefill_seqs(t), pages) for t in self.token_buckets()]
        return shapes + [(True, n, n, pages) for n in self.decode_buckets()]
