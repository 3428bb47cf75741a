"""The padded shapes a step is compiled for: token, slot and page-table buckets (host-only, no jax).

Shapes grow in powers of two so a handful of compilations serve every batch. ``max_num_seqs`` and
``max_num_batched_tokens`` bound one data replica's share of a step.
"""

from __future__ import annotations

import dataclasses


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
