"""Device page movers: a sequence's KV pages out of one runner's pool (``PageReader``), into another's
(``PageWriter``), or from one to the other device to device (``KVMover``), on any meshes of the same model and KV
cache dtype. An executor offers its pool to them as ``KVPages`` (``Executor.kv_pages``). Prefill/decode
disaggregation moves pages with them, in one process (``jaxserve.disagg.staged``) and across processes
(``jaxserve.disagg.prefill``, ``jaxserve.disagg.remote``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.executor.kv_cache import uses_local_pool
from jaxserve.scheduler.block_manager import RELEASED, PageHolder
from jaxserve.scheduler.sequence import Sequence
from pallas_kernels.quantized_pages import QuantizedPages


def _parts(pages) -> tuple:
    """The arrays one layer's K (or V) pool keeps: its values, and an 8-bit pool's scales after them."""
    return (pages.values, pages.scales) if isinstance(pages, QuantizedPages) else (pages,)


class PageReader:
    """Takes a sequence's KV pages out of a runner's pool into compact arrays on that runner's mesh.

    One jitted gather over every layer (the windowed layers read the model's windowed pool where it has one)
    into a tuple of ``[layers, 2 (K, V), cache heads, pages, page_size, head_dim]`` arrays (1, the latent, for
    multi-head latent attention): the values, and for
    an 8-bit pool its scales (``head_dim`` 1) after them, so the scales move with the values they belong to.
    Heads split over ``tensor`` as in the cache, pages whole. Page counts are padded to powers of two so few
    shapes compile (padded rows read page 0).
    """

    def __init__(self, runner):
        self.runner = runner
        cfg = runner.cfg
        self.local = [uses_local_pool(cfg, runner.cache_cfg, layer) for layer in range(cfg.num_layers)]
        self.latent = cfg.mla is not None
        spec = _parts(runner.kv_cache[0][0])[0].sharding.spec
        self.heads = int(runner.kv_cache[0][0].shape[0])
        sharding = NamedSharding(runner.mesh, PartitionSpec(None, None, _first(spec)))
        self._gather = jax.jit(self._gather_fn,
                               out_shardings=tuple(sharding for _ in _parts(runner.kv_cache[0][0])))

    def _gather_fn(self, cache, full_ids, local_ids):
        out = [[] for _ in _parts(cache[0][0])]
        for (k, v), local in zip(cache, self.local):
            ids = local_ids if local else full_ids
            for part, kp, vp in zip(out, _parts(k), _parts(v)):
                # a latent pool (multi-head latent attention) moves its keys only: the values are their prefix
                part.append(jnp.stack([kp[:, ids]] if self.latent else [kp[:, ids], vp[:, ids]]))
        return tuple(jnp.stack(part) for part in out)

    def read(self, replica: int, holder: PageHolder, num_tokens: int):
        """(staged arrays, table positions of their full-pool rows, of their windowed-pool rows, bytes of KV
        (scales included)): the pages holding ``holder``'s first ``num_tokens`` tokens that it still holds."""
        cc = self.runner.cache_cfg
        held = -(-num_tokens // cc.page_size)
        full = [i for i, p in enumerate(holder.page_table[:held]) if p != RELEASED]
        local = [i for i, p in enumerate(holder.local_page_table[:held]) if p != RELEASED]
        width = _width(max(len(full), len(local), 1))
        local_per = cc.num_local_pages // cc.num_replicas if cc.num_local_pages else 0
        staged = self._gather(self.runner.kv_cache,
                              _ids([holder.page_table[i] for i in full], width, replica * cc.pages_per_replica, 0),
                              _ids([holder.local_page_table[i] for i in local], width, replica * local_per, 0))
        per_layer_page = sum(a.nbytes for a in staged) // (width * len(self.local))
        nbytes = per_layer_page * sum(len(local) if lo else len(full) for lo in self.local)
        return staged, full, local, int(nbytes)


class PageWriter:
    """Writes pages taken by a ``PageReader`` (of any runner of the same model and KV cache dtype, any mesh)
    into this runner's pool: ``jax.device_put`` onto this mesh, then a jitted scatter (cache donated) into the
    sequence's pages, an 8-bit pool's scales with its values. Cache heads are remapped when the reader's mesh
    stores the model's KV heads differently (another ``tensor`` size); rows for pages this pool released behind
    a window, and padded rows, are dropped."""

    def __init__(self, runner):
        self.runner = runner
        cfg = runner.cfg
        self.local = [uses_local_pool(cfg, runner.cache_cfg, layer) for layer in range(cfg.num_layers)]
        self.heads = int(runner.kv_cache[0][0].shape[0])
        self._head_spec = _first(_parts(runner.kv_cache[0][0])[0].sharding.spec)
        self._scatters: dict[int, object] = {}

    def staging(self, src_heads: int) -> NamedSharding:
        """Where staged pages from a cache of ``src_heads`` heads go on this mesh."""
        if src_heads == self.heads:
            return NamedSharding(self.runner.mesh, PartitionSpec(None, None, self._head_spec))
        return NamedSharding(self.runner.mesh, PartitionSpec())

    def _scatter(self, src_heads: int):
        fn = self._scatters.get(src_heads)
        if fn is None:
            kv, latent = self.runner.cfg.num_kv_heads, self.runner.cfg.mla is not None
            # This cache's head c holds model head c * kv // heads; take it from a source head holding it.
            head_map = np.array([(c * kv // self.heads) * src_heads // kv for c in range(self.heads)], np.int32)

            def put(pages, rows, ids):
                if isinstance(pages, QuantizedPages):  # rows: (values, scales), stored as they were
                    values = rows[0]
                    if values.dtype != pages.values.dtype:  # fp8 from a pool that holds it as bytes, or to one
                        values = jax.lax.bitcast_convert_type(values, pages.values.dtype)
                    return pages.with_arrays(pages.values.at[:, ids].set(values, mode="drop"),
                                             pages.scales.at[:, ids].set(rows[1], mode="drop"))
                return pages.at[:, ids].set(rows[0].astype(pages.dtype), mode="drop")

            def scatter(cache, staged, full_ids, local_ids):
                if src_heads != self.heads:
                    staged = tuple(a[:, :, head_map] for a in staged)
                out = []
                for layer, ((k, v), local) in enumerate(zip(cache, self.local)):
                    ids = local_ids if local else full_ids
                    out.append((put(k, [a[layer, 0] for a in staged], ids),
                                v if latent else put(v, [a[layer, 1] for a in staged], ids)))
                return out

            fn = self._scatters[src_heads] = jax.jit(
                scatter, donate_argnums=(0,), out_shardings=jax.tree.map(lambda a: a.sharding, self.runner.kv_cache))
        return fn

    def check(self, dtypes: list) -> None:
        """ValueError unless pages of these part dtypes (values first, then any scales) fit this pool."""
        mine = [a.dtype for a in _parts(self.runner.kv_cache[0][0])]
        quantized = len(mine) == 2
        if len(dtypes) != len(mine) or (quantized and jnp.dtype(dtypes[0]) != mine[0]):
            raise ValueError(f"kv_cache_dtype: the pages sent are {_kind(dtypes)}, this pool is {_kind(mine)}; "
                             "both sides need the same --kv-cache-dtype")

    def write(self, staged, full: list[int], local: list[int], replica: int, seq: Sequence):
        """Dispatch the write of ``staged`` (a ``PageReader``'s tuple of jax arrays on any mesh, or of NumPy
        arrays) into ``seq``'s tables at positions ``full``/``local``; returns the staged arrays as placed on
        this mesh."""
        self.check([a.dtype for a in staged])
        cc = self.runner.cache_cfg
        width = staged[0].shape[3]
        src_heads = int(staged[0].shape[2])
        moved = tuple(jax.device_put(a, self.staging(src_heads)) for a in staged)
        local_per = cc.num_local_pages // cc.num_replicas if cc.num_local_pages else 0
        full_ids = _ids([seq.page_table[i] for i in full], width, replica * cc.pages_per_replica, cc.num_pages,
                        released=cc.num_pages)
        local_ids = _ids([seq.local_page_table[i] for i in local], width, replica * local_per,
                         max(cc.num_local_pages, 1), released=max(cc.num_local_pages, 1))
        self.runner.kv_cache = self._scatter(src_heads)(self.runner.kv_cache, moved, full_ids, local_ids)
        return moved


class KVPages:
    """One executor's pool as disaggregation moves it (``jaxserve.executor.protocol.KVPages``): pages read out
    through a ``PageReader``, written in through a ``PageWriter``, each made on first use."""

    def __init__(self, runner):
        self._runner = runner
        self._reader: PageReader | None = None
        self._writer: PageWriter | None = None

    def read(self, replica: int, holder: PageHolder, num_tokens: int):
        """``PageReader.read`` of this pool."""
        if self._reader is None:
            self._reader = PageReader(self._runner)
        return self._reader.read(replica, holder, num_tokens)

    def write(self, staged, full: list[int], local: list[int], replica: int, seq: Sequence):
        """``PageWriter.write`` into this pool."""
        if self._writer is None:
            self._writer = PageWriter(self._runner)
        return self._writer.write(staged, full, local, replica, seq)


class KVMover:
    """Copies a sequence's KV pages from one executor's pool into another's, device to device (read on the source
    mesh, ``jax.device_put``, written on the destination mesh)."""

    def __init__(self, src: KVPages, dst: KVPages):
        self.src, self.dst = src, dst

    def copy(self, src_replica: int, holder: PageHolder, dst_replica: int, seq: Sequence) -> tuple[list, int]:
        """Dispatch the copy of ``holder``'s pages into ``seq``'s (destination) tables; returns the staged arrays
        on the destination mesh (ready once the pages have left the source) and the bytes of KV moved."""
        staged, full, local, nbytes = self.src.read(src_replica, holder, seq.num_computed_tokens)
        moved = self.dst.write(staged, full, local, dst_replica, seq)
        return list(moved), nbytes


def _kind(dtypes: list) -> str:
    return f"{jnp.dtype(dtypes[0]).name} with scales" if len(dtypes) == 2 else "unquantized"


def _first(spec: PartitionSpec):
    return spec[0] if len(spec) else None


def _width(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _ids(pages: list[int], width: int, offset: int, pad: int, *, released: int | None = None) -> np.ndarray:
    """Global page ids (replica block ``offset``) padded to ``width`` with ``pad``; a ``RELEASED`` entry becomes
    ``released`` (a write that is dropped)."""
    out = np.full(width, pad, np.int32)
    for j, p in enumerate(pages):
        if p == RELEASED:
            if released is None:
                raise AssertionError("a released page cannot be read")
            out[j] = released
        else:
            out[j] = p + offset
    return out
