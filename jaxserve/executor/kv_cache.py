"""The paged KV cache on device: one (k_pages, v_pages) pair per layer.

Layout of each array: ``[cache_heads, num_pages, page_size, head_dim]``. The leading KV-head axis is what
tensor parallelism shards (logical axis ``cache_kv_heads``), so a shard holds whole pages of its heads and
attention never gathers the cache across devices; ``cache_heads`` is the model's KV-head count, or ``tensor``
when that is larger (each KV head then stored once per tensor shard that reads it). The page axis is split
over ``data`` (``cache_pages``): replica ``r`` owns pages ``r * P .. (r + 1) * P - 1`` and its page tables
use local ids ``0 .. P - 1``. The cache is replicated over ``sequence``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.models.config import ModelConfig
from pallas_kernels.quantized_pages import QuantizedPages, is_quantized_dtype
from sharding.rules import cache_heads, logical_sharding

CACHE_AXES = ("cache_kv_heads", "cache_pages", "page_size", "head_dim")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Page size and count of the pool (all data replicas together, an equal block each); the dtype is the
    attention backend's choice for the model's (`AttentionBackend.cache_dtype`)."""

    page_size: int = 16
    num_pages: int = 512
    num_replicas: int = 1  # the mesh's data axis
    num_local_pages: int = 0  # the windowed layers' own pool (all replicas), for models interleaving them; 0: none

    def __post_init__(self):
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size} must be a power of two")
        if self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages} must be >= 2")
        if self.num_local_pages % self.num_replicas:
            raise ValueError(f"num_local_pages={self.num_local_pages} must be a multiple of the mesh's "
                             f"data={self.num_replicas}")
        if self.num_pages % self.num_replicas:
            raise ValueError(f"num_pages={self.num_pages} must be a multiple of the mesh's data={self.num_replicas} "
                             "(each data replica owns an equal block of pages)")

    @property
    def pages_per_replica(self) -> int:
        return self.num_pages // self.num_replicas


def bytes_per_token(cfg: ModelConfig, dtype, tensor: int = 1) -> int:
    """KV bytes one token occupies across all layers (K and V) on each device holding it: with ``tensor`` > 1,
    a tensor shard's heads (replicated heads included); with 1, the whole token (the seed formula
    2 * layers * kv_heads * head_dim * bytes). An 8-bit pool adds its scales: one float32 per token, KV head and
    K or V (``pallas_kernels.quantized_pages``)."""
    heads = cache_heads(cfg.num_kv_heads, tensor) // tensor
    scales = SCALE_BYTES if is_quantized_dtype(dtype) else 0
    return 2 * cfg.num_layers * heads * (cfg.head_dim * jnp.dtype(dtype).itemsize + scales)


SCALE_BYTES = 4  # one f32 scale per token and KV head of an 8-bit pool


def cache_sharding(cfg: ModelConfig, cache: CacheConfig, mesh: Mesh, num_pages: int | None = None):
    shape = (cache_heads(cfg.num_kv_heads, int(mesh.shape["tensor"])), num_pages or cache.num_pages,
             cache.page_size, cfg.head_dim)
    return shape, logical_sharding(CACHE_AXES, shape, mesh)


def uses_local_pool(cfg: ModelConfig, cache: CacheConfig, layer: int) -> bool:
    """Whether ``layer`` keeps its pages in the windowed layers' own pool."""
    return bool(cache.num_local_pages) and cfg.sliding_windows[layer] is not None


def init_kv_cache(cfg: ModelConfig, cache: CacheConfig, dtype, mesh: Mesh) -> list[tuple[jax.Array, jax.Array]]:
    """Zeroed pages, created directly in their sharding (never materialised on one device first); windowed
    layers get ``num_local_pages`` pages when the cache has a windowed pool."""
    out = []
    for layer in range(cfg.num_layers):
        local = uses_local_pool(cfg, cache, layer)
        shape, sharding = cache_sharding(cfg, cache, mesh, cache.num_local_pages if local else None)
        if is_quantized_dtype(dtype):  # 8-bit values and their scales, each sharded the same way
            scale_sharding = logical_sharding(CACHE_AXES, shape[:-1] + (1,), mesh)
            zeros = jax.jit(lambda shape=shape: QuantizedPages.zeros(shape, dtype),
                            out_shardings=QuantizedPages(sharding, scale_sharding))
        else:
            zeros = jax.jit(lambda shape=shape: jnp.zeros(shape, dtype), out_shardings=sharding)
        out.append((zeros(), zeros()))
    return out
