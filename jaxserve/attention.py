"""The attention seam: how the model writes new K/V into the page pool and attends over it.

The model calls one ``AttentionBackend``; which implementation runs (the pure-JAX reference, the Pallas TPU
kernel, the Pallas GPU kernel) is chosen here and nowhere else.

On a mesh, ``sharding.attention.ShardedAttention`` calls the backend once per shard with that shard's heads,
pages and metadata, so a kernel sees exactly the single-device contract. Sequence-parallel prefill calls the
two halves separately (``write`` all of a chunk's rows, then ``attend`` for a window of them), with window
metadata in which some sequences have zero query rows (and ``kv_len`` 0); ``attend`` must accept that.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.engine_config import ATTENTION_BACKENDS
from pallas_kernels import ragged_paged_attention as rpa


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """The ragged-batch description every attention implementation reads (see pallas_kernels metadata)."""

    cu_q_lens: jax.Array  # i32[S + 1]
    kv_lens: jax.Array  # i32[S]
    page_indices: jax.Array  # i32[S, P]
    num_seqs: jax.Array  # i32[1]


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

    @classmethod
    def resolve(cls, name: str, platform: str | None = None) -> "AttentionBackend":
        """A backend for ``platform`` (default: jax's default backend).

        ``"auto"`` is the TPU kernel on TPU, the GPU kernel on GPU and the pure-JAX reference on CPU; a Pallas
        kernel asked for on a CPU runs in interpret mode (slow: for tests and debugging).
        """
        platform = platform or jax.default_backend()
        if name == "auto":
            name = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(platform, "reference")
        interpret = name.startswith("pallas_") and platform == "cpu"
        return cls(name, interpret=interpret)

    def __call__(
        self,
        q: jax.Array,  # [T, num_q_heads, head_dim]
        k: jax.Array,  # [T, num_kv_heads, head_dim]
        v: jax.Array,  # [T, num_kv_heads, head_dim]
        k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
        v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
        md: AttentionMetadata,
        *,
        sm_scale: float,
        sliding_window: int | None,
        soft_cap: float | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Write this step's K/V, then attend. Returns (out [T, num_q_heads, head_dim], k_pages, v_pages)."""
        k_pages, v_pages = self.write(k, v, k_pages, v_pages, md)
        out = self.attend(q, k, v, k_pages, v_pages, md, sm_scale=sm_scale, sliding_window=sliding_window,
                          soft_cap=soft_cap)
        return out, k_pages, v_pages

    # The two halves, for callers whose query rows are a subset of the rows written (sequence parallelism:
    # every sequence shard writes all of a chunk's K/V, then attends for its own rows only).
    def write(self, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
              md: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
        """Write each real row's K/V into its page slot. Returns (k_pages, v_pages)."""
        meta = (md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs)
        if self.name == "pallas_tpu":
            return rpa.write_kv_tpu(k_pages, v_pages, k, v, *meta, interpret=self.interpret)
        if self.name == "pallas_gpu":
            return rpa.write_kv_gpu(k_pages, v_pages, k, v, *meta, interpret=self.interpret)
        return rpa.write_kv(k_pages, v_pages, k, v, *meta)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
               md: AttentionMetadata, *, sm_scale: float, sliding_window: int | None,
               soft_cap: float | None = None) -> jax.Array:
        """Attention of ``q``'s rows over pages that already hold their K/V. Returns [T, num_q_heads, head_dim].

        ``k`` and ``v`` are the same rows' own K/V (already written): the kernels read everything from the
        pages; the pure-JAX prompt path takes each chunk's own rows from here and only earlier context from
        the pages.
        """
        meta = (md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs)
        kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
        if self.name == "pallas_tpu":
            return rpa.ragged_paged_attention_tpu(q, k_pages, v_pages, *meta, interpret=self.interpret, **kw)
        if self.name == "pallas_gpu":
            return rpa.ragged_paged_attention_gpu(q, k_pages, v_pages, *meta, interpret=self.interpret, **kw)
        if self.decode:  # each row walks its own sequence's pages
            return rpa.ragged_paged_attention_rows(q, k_pages, v_pages, *meta, **kw)
        return rpa.ragged_paged_attention_chunks(q, k, v, k_pages, v_pages, *meta, **kw)
