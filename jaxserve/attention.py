"""The attention seam: how the model writes new K/V into the page pool and attends over it.

The model calls one ``AttentionBackend``; which implementation runs (the pure-JAX reference, the Pallas TPU
kernel, the Pallas GPU kernel) is chosen here and nowhere else.
"""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_auto, write_kv


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """The ragged-batch description every attention implementation reads (see pallas_kernels metadata)."""

    cu_q_lens: jax.Array  # i32[S + 1]
    kv_lens: jax.Array  # i32[S]
    page_indices: jax.Array  # i32[S, P]
    num_seqs: jax.Array  # i32[1]


BACKENDS = ("reference",)


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """A hashable choice of attention implementation, passed to the compiled steps as a static argument."""

    name: str = "reference"
    decode: bool = False  # every sequence has one new token (the decode step's batches)

    def __post_init__(self):
        if self.name not in BACKENDS:
            raise ValueError(f"attention_backend={self.name!r} is not one of {BACKENDS}")

    @classmethod
    def resolve(cls, name: str) -> "AttentionBackend":
        """``"auto"`` picks the best implementation for the default device."""
        if name == "auto":
            name = "reference"
        return cls(name)

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
        meta = (md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs)
        k_pages, v_pages = write_kv(k_pages, v_pages, k, v, *meta)
        # Decode rows each belong to their own sequence, so the per-row reference reads exactly what is needed;
        # prefill batches gather each sequence's pages once when they hold few sequences.
        attend = ragged_paged_attention if self.decode else ragged_paged_attention_auto
        out = attend(q, k_pages, v_pages, *meta, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
        return out, k_pages, v_pages
