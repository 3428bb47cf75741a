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
import functools
import logging
from collections.abc import Sequence as Seq

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.config.engine import KV_CACHE_DTYPES
from jaxserve.models.attention import latent_value_shape
from jaxserve.models.config import ModelConfig
from jaxserve.scheduler.window_pool import global_pool_budget, window_pages_needed
from pallas_kernels.gpu_addressing import max_pool_pages, pool_limit_message
from pallas_kernels.quantized_pages import STORAGE, QuantizedPages, is_quantized_dtype
from sharding.rules import cache_heads, logical_sharding

logger = logging.getLogger(__name__)

CACHE_AXES = ("cache_kv_heads", "cache_pages", "page_size", "head_dim")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Page size and count of the pool (all data replicas together, an equal block each); the dtype is the
    attention backend's choice for the model's (`AttentionBackend.cache_dtype`)."""

    page_size: int = 16
    num_pages: int = 512
    num_replicas: int = 1  # the mesh's data axis
    num_local_pages: int = 0  # the windowed layers' own pool (all replicas), for models interleaving them; 0: none
    num_state_slots: int = 0  # a hybrid model's state slots (slot 0 scratch), for its linear layers; 0: none

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
    K or V (``pallas_kernels.quantized_pages``). Multi-head latent attention caches one entry per token and layer
    (the latent and the rotary key, ``head_dim`` = ``MlaConfig.latent_dim``), replicated on each tensor shard."""
    heads = cache_heads(cfg.num_kv_heads, tensor) // tensor
    scales = SCALE_BYTES if is_quantized_dtype(dtype) else 0
    if cfg.mla is not None:  # one latent entry per token and layer, no separate values (models/mla.py)
        return cfg.num_attention_layers * heads * (cfg.head_dim * jnp.dtype(dtype).itemsize + scales)
    return 2 * cfg.num_attention_layers * heads * (cfg.head_dim * jnp.dtype(dtype).itemsize + scales)


def state_slots_for(cfg: ModelConfig, max_num_seqs: int) -> int:
    """State slots of a hybrid model's pool: one per running sequence, plus the scratch slot 0; 0 for a model
    without linear-attention layers."""
    return 0 if cfg.linear_attention is None else max_num_seqs + 1


def state_pool_bytes(cfg: ModelConfig, max_num_seqs: int) -> int:
    """Bytes of a hybrid model's state pool (every slot, every linear layer; replicated on each device)."""
    slots = state_slots_for(cfg, max_num_seqs)
    return slots * cfg.linear_attention.state_bytes if slots else 0


SCALE_BYTES = 4  # one f32 scale per token and KV head of an 8-bit pool


def kv_storage_dtype(kv_cache_dtype: str, auto_dtype):
    """The pool's element dtype for ``kv_cache_dtype`` (``EngineConfig``): ``auto_dtype`` as given for "auto"
    (the attention backend's dtype for the model's, ``AttentionBackend.cache_dtype``), else the 8-bit storage
    format (``pallas_kernels.quantized_pages.STORAGE``: "fp8" is e4m3). The engine, ``capacity`` and ``aot`` all
    take their pool's dtype from here, so a pool is sized in the dtype it is allocated in."""
    if kv_cache_dtype == "auto":
        return auto_dtype
    if kv_cache_dtype not in STORAGE:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be one of {', '.join(KV_CACHE_DTYPES)}")
    return jnp.dtype(STORAGE[kv_cache_dtype])


def local_pool_pages(windows: Seq[int | None], page_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                     *, global_pages: int | None = None) -> int:
    """Pages (per replica) of the windowed layers' own pool for a model interleaving windowed and global layers
    (``ModelConfig.local_window``): as many as the windows of ``max_num_seqs`` sequences need, and never more
    than ``global_pages`` (the global pool's, per replica, once known: a sequence's windowed table never holds
    more pages than its global one); 0 when all or none of the layers are windowed (one pool)."""
    given = [w for w in windows if w is not None]
    if not given or len(given) == len(windows):
        return 0
    pages = window_pages_needed(max(given), page_size, max_num_seqs, max_num_batched_tokens)
    return pages if global_pages is None else min(pages, global_pages)


def pool_pages(memory: float, bytes_per_token: float, page_size: int, *, utilization: float = 1.0,
               used: float = 0.0, windows: Seq[int | None] = (), local_pages: int = 0,
               extra_bytes_per_token: float = 0.0, max_pages: int | None = None) -> int:
    """KV pages of ``page_size`` tokens that fit in ``memory * utilization - used`` bytes of one device (on the
    CPU path, of one replica's share): the one sizing rule (through ``builder.PoolSizing``) of the engine,
    ``capacity``, ``aot`` and ``plan``, so all four give the same count for the same model and budget.

    ``bytes_per_token``: what a token costs on that device (``bytes_per_token`` of its tensor shard). A model
    interleaving windowed and global layers (``windows``) first sets its windowed layers' own pool of
    ``local_pages`` pages aside (``local_pool_pages``); each global page then holds only the global layers' KV
    (``global_pool_budget``). ``extra_bytes_per_token``: a pool paged in step with this one (a draft model's).
    ``max_pages``: at most this many (the engine's ``max_num_seqs`` full-length sequences); may be negative
    when the budget is, which callers report."""
    budget = memory * utilization - used
    page_bytes = bytes_per_token * page_size
    if local_pages:
        budget, page_bytes = global_pool_budget(budget, page_bytes, windows, local_pages)
    fit = budget // (page_bytes + extra_bytes_per_token * page_size)
    return int(fit if max_pages is None else min(max_pages, fit))


