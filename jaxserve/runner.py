"""The two compiled model calls, ``prefill_step`` and ``decode_step``, over padded bucket shapes.

Each step takes a ``StepBatch`` of NumPy arrays, runs the decoder over it (writing the new tokens' K/V into the
donated cache) and returns the logits of every sequence's last new token. Shapes are padded to powers of two
(tokens, sequences, pages per sequence) so a handful of compilations serve every batch.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.attention import AttentionBackend, AttentionMetadata
from jaxserve.batch import StepBatch
from jaxserve.config import ModelConfig
from jaxserve.kv_cache import CacheConfig, init_kv_cache
from jaxserve.models import DecoderLM, forward
from pallas_kernels.ragged_paged_attention import check_values

logger = logging.getLogger(__name__)


def bucket(n: int, minimum: int, maximum: int, growth: int = 2) -> int:
    """The smallest ``minimum * growth**k`` >= n, capped at ``maximum``."""
    size = minimum
    while size < n:
        size *= growth
    return min(size, maximum)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What a step returns on device."""

    logits: jax.Array  # f32[max_num_seqs, vocab]  rows past the batch's slots are zero
    greedy_ids: jax.Array  # i32[S]  argmax of each slot's logits: the whole sampler for greedy batches


def _ladder(bucket_of, start: int) -> list[int]:
    """All values a bucket function takes, from ``start`` up to its cap."""
    sizes = [bucket_of(start)]
    while bucket_of(sizes[-1] + 1) != sizes[-1]:
        sizes.append(bucket_of(sizes[-1] + 1))
    return sizes


class ModelRunner:
    """Owns the parameters and the KV cache on device, and the compiled steps."""

    def __init__(
        self,
        model: DecoderLM,
        cfg: ModelConfig,
        cache: CacheConfig,
        mesh: Mesh,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        backend: AttentionBackend = AttentionBackend(),
        debug_checks: bool = False,
    ):
        self.cfg, self.cache_cfg, self.mesh, self.backend = cfg, cache, mesh, backend
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_pages_per_seq = -(-max_model_len // cache.page_size)
        self.debug_checks = debug_checks
        self.graphdef, self.params = nnx.split(model)
        dtype = model.embed_tokens.embedding.get_value().dtype
        self.kv_cache = init_kv_cache(cfg, cache, dtype, mesh)
        graphdef = self.graphdef

        max_num_seqs = max_num_seqs

        def make_step(attention: AttentionBackend):
            def step(params, token_ids, md, kv_cache, logits_indices):
                model = nnx.merge(graphdef, params)
                logits, kv_cache = forward(model, token_ids, md, kv_cache, logits_indices, attention)
                greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
                # Padded to max_num_seqs rows so the sampler has one shape whatever the step's bucket.
                padded = jnp.pad(logits, ((0, max_num_seqs - logits.shape[0]), (0, 0)))
                return StepOutput(padded, greedy), kv_cache

            return jax.jit(step, donate_argnums=(3,))

        self._prefill = make_step(backend)
        self._decode = make_step(dataclasses.replace(backend, decode=True))

    # Shapes -------------------------------------------------------------------------------------------------
    def token_bucket(self, n: int) -> int:
        return bucket(n, 16, max(16, self.max_num_batched_tokens))

    def seq_bucket(self, n: int) -> int:
        return bucket(n, 1, self.max_num_seqs)

    def prefill_seqs(self, num_tokens: int) -> int:
        # A prefill's cost follows its tokens, so its slot count is a function of the token bucket: padding
        # slots cost a few metadata entries and LM-head rows, and the shape count stays one per token bucket.
        return min(self.max_num_seqs, num_tokens)

    def token_buckets(self) -> list[int]:
        return _ladder(lambda n: self.token_bucket(n), 16)

    def page_buckets(self) -> list[int]:
        return _ladder(lambda n: self.page_bucket(n), 16)

    def decode_buckets(self) -> list[int]:
        return _ladder(lambda n: self.seq_bucket(n), 1)

    def page_bucket(self, n: int) -> int:
        return bucket(n, 16, max(16, self.max_pages_per_seq))

    def make_batch(self, chunks: list[list[int]], kv_lens: list[int], page_tables: list[list[int]],
                   *, decode: bool) -> StepBatch:
        """Pad one step's sequences to bucket shapes (decode: one row per sequence slot)."""
        if decode:
            num_seqs = num_tokens = self.seq_bucket(len(chunks))
        else:
            num_tokens = self.token_bucket(sum(map(len, chunks)))
            num_seqs = self.prefill_seqs(num_tokens)
        pages = self.page_bucket(max(map(len, page_tables), default=1))
        return StepBatch.build(chunks, kv_lens, page_tables, num_tokens=num_tokens, max_seqs=num_seqs,
                               pages_per_seq=pages)

    # Steps --------------------------------------------------------------------------------------------------
    def prefill_step(self, batch: StepBatch) -> StepOutput:
        """Prompt chunks of a ragged batch; returns the logits of each sequence's last row and their argmax."""
        return self._run(self._prefill, batch)

    def decode_step(self, batch: StepBatch) -> StepOutput:
        """One new token per running sequence; returns the logits and their argmax."""
        if batch.num_tokens != batch.max_seqs:
            raise ValueError(f"decode batch must have one row per slot, got {batch.num_tokens} rows / "
                             f"{batch.max_seqs} slots")
        return self._run(self._decode, batch)

    def _run(self, fn, batch: StepBatch) -> StepOutput:
        if self.debug_checks:
            check_values(batch.num_tokens, self.cache_cfg.num_pages, self.cache_cfg.page_size, batch.kv_lens,
                         batch.page_indices, batch.cu_q_lens, batch.num_seqs)
        md = AttentionMetadata(
            jnp.asarray(batch.cu_q_lens), jnp.asarray(batch.kv_lens), jnp.asarray(batch.page_indices),
            jnp.asarray(batch.num_seqs),
        )
        out, self.kv_cache = fn(self.params, jnp.asarray(batch.token_ids), md, self.kv_cache,
                                   jnp.asarray(batch.logits_indices))
        return out

    def warmup(self) -> jax.Array:
        """Compile every bucket shape of both steps with all-padding batches (they write nothing).

        Returns:
          Logits as the steps produce them, for warming the sampler on the same shape and sharding.
        """
        prefill = [(t, self.prefill_seqs(t)) for t in self.token_buckets()]
        decode = [(n, n) for n in self.decode_buckets()]
        logits = None
        for step, shapes in ((self.prefill_step, prefill), (self.decode_step, decode)):
            for (num_tokens, num_seqs), pages in itertools.product(shapes, self.page_buckets()):
                batch = StepBatch.build([], [], [], num_tokens=num_tokens, max_seqs=num_seqs, pages_per_seq=pages)
                logits = jax.block_until_ready(step(batch)).logits
        return logits

