"""The two compiled model calls, ``prefill_step`` and ``decode_step``, over padded bucket shapes.

Each step takes a ``MeshBatch`` of NumPy arrays (one ``StepBatch`` per data replica, side by side), runs the
decoder over it on the mesh (writing the new tokens' K/V into the donated cache) and returns the logits of
every sequence's last new token, replicated on every device. Shapes are padded to powers of two (tokens,
sequences, pages per sequence) so a handful of compilations serve every batch.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve import compile_progress
from jaxserve.attention import AttentionBackend, AttentionMetadata
from jaxserve.batch import StepBatch
from jaxserve.config import ModelConfig
from jaxserve.kv_cache import CacheConfig, init_kv_cache
from jaxserve.loader import place
from jaxserve.models import DecoderLM, forward
from jaxserve.sampler import argmax
from pallas_kernels.ragged_paged_attention import check_values
from sharding import multihost
from sharding.attention import ShardedAttention
from sharding.layout import StepLayout
from sharding.rules import model_rules

logger = logging.getLogger(__name__)


def bucket(n: int, minimum: int, maximum: int, growth: int = 2) -> int:
    """The smallest ``minimum * growth**k`` >= n, capped at ``maximum``."""
    size = minimum
    while size < n:
        size *= growth
    return min(size, maximum)


def _ladder(bucket_of, start: int) -> list[int]:
    """All values a bucket function takes, from ``start`` up to its cap."""
    sizes = [bucket_of(start)]
    while bucket_of(sizes[-1] + 1) != sizes[-1]:
        sizes.append(bucket_of(sizes[-1] + 1))
    return sizes


@dataclasses.dataclass(frozen=True)
class MeshBatch:
    """One step's batch for R data replicas: R ``StepBatch`` es of one bucket shape, side by side.

    Replica ``r``'s token rows are ``r*T .. (r+1)*T - 1`` of ``token_ids``; its metadata is block ``r`` of the
    others and its page ids are local to its page block. ``logits_indices`` lists, in the caller's entry order,
    the row (of all R*T) whose logits each sequence needs; its length R*S is the logits' row count.
    """

    token_ids: np.ndarray  # i32[R * T]
    cu_q_lens: np.ndarray  # i32[R, S + 1]
    kv_lens: np.ndarray  # i32[R, S]
    page_indices: np.ndarray  # i32[R, S, P]
    num_seqs: np.ndarray  # i32[R, 1]
    logits_indices: np.ndarray  # i32[R * S]

    @property
    def num_replicas(self) -> int:
        return int(self.kv_lens.shape[0])

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
        return StepBatch(self.token_ids[r * t : (r + 1) * t], self.cu_q_lens[r], self.kv_lens[r],
                         self.page_indices[r], self.num_seqs[r], np.zeros(self.kv_lens.shape[1], np.int32))

    @classmethod
    def stack(cls, batches: list[StepBatch], entries: list[tuple[int, int]] | None = None) -> "MeshBatch":
        """Side by side; ``entries[i] = (replica, slot)`` of the i-th sequence in the caller's order (default:
        replica 0's slots in order)."""
        t, s = batches[0].num_tokens, batches[0].max_seqs
        if any(b.num_tokens != t or b.max_seqs != s or b.page_indices.shape != batches[0].page_indices.shape
               for b in batches):
            raise ValueError("replica batches must share one bucket shape")
        if entries is None:
            entries = [(0, j) for j in range(int(batches[0].num_seqs[0]))]
        logits = np.zeros(len(batches) * s, np.int32)
        for i, (r, j) in enumerate(entries):
            logits[i] = r * t + batches[r].logits_indices[j]
        return cls(np.concatenate([b.token_ids for b in batches]), np.stack([b.cu_q_lens for b in batches]),
                   np.stack([b.kv_lens for b in batches]), np.stack([b.page_indices for b in batches]),
                   np.stack([b.num_seqs for b in batches]), logits)

    @classmethod
    def padding(cls, replicas: int, *, num_tokens: int, max_seqs: int, pages_per_seq: int) -> "MeshBatch":
        """An all-padding batch (writes nothing): for compiling a shape."""
        empty = StepBatch.build([], [], [], num_tokens=num_tokens, max_seqs=max_seqs, pages_per_seq=pages_per_seq)
        return cls.stack([empty] * replicas)

    # Multi-host wire format: header fields (R, T, S, P) and one int32 payload.
    def shape_fields(self) -> tuple[int, int, int, int]:
        return (self.num_replicas, self.tokens_per_replica, int(self.kv_lens.shape[1]),
                int(self.page_indices.shape[2]))

    def pack(self) -> np.ndarray:
        fields = (getattr(self, f.name) for f in dataclasses.fields(self))
        return np.concatenate([np.asarray(a, np.int32).reshape(-1) for a in fields])

    @staticmethod
    def field_shapes(fields: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The shapes of the packed arrays, in field order, for header fields (R, T, S, P)."""
        r, t, s, p = fields[:4]
        return [(r * t,), (r, s + 1), (r, s), (r, s, p), (r, 1), (r * s,)]

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
        return cls(*arrays)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What a step returns on device (replicated over the mesh)."""

    logits: jax.Array  # f32[num_rows, vocab]  rows past the batch's sequences are zero
    greedy_ids: jax.Array  # i32[R * S]  argmax of each sequence's logits: the whole sampler for greedy batches


def jit_step(graphdef: nnx.GraphDef, num_rows: int, out_shardings=None):
    """The compiled step: (params, packed, kv_cache, fields, attention, layout) -> (StepOutput, kv_cache), the
    cache donated, ``fields`` (the batch's shape, ``MeshBatch.shape_fields``), ``attention`` and ``layout`` static.

    ``packed`` is the whole batch as one int32 array (``MeshBatch.pack``, also the multi-host wire format),
    placed replicated: one host-to-device copy per step. The step unpacks it and gives each field its sharding.
    Logits are padded to ``num_rows`` so the sampler has one shape whatever the step's bucket.
    ``out_shardings`` (output, cache) pins the outputs: the cache must come back with exactly the sharding it
    went in with, or the next call would see a new input sharding and compile again.
    """

    def step(params, packed, kv_cache, fields, attention, layout):
        token_ids, md, logits_indices = device_inputs(MeshBatch.unpack(fields, packed), layout)
        logits, kv_cache = forward(nnx.merge(graphdef, params), token_ids, md, kv_cache, logits_indices, attention,
                                   layout)
        greedy = argmax(logits)
        padded = jnp.pad(logits, ((0, num_rows - logits.shape[0]), (0, 0)))
        return StepOutput(padded, greedy), kv_cache

    return jax.jit(step, donate_argnums=(2,), static_argnums=(3, 4, 5), out_shardings=out_shardings)


def device_inputs(batch: MeshBatch, layout: StepLayout):
    """(token_ids, md, logits_indices) of a batch unpacked inside the step, each constrained to its sharding."""
    pin = lambda a, axes: jax.lax.with_sharding_constraint(a, layout.sharding(axes, a.shape))  # noqa: E731
    rows = lambda a: pin(a, ("replicas",) + (None,) * (a.ndim - 1))  # noqa: E731
    md = AttentionMetadata(rows(batch.cu_q_lens), rows(batch.kv_lens), rows(batch.page_indices),
                           rows(batch.num_seqs))
    return pin(batch.token_ids, ("tokens",)), md, batch.logits_indices


class ModelRunner:
    """Owns the parameters and the KV cache on the mesh, and the compiled steps.

    ``max_num_seqs`` and ``max_num_batched_tokens`` bound one data replica's share of a step; a step carries
    ``R`` such shares side by side (R = the mesh's ``data`` size).
    """

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
        self.num_replicas = int(mesh.shape["data"])
        self.sequence = int(mesh.shape["sequence"])
        if 16 % self.sequence:
            raise ValueError(f"mesh sequence={self.sequence} must divide 16 (the smallest token bucket)")
        if cache.num_pages % self.num_replicas:
            raise ValueError(f"num_pages={cache.num_pages} must be a multiple of the mesh's data={self.num_replicas}")
        self.pages_per_replica = cache.num_pages // self.num_replicas
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_pages_per_seq = -(-max_model_len // cache.page_size)
        self.debug_checks = debug_checks
        self.graphdef, self.params = nnx.split(model)
        dtype = model.embed_tokens.embedding.get_value().dtype
        self.kv_cache = init_kv_cache(cfg, cache, backend.cache_dtype(dtype), mesh)
        rules = model_rules(cfg.num_heads, cfg.num_kv_heads, mesh)
        # Prefill rows split over `sequence` when the axis divides them; decode rows never are.
        self.layouts = {split: StepLayout.create(mesh, rules, split_sequence=split) for split in (False, True)}
        self.channel = multihost.StepChannel() if jax.process_count() > 1 else None
        # Where this process finds its copy of the (replicated) logits: its first device of the mesh.
        self.sample_device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
        # Two jit objects so prefill and decode shapes are compiled and cached separately.
        replicated = NamedSharding(mesh, PartitionSpec())
        outs = (StepOutput(replicated, replicated), jax.tree.map(lambda a: a.sharding, self.kv_cache))
        self.num_logit_rows = self.num_replicas * max_num_seqs
        self._prefill = jit_step(self.graphdef, self.num_logit_rows, outs)
        self._decode = jit_step(self.graphdef, self.num_logit_rows, outs)

    # Shapes (per data replica) ------------------------------------------------------------------------------
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
                   *, decode: bool, replicas: list[int] | None = None) -> MeshBatch:
        """Pad one step's sequences to bucket shapes (decode: one row per sequence slot).

        ``replicas[i]`` is the data replica of sequence ``i`` (default: all on replica 0); its page table holds
        that replica's local page ids. The logits rows come back in the order of ``chunks``.
        """
        replicas = [0] * len(chunks) if replicas is None else list(replicas)
        if len(replicas) != len(chunks) or any(not 0 <= r < self.num_replicas for r in replicas):
            raise ValueError(f"replicas={replicas} must give each of {len(chunks)} sequences a replica in "
                             f"[0, {self.num_replicas})")
        groups = [[i for i, r in enumerate(replicas) if r == g] for g in range(self.num_replicas)]
        if decode:
            num_seqs = num_tokens = self.seq_bucket(max(map(len, groups)))
        else:
            num_tokens = self.token_bucket(max(sum(len(chunks[i]) for i in g) for g in groups))
            num_seqs = self.prefill_seqs(num_tokens)
        pages = self.page_bucket(max(map(len, page_tables), default=1))
        batches = [StepBatch.build([chunks[i] for i in g], [kv_lens[i] for i in g], [page_tables[i] for i in g],
                                   num_tokens=num_tokens, max_seqs=num_seqs, pages_per_seq=pages) for g in groups]
        slot = {i: (g, j) for g, members in enumerate(groups) for j, i in enumerate(members)}
        return MeshBatch.stack(batches, [slot[i] for i in range(len(chunks))])

    # Steps --------------------------------------------------------------------------------------------------
    def prefill_step(self, batch: MeshBatch | StepBatch) -> StepOutput:
        """Prompt chunks of a ragged batch; returns each sequence's last-row logits and their argmax."""
        return self._lead(multihost.PREFILL, batch)

    def decode_step(self, batch: MeshBatch | StepBatch) -> StepOutput:
        """One new token per running sequence; returns the logits and their argmax."""
        return self._lead(multihost.DECODE, batch)

    def _lead(self, kind: int, batch: MeshBatch | StepBatch) -> StepOutput:
        if isinstance(batch, StepBatch):
            batch = MeshBatch.stack([batch])
        if batch.num_replicas != self.num_replicas:
            raise ValueError(f"batch has {batch.num_replicas} replicas, the mesh has data={self.num_replicas}")
        if kind == multihost.DECODE and batch.tokens_per_replica != batch.kv_lens.shape[1]:
            raise ValueError(f"decode batch must have one row per slot, got {batch.tokens_per_replica} rows / "
                             f"{batch.kv_lens.shape[1]} slots")
        payload = batch.pack()
        if self.channel is not None:
            self.channel.send(kind, batch.shape_fields(), payload)
        return self._run(kind, batch, payload)

    def follow(self) -> None:
        """A follower process's loop: run each step process 0 sends, until it sends STOP."""
        if self.channel is None or multihost.is_leader():
            raise RuntimeError("follow() runs on processes other than 0 of a multi-process run")
        while True:
            kind, fields, payload = self.channel.recv()
            if kind == multihost.STOP:
                return
            jax.block_until_ready(self._run(kind, MeshBatch.unpack(fields, payload), payload))

    def close(self) -> None:
        """On process 0 of a multi-process run: release the followers from ``follow``."""
        if self.channel is not None and multihost.is_leader():
            self.channel.send(multihost.STOP)
            self.channel = None

    def layout_for(self, kind: int, batch: MeshBatch) -> StepLayout:
        split = kind == multihost.PREFILL and self.sequence > 1 and batch.tokens_per_replica % self.sequence == 0
        return self.layouts[split]

    def _call_args(self, kind: int, batch: MeshBatch, payload: np.ndarray):
        """The compiled step for a batch and its arguments; ``payload`` is ``batch.pack()``, placed replicated
        (one host-to-device copy per step)."""
        layout = self.layout_for(kind, batch)
        backend = dataclasses.replace(self.backend, decode=kind == multihost.DECODE)
        attention = ShardedAttention(backend, layout, self.cfg.num_kv_heads)
        fn = self._prefill if kind == multihost.PREFILL else self._decode
        packed = place(payload, NamedSharding(self.mesh, PartitionSpec()))
        return fn, (self.params, packed, self.kv_cache, batch.shape_fields(), attention, layout)

    def lower(self, batch: MeshBatch | StepBatch, *, decode: bool):
        """The step a batch would run, lowered (for inspecting the compiled program)."""
        batch = MeshBatch.stack([batch]) if isinstance(batch, StepBatch) else batch
        fn, args = self._call_args(multihost.DECODE if decode else multihost.PREFILL, batch, batch.pack())
        return fn.lower(*args)

    def _run(self, kind: int, batch: MeshBatch, payload: np.ndarray) -> StepOutput:
        if self.debug_checks:
            for r in range(batch.num_replicas):
                b = batch.replica(r)
                check_values(b.num_tokens, self.pages_per_replica, self.cache_cfg.page_size, b.kv_lens,
                             b.page_indices, b.cu_q_lens, b.num_seqs)
        fn, args = self._call_args(kind, batch, payload)
        out, self.kv_cache = fn(*args)
        return out

    def local(self, out: StepOutput) -> StepOutput:
        """The step's output (replicated over the mesh) as arrays on ``sample_device``, where sampling runs."""

        def one(a: jax.Array) -> jax.Array:
            index = next(i for i, s in enumerate(a.addressable_shards) if s.device == self.sample_device)
            return a.addressable_data(index)  # a single-device array, as the sampler was compiled for

        return StepOutput(one(out.logits), one(out.greedy_ids))

    def warmup(self) -> StepOutput:
        """Compile every bucket shape of both steps with all-padding batches (they write nothing).

        Returns:
          One step's output as the sampler sees it (on ``sample_device``), for warming the sampler.
        """
        prefill = [(t, self.prefill_seqs(t)) for t in self.token_buckets()]
        decode = [(n, n) for n in self.decode_buckets()]
        out = None
        for step, shapes in ((self.prefill_step, prefill), (self.decode_step, decode)):
            for (num_tokens, num_seqs), pages in itertools.product(shapes, self.page_buckets()):
                batch = MeshBatch.padding(self.num_replicas, num_tokens=num_tokens, max_seqs=num_seqs,
                                          pages_per_seq=pages)
                out = jax.block_until_ready(step(batch))
                compile_progress.tick()
        return self.local(out)
