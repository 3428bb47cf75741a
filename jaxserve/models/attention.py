"""The attention seam: how the model writes new K/V into the page pool and attends over it.

The model calls one ``AttentionBackend``; which implementation runs (the pure-JAX reference, the Pallas TPU
kernel, the Pallas GPU kernels on Triton and on Mosaic GPU) is chosen here and nowhere else. Every
implementation takes the batch as one ``AttentionMetadata`` (defined by the kernels in
``pallas_kernels.metadata``, re-exported here), which the backend passes through unchanged.

On a mesh, ``ShardedAttention`` (below) calls the backend once per shard with that shard's heads, pages and
metadata, so a kernel sees exactly the single-device contract. Sequence-parallel prefill calls the two halves
separately (``write`` all of a chunk's rows, then ``attend`` for a window of them), with window metadata
(``window_metadata``) in which some sequences have zero query rows (and ``kv_len`` 0); ``attend`` must accept
that.

Shapes are noted ``dtype[dims]``, as in ``pallas_kernels``: ``i32`` is a fixed dtype, ``dt`` the model's dtype
(bf16, f16 or f32), ``kv`` the KV pool's (``AttentionBackend.cache_dtype``; an 8-bit pool is a ``QuantizedPages``
of 8-bit values and f32 scales). Dims: T query rows (of one replica), R data replicas, S sequence slots, P pages
per slot, H query heads, K KV heads (``cache_heads``: those a device holds), D head_dim; a prime marks one
shard's part (T' its query rows, H' and K' its heads).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve.config.engine import ATTENTION_BACKENDS
from pallas_kernels import kv_cache_update
from pallas_kernels import ragged_paged_attention as rpa
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.quantized_pages import QuantizedPages, fake_quantize, write_quantized
from sharding.layout import StepLayout

__all__ = ["AttentionMetadata", "AttentionBackend", "BACKENDS", "ShardedAttention", "window_metadata"]


BACKENDS = tuple(b for b in ATTENTION_BACKENDS if b != "auto")


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """A hashable choice of attention implementation, passed to the compiled steps as a static argument."""

    name: str = "reference"
    decode: bool = False  # every sequence has one new token (the decode step's batches)
    interpret: bool = False  # run a Pallas kernel in the interpreter (a CPU has no Mosaic or Triton)

    def __post_init__(self):
        if self.name not in BACKENDS:
            raise ValueError(f"attention_backend={self.name!r} is not one of 'auto', {', '.join(BACKENDS)}")

    def cache_dtype(self, model_dtype, platform: str | None = None):
        """The KV pool's dtype for a model's dtype: the model's, except 16-bit floats on the CPU path, which are
        kept in fp32. XLA:CPU has no 16-bit float gather or scatter: it widens the whole pool to fp32 and back
        around each one, a full copy of the pool per layer per step. An fp32 pool holds the same rounded
        values exactly (results are unchanged) and costs twice the memory."""
        platform = platform or jax.default_backend()
        if self.name == "reference" and platform == "cpu" and jnp.dtype(model_dtype).itemsize == 2:
            return jnp.float32
        return model_dtype

    def supports_kv_cache_dtype(self, kv_cache_dtype: str) -> bool:
        """Whether this backend reads an 8-bit KV pool (``kv_cache_dtype`` other than "auto")."""
        return kv_cache_dtype == "auto" or self.name in ("reference", "pallas_gpu", "pallas_tpu",
                                                         "pallas_mosaic_gpu")

    def check_quantized(self) -> None:
        if not self.supports_kv_cache_dtype("int8"):
            raise ValueError(f"attention_backend={self.name!r} does not read a quantized KV cache; "
                             "use kv_cache_dtype='auto' or attention_backend='reference'")

    def check_model(self, dtype, page_size: int, layouts, *, quantized: bool = False) -> None:
        """Raise ValueError if this backend cannot serve a model of ``dtype`` whose attention layers have the
        ``layouts`` ((head_dim, query heads per KV head) pairs) at ``page_size`` (``quantized``: on an 8-bit KV
        pool); only the Mosaic GPU kernel has such limits (16-bit wgmma operands, whole 8-row TMA tiles per page,
        128-byte aligned scale copies)."""
        if self.name != "pallas_mosaic_gpu":
            return
        from pallas_kernels.ragged_paged_attention.mosaic_gpu import check_supported

        for head_dim, group in layouts:
            try:
                check_supported(dtype, head_dim, page_size, group, quantized=quantized)
            except ValueError as e:
                raise ValueError(f"attention_backend='pallas_mosaic_gpu': {e}") from None

    def longest_model_len(self, max_num_seqs: int, page_size: int, *, tables: int = 1,
                          extra_columns: int = 0) -> int | None:
        """The longest ``max_model_len`` whose page table this backend can hold at ``max_num_seqs`` (``tables``:
        page tables side by side in one row, 2 with a windowed layers' own pool; ``extra_columns``: a hybrid's
        state slot), or None without a limit. Only the compiled TPU kernel has one: its flattened page table lives
        in SMEM (``MAX_PAGE_TABLE_ENTRIES``)."""
        if self.name != "pallas_tpu" or self.interpret:
            return None
        from pallas_kernels.ragged_paged_attention.tpu import MAX_PAGE_TABLE_ENTRIES

        width = MAX_PAGE_TABLE_ENTRIES // max(max_num_seqs, 1) - extra_columns
        return max(width // tables, 0) * page_size

    @classmethod
    def resolve(cls, name: str, platform: str | None = None) -> "AttentionBackend":
        """A backend for ``platform`` (default: jax's default backend).

        ``"auto"`` is the TPU kernel on TPU, the GPU (Triton) kernel on GPU and the pure-JAX reference on CPU; a
        Pallas kernel asked for on a CPU runs in interpret mode (slow: for tests and debugging). ``auto`` stays on
        the Triton kernel on Hopper too until a GPU kit report (docs/benchmarks.md) shows the Mosaic GPU kernel
        ahead.
        """
        platform = platform or jax.default_backend()
        if name == "auto":
            name = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(platform, "reference")
        interpret = name.startswith("pallas_") and platform == "cpu"
        return cls(name, interpret=interpret)

    def __call__(
        self,
        q: jax.Array,  # dt[T, H, D]
        k: jax.Array,  # dt[T, K, D]
        v: jax.Array,  # dt[T, K, D]
        k_pages: jax.Array,  # kv[K, num_pages, page_size, D]
        v_pages: jax.Array,  # kv[K, num_pages, page_size, D]
        md: AttentionMetadata,  # cu_q_lens i32[S + 1], kv_lens i32[S], page_indices i32[S, P], num_seqs i32[1]
        *,
        sm_scale: float,
        sliding_window: int | None,
        soft_cap: float | None = None,
        sinks: jax.Array | None = None,  # f32[H]: attention sinks (gpt-oss), absent for other families
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Write this step's K/V, then attend. Returns (out dt[T, H, D], k_pages, v_pages)."""
        k_pages, v_pages = self.write(k, v, k_pages, v_pages, md)  # kv[K, num_pages, page_size, D] each
        out = self.attend(q, k, v, k_pages, v_pages, md, sm_scale=sm_scale, sliding_window=sliding_window,
                          soft_cap=soft_cap, sinks=sinks)  # dt[T, H, D]
        return out, k_pages, v_pages

    # The two halves, for callers whose query rows are a subset of the rows written (sequence parallelism:
    # every sequence shard writes all of a chunk's K/V, then attends for its own rows only).
    def write(self, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
              md: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
        """Write each real row's K/V (dt[T, K, D] each) into its page slot. Returns (k_pages, v_pages),
        kv[K, num_pages, page_size, D] each. A latent pool (``is_latent``) gets the keys only."""
        if is_latent(k_pages, v_pages):
            # The keys only, by the pure-JAX scatter on every backend: XLA drops its unused second half, where a
            # write kernel handed the key pool as both of its aliased pools would first copy the whole pool.
            if isinstance(k_pages, QuantizedPages):
                self.check_quantized()
                k_pages, _ = write_quantized(rpa.write_kv, k_pages, k_pages, k, k, md)
            else:
                k_pages, _ = rpa.write_kv(k_pages, k_pages, k, k, md)
            return k_pages, v_pages
        # Each branch returns the two pools, kv[K, num_pages, page_size, D] each.
        if isinstance(k_pages, QuantizedPages):  # an 8-bit pool: quantized as written (pallas_kernels.quantized_pages)
            self.check_quantized()
            return write_quantized(rpa.write_kv, k_pages, v_pages, k, v, md)
        if self.name == "pallas_tpu":
            return kv_cache_update.write_kv_tpu(k_pages, v_pages, k, v, md, interpret=self.interpret)
        if self.name in ("pallas_gpu", "pallas_mosaic_gpu"):  # Mosaic GPU attention writes through this kernel
            return kv_cache_update.write_kv_gpu(k_pages, v_pages, k, v, md, interpret=self.interpret)
        return rpa.write_kv(k_pages, v_pages, k, v, md)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
               md: AttentionMetadata, *, sm_scale: float, sliding_window: int | None,
               soft_cap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
        """Attention of ``q``'s rows (dt[T, H, D]) over pages that already hold their K/V. Returns dt[T, H, D].

        ``k`` and ``v`` are the same rows' own K/V (already written): the kernels read everything from the
        pages; the pure-JAX prompt path takes each chunk's own rows from here and only earlier context from
        the pages.
        """
        kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
        if is_latent(k_pages, v_pages):  # the values are the keys' own entries: read from the one pool
            v, v_pages = k, k_pages
        if isinstance(k_pages, QuantizedPages):
            # The pages dequantize what they are asked for as they are gathered; a chunk's own rows are taken as
            # they read back from the pool, so the result does not depend on how a prompt was chunked.
            self.check_quantized()
            k, v = fake_quantize(k, k_pages.storage_dtype), fake_quantize(v, v_pages.storage_dtype)  # dt[T, K, D]
        # Each returns dt[T, H, D].
        if self.name == "pallas_tpu":
            return rpa.ragged_paged_attention_tpu(q, k_pages, v_pages, md, interpret=self.interpret, **kw)
        if self.name == "pallas_gpu":
            return rpa.ragged_paged_attention_gpu(q, k_pages, v_pages, md, interpret=self.interpret, **kw)
        if self.name == "pallas_mosaic_gpu":  # its module is imported by its users only (see the package)
            from pallas_kernels.ragged_paged_attention.mosaic_gpu import ragged_paged_attention_mosaic_gpu

            return ragged_paged_attention_mosaic_gpu(q, k_pages, v_pages, md, interpret=self.interpret, **kw)
        if self.decode:  # each row walks its own sequence's pages
            return rpa.ragged_paged_attention_rows(q, k_pages, v_pages, md, **kw)
        # The pages hold this step's rows already (``__call__`` writes, then attends).
        return rpa.ragged_paged_attention_chunks(q, k, v, k_pages, v_pages, md, pages_hold_rows=True, **kw)


def latent_value_shape(k_shape: tuple) -> tuple:
    """The value pool's placeholder beside a latent pool kv[K, num_pages, page_size, D]: kv[K, num_pages, 1, 1],
    one value per page that nothing reads (a pool of width 0 would be exact, but XLA:CPU cannot shard one)."""
    return tuple(k_shape[:2]) + (1, 1)


def is_latent(k_pages, v_pages) -> bool:
    """Whether a layer's pools are a latent pool and its placeholder (``latent_value_shape``): multi-head latent
    attention (``models/mla.py``), whose values are the first columns of the key pool's entries. Attention then
    writes the keys only, reads the keys' pages as the values too, and its output has the key's width."""
    return v_pages.shape != k_pages.shape


CACHE_AXES = ("cache_kv_heads", "cache_pages", "page_size", "head_dim")  # the logical axes of kv[K, num_pages, ...]


def window_metadata(md: AttentionMetadata, offset: jax.Array, rows: int) -> AttentionMetadata:
    """Metadata for query rows ``offset .. offset + rows - 1`` of a ragged batch, as a batch of its own.

    Each sequence keeps the part of its rows inside the window (possibly none); its ``kv_len`` drops by the
    rows it has after the window, so every row keeps its absolute position. Sequences with no rows in the
    window get ``kv_len`` 0.
    """
    cu = jnp.clip(md.cu_q_lens - offset, 0, rows)  # i32[S + 1]: the window's cumulative rows
    after = jnp.maximum(md.cu_q_lens[1:] - (offset + rows), 0)  # i32[S]: each sequence's rows past the window
    q_lens = cu[1:] - cu[:-1]  # i32[S]
    kv_lens = jnp.where(q_lens > 0, md.kv_lens - after, 0)  # i32[S]
    return AttentionMetadata(cu, kv_lens, md.page_indices, md.num_seqs)  # page_indices i32[S, P], num_seqs i32[1]


@dataclasses.dataclass(frozen=True)
class ShardedAttention:
    """Attention on a mesh: each shard runs the unchanged ``AttentionBackend`` on its own heads, pages and rows.

    Hashable (a static argument of the compiled steps), with the backend's call signature; arrays are global
    (sharded) and the metadata is stacked over data replicas (a leading axis, one block per replica). Inside
    one ``shard_map``:

    - ``tensor``: a shard gets its q heads, the K/V heads they read, and the cache pages of those heads. When
      ``tensor`` exceeds the KV-head count, K/V arrive replicated and the shard keeps head
      ``tensor_index // (tensor / num_kv_heads)``; its cache holds that head alone (see ``sharding.rules``).
    - ``data``: a shard gets its replica's rows, metadata and page block (page ids are replica-local).
    - ``sequence`` (prefill steps whose layout splits it): K/V of the replica's whole chunk come in (the
      shard_map boundary all-gathers them over ``sequence``), every sequence shard writes all of them, so the
      cache copies stay identical, then attends for its own query rows only, through ``window_metadata``.

    The cache is never gathered: each device reads and writes only the pages it holds.
    """

    backend: AttentionBackend
    layout: StepLayout
    num_kv_heads: int

    def specs(self, q_shape, kv_shape, pages, num_replicas: int):
        lay = self.layout
        rows = lay.spec(("tokens",), q_shape[:1])[0]
        q_spec = P(rows, lay.spec(("act_heads",), q_shape[1:2])[0], None)
        replicas = lay.spec(("replicas",), (num_replicas,))[0]
        kv_spec = P(replicas, lay.spec(("act_kv_heads",), kv_shape[1:2])[0], None)
        page_spec = jax.tree.map(lambda a: lay.spec(CACHE_AXES, a.shape), pages)  # a QuantizedPages: each part's
        return q_spec, kv_spec, page_spec, replicas

    def __call__(
        self,
        q: jax.Array,  # dt[R * T, H, D]
        k: jax.Array,  # dt[R * T, K, D]
        v: jax.Array,  # dt[R * T, K, D]
        k_pages: jax.Array,  # kv[cache_heads, R * pages_per_replica, page_size, D]
        v_pages: jax.Array,  # kv[cache_heads, R * pages_per_replica, page_size, D]
        md: AttentionMetadata,  # every field with a leading replica axis R: cu_q_lens i32[R, S + 1], ...
        *,
        sm_scale: float,
        sliding_window: int | None,
        soft_cap: float | None = None,
        sinks: jax.Array | None = None,  # f32[H]
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        lay, backend, nkv = self.layout, self.backend, self.num_kv_heads
        num_replicas = md.cu_q_lens.shape[0]
        q_spec, kv_spec, page_spec, replicas = self.specs(q.shape, k.shape, k_pages, num_replicas)
        md_spec = jax.tree.map(lambda a: P(replicas, *([None] * (a.ndim - 1))), md)
        tensor = lay.size("tensor")
        split = lay.split_sequence
        static = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)

        def local(q, k, v, k_pages, v_pages, md, sinks=None):
            """One shard's blocks: q dt[T', H', D] (its rows and heads); k, v dt[T, K', D] (the replica's whole
            chunk; all K heads when they are replicated over tensor, sliced below); the pages kv[K',
            pages_per_replica, page_size, D]; sinks f32[H'] (its heads') or None."""
            kw = dict(static, sinks=sinks)
            md = jax.tree.map(lambda a: a[0], md)  # this replica's block: cu_q_lens i32[S + 1], ...
            if k.shape[1] != k_pages.shape[0]:
                # KV heads replicated over tensor: keep the one this shard's q heads read.
                head = jax.lax.axis_index("tensor") // (tensor // nkv) * k_pages.shape[0]
                k = jax.lax.dynamic_slice_in_dim(k, head, k_pages.shape[0], axis=1)  # dt[T, K', D]
                v = jax.lax.dynamic_slice_in_dim(v, head, k_pages.shape[0], axis=1)  # dt[T, K', D]
            if not split:
                return backend(q, k, v, k_pages, v_pages, md, **kw)  # (dt[T', H', D], the pages)
            k_pages, v_pages = backend.write(k, v, k_pages, v_pages, md)
            rows = q.shape[0]
            offset = jax.lax.axis_index("sequence") * rows
            # dt[T, K', D] -> dt[T', K', D]
            mine = lambda a: jax.lax.dynamic_slice_in_dim(a, offset, rows)  # noqa: E731  this shard's rows
            # dt[T', H', D]
            out = backend.attend(q, mine(k), mine(v), k_pages, v_pages, window_metadata(md, offset, rows), **kw)
            return out, k_pages, v_pages

        if lay.mesh.size == 1:
            return local(q, k, v, k_pages, v_pages, md, sinks)
        in_specs, args = (q_spec, kv_spec, kv_spec, page_spec, page_spec, md_spec), (q, k, v, k_pages, v_pages, md)
        if sinks is not None:  # split over tensor with the q heads
            in_specs, args = in_specs + (P(q_spec[1]),), args + (sinks,)
        return jax.shard_map(  # (dt[R * T, H, D], the pages)
            local, mesh=lay.mesh, in_specs=in_specs, out_specs=(q_spec, page_spec, page_spec), check_vma=False,
        )(*args)
