"""Attention on a mesh: each shard runs the unchanged ``AttentionBackend`` on its own heads, pages and rows.

``ShardedAttention`` has the backend's call signature, with arrays that are global (sharded) and metadata
stacked over data replicas (a leading axis, one block per replica). Inside one ``shard_map``:

- ``tensor``: a shard gets its q heads, the K/V heads they read, and the cache pages of those heads. When
  ``tensor`` exceeds the KV-head count, K/V arrive replicated and the shard keeps head
  ``tensor_index // (tensor / num_kv_heads)``; its cache holds that head alone (see ``sharding.rules``).
- ``data``: a shard gets its replica's rows, metadata and page block (page ids are replica-local).
- ``sequence`` (prefill steps whose layout splits it): K/V of the replica's whole chunk come in (the shard_map
  boundary all-gathers them over ``sequence``), every sequence shard writes all of them, so the cache copies
  stay identical, then attends for its own query rows only, through metadata re-cut to its row window.

The cache is never gathered: each device reads and writes only the pages it holds.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve.attention import AttentionBackend, AttentionMetadata
from sharding.layout import StepLayout

CACHE_AXES = ("cache_kv_heads", "cache_pages", "page_size", "head_dim")


def window_metadata(md: AttentionMetadata, offset: jax.Array, rows: int) -> AttentionMetadata:
    """Metadata for query rows ``offset .. offset + rows - 1`` of a ragged batch, as a batch of its own.

    Each sequence keeps the part of its rows inside the window (possibly none); its ``kv_len`` drops by the
    rows it has after the window, so every row keeps its absolute position. Sequences with no rows in the
    window get ``kv_len`` 0.
    """
    cu = jnp.clip(md.cu_q_lens - offset, 0, rows)
    after = jnp.maximum(md.cu_q_lens[1:] - (offset + rows), 0)
    q_lens = cu[1:] - cu[:-1]
    kv_lens = jnp.where(q_lens > 0, md.kv_lens - after, 0)
    return AttentionMetadata(cu, kv_lens, md.page_indices, md.num_seqs)


@dataclasses.dataclass(frozen=True)
class ShardedAttention:
    """A hashable attention callable for a mesh (a static argument of the compiled steps)."""

    backend: AttentionBackend
    layout: StepLayout
    num_kv_heads: int

    def specs(self, q_shape, kv_shape, page_shape, num_replicas: int):
        lay = self.layout
        rows = lay.spec(("tokens",), q_shape[:1])[0]
        q_spec = P(rows, lay.spec(("act_heads",), q_shape[1:2])[0], None)
        replicas = lay.spec(("replicas",), (num_replicas,))[0]
        kv_spec = P(replicas, lay.spec(("act_kv_heads",), kv_shape[1:2])[0], None)
        page_spec = lay.spec(CACHE_AXES, page_shape)
        return q_spec, kv_spec, page_spec, replicas

    def __call__(
        self,
        q: jax.Array,  # [R * T, num_q_heads, head_dim]
        k: jax.Array,  # [R * T, num_kv_heads, head_dim]
        v: jax.Array,  # [R * T, num_kv_heads, head_dim]
        k_pages: jax.Array,  # [cache_heads, R * pages_per_replica, page_size, head_dim]
        v_pages: jax.Array,
        md: AttentionMetadata,  # every field with a leading replica axis R
        *,
        sm_scale: float,
        sliding_window: int | None,
        soft_cap: float | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        lay, backend, nkv = self.layout, self.backend, self.num_kv_heads
        num_replicas = md.cu_q_lens.shape[0]
        q_spec, kv_spec, page_spec, replicas = self.specs(q.shape, k.shape, k_pages.shape, num_replicas)
        md_spec = jax.tree.map(lambda a: P(replicas, *([None] * (a.ndim - 1))), md)
        tensor = lay.size("tensor")
        split = lay.split_sequence
        kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)

        def local(q, k, v, k_pages, v_pages, md):
            md = jax.tree.map(lambda a: a[0], md)  # this replica's block
            if k.shape[1] != k_pages.shape[0]:
                # KV heads replicated over tensor: keep the one this shard's q heads read.
                head = jax.lax.axis_index("tensor") // (tensor // nkv) * k_pages.shape[0]
                k = jax.lax.dynamic_slice_in_dim(k, head, k_pages.shape[0], axis=1)
                v = jax.lax.dynamic_slice_in_dim(v, head, k_pages.shape[0], axis=1)
            if not split:
                return backend(q, k, v, k_pages, v_pages, md, **kw)
            k_pages, v_pages = backend.write(k, v, k_pages, v_pages, md)
            rows = q.shape[0]
            offset = jax.lax.axis_index("sequence") * rows
            mine = lambda a: jax.lax.dynamic_slice_in_dim(a, offset, rows)  # noqa: E731  this shard's rows
            out = backend.attend(q, mine(k), mine(v), k_pages, v_pages, window_metadata(md, offset, rows), **kw)
            return out, k_pages, v_pages

        if lay.mesh.size == 1:
            return local(q, k, v, k_pages, v_pages, md)
        return jax.shard_map(
            local, mesh=lay.mesh, in_specs=(q_spec, kv_spec, kv_spec, page_spec, page_spec, md_spec),
            out_specs=(q_spec, page_spec, page_spec), check_vma=False,
        )(q, k, v, k_pages, v_pages, md)