def limit_gpu_pool(pages_per_replica: int, page_size: int, pools: Seq[tuple[str, int, int, int]], *,
                   automatic: bool) -> int:
    """Pages per replica of a pool the GPU attention kernels read: those kernels index one layer's pool on one
    device with 32-bit integers (``pallas_kernels.gpu_addressing``), so it must hold fewer than 2**31 rows, or
    fewer than 2**31 elements when 8-bit.

    ``pools``: (what, KV heads per device, head_dim, bytes per stored element) of every model paged in step with
    this pool (the target's, a draft model's). A pool sized from memory (``automatic``) is capped below the
    limit, with a log line; a ``num_pages`` asked for is refused with a ValueError naming the sizes."""
    for what, heads, head_dim, itemsize in pools:
        message = pool_limit_message(heads, pages_per_replica, page_size, head_dim, itemsize)
        if message is None:
            continue
        cap = max_pool_pages(heads, page_size, head_dim, itemsize)
        if not automatic:
            raise ValueError(f"{what}: {message}; lower num_pages to {cap} per data replica or less, or shard the "
                             "KV heads over more devices (tensor parallelism)")
        logger.warning("%s: capping the KV pool sized from memory at %d pages per replica (from %d): %s", what, cap,
                       pages_per_replica, message)
        pages_per_replica = cap
    return pages_per_replica


def cache_sharding(cfg: ModelConfig, cache: CacheConfig, mesh: Mesh, num_pages: int | None = None):
    shape = (cache_heads(cfg.num_kv_heads, int(mesh.shape["tensor"])), num_pages or cache.num_pages,
             cache.page_size, cfg.head_dim)
    return shape, logical_sharding(CACHE_AXES, shape, mesh)


def state_arrays(cfg: ModelConfig, num_slots: int, mesh: Mesh) -> list[tuple[tuple, NamedSharding]]:
    """(shape, sharding) of a linear layer's two state arrays: the convolution's inputs f32[slots, W, conv_dim],
    replicated (small), and the delta rule's f32[slots, Hv, Dk, Dv], split by value head over ``tensor`` where
    the heads divide."""
    la, tensor = cfg.linear_attention, int(mesh.shape["tensor"])
    heads = "tensor" if la.num_v_heads % tensor == 0 else None
    return [((num_slots, *la.conv_state_shape()), NamedSharding(mesh, PartitionSpec())),
            ((num_slots, *la.recurrent_state_shape()), NamedSharding(mesh, PartitionSpec(None, heads, None, None)))]


def uses_local_pool(cfg: ModelConfig, cache: CacheConfig, layer: int) -> bool:
    """Whether ``layer`` keeps its pages in the windowed layers' own pool."""
    return bool(cache.num_local_pages) and cfg.sliding_windows[layer] is not None


def init_kv_cache(cfg: ModelConfig, cache: CacheConfig, dtype, mesh: Mesh) -> list[tuple[jax.Array, jax.Array]]:
    """Zeroed pages, created directly in their sharding (never materialised on one device first); windowed
    layers get ``num_local_pages`` pages when the cache has a windowed pool. A latent pool (``cfg.mla``) has a
    placeholder for values (``models.attention.latent_value_shape``)."""
    out = []
    for layer in range(cfg.num_layers):
        if cfg.is_linear(layer):  # a hybrid's linear layer: its state slots, not pages (models/gated_deltanet.py)
            out.append(tuple(_zeros(shape, jnp.float32, sharding, None)()
                             for shape, sharding in state_arrays(cfg, cache.num_state_slots, mesh)))
            continue
        local = uses_local_pool(cfg, cache, layer)
        shape, sharding = cache_sharding(cfg, cache, mesh, cache.num_local_pages if local else None)
        scale_sharding = (logical_sharding(CACHE_AXES, shape[:-1] + (1,), mesh) if is_quantized_dtype(dtype)
                          else None)
        on_cpu = mesh.devices.flat[0].platform == "cpu"  # fp8 held as bytes there (QuantizedPages)
        zeros = _zeros(tuple(shape), dtype, sharding, scale_sharding, on_cpu)
        if cfg.mla is None:
            out.append((zeros(), zeros()))
            continue
        # Multi-head latent attention: the values are the latent entries' prefix; their pool is a placeholder
        v_shape = latent_value_shape(shape)
        v_sharding = logical_sharding(CACHE_AXES, v_shape, mesh)
        out.append((zeros(), _zeros(v_shape, dtype, v_sharding, scale_sharding, on_cpu)()))
    return out


@functools.lru_cache(maxsize=None)
def _zeros(shape: tuple, dtype, sharding, scale_sharding, fp8_as_bytes: bool = False):
    """The jitted zero-fill of one pool shape, kept: a pool made again (``wake_up``, a lost cache) compiles
    nothing. 8-bit pools: values and their scales, each sharded the same way (fp8 values as their bytes on CPU,
    see ``QuantizedPages``)."""
    if scale_sharding is not None:
        make = functools.partial(QuantizedPages.zeros, shape, dtype, fp8_as_bytes=fp8_as_bytes)
        return jax.jit(make, out_shardings=jax.eval_shape(make).with_arrays(sharding, scale_sharding))
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
