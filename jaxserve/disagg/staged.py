"""Prefill/decode disaggregation in one process: a prefill engine and a decode engine on disjoint device groups.

``--prefill-mesh tensor=4 --decode-mesh tensor=4`` builds two executors: the prefill one on the first devices,
the decode one on the devices after them (either mesh may have ``data`` > 1). Requests enter the prefill stage:
its scheduler (prefix caching on) and executor run only prompt chunks and sample each sequence's first token,
which is emitted at once. The sequence is then detached from the prefill stage (``Scheduler.detach``: its pages
stay held) and adopted by the decode stage (``Scheduler.adopt``: pages allocated in the decode pool), and its
KV pages are copied device to device: a gather on the prefill mesh, ``jax.device_put`` onto the decode mesh,
a scatter into the decode pool. All three are dispatched asynchronously, so the copy overlaps the next prefill
step; JAX orders the decode step that reads those pages after the scatter. The prefill-side pages are freed
once the copied pages are ready on the decode side. The decode stage carries on with continuous batching.

If the decode side has no room, prefilled sequences wait in a queue holding their prefill pages (never
dropped); once ``max_pending_transfers`` wait, the prefill stage pauses. Everything host-side — requests,
detokenizers, structured output, outputs — is the ``Engine``'s own: ``DisaggregatedEngine`` is an ``Engine``
whose ``scheduler`` routes each sequence to the stage holding it.

Sampling is the colocated engine's: seeds depend on the request, not on the engine, and the sampler's key on
the tokens generated so far, so greedy tokens and seeded samples are the same as colocated serving's.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.engine import Engine, _logprobs
from jaxserve.executor.executor import Executor
from jaxserve.executor.kv_cache import uses_local_pool
from jaxserve.outputs import RequestOutput
from jaxserve.scheduler.block_manager import RELEASED, PageHolder
from jaxserve.scheduler.replicas import ReplicatedScheduler
from jaxserve.scheduler.sequence import Sequence
from jaxserve.scheduler.step_result import StepFailed
from pallas_kernels.quantized_pages import QuantizedPages
from sharding.config import MeshConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Handoff:
    seq: Sequence
    replica: int  # on the prefill side
    holder: PageHolder
    since: float  # when the prefill finished
    staged: list | None = None  # the copy's arrays on the decode mesh, once dispatched
    started: float = 0.0


class _Stages:
    """The ``Scheduler`` interface the ``Engine`` uses, over the prefill and decode schedulers and the
    sequences between them: each call goes to the stage holding the sequence."""

    def __init__(self, engine: DisaggregatedEngine, prefill: ReplicatedScheduler, decode: ReplicatedScheduler):
        self.engine, self.prefill, self.decode = engine, prefill, decode

    def add(self, seq: Sequence) -> list[Sequence]:
        return self.prefill.add(seq)

    def get_request(self, request_id: str) -> list[Sequence]:
        # A hand-off whose copy is dispatched is already the decode scheduler's; the rest wait between the two.
        moving = [h.seq for h in self.engine.handoffs if h.seq.request_id == request_id and h.staged is None]
        return self.prefill.get_request(request_id) + moving + self.decode.get_request(request_id)

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        if seq.is_finished:
            return
        waiting = next((h for h in self.engine.handoffs if h.seq is seq and h.staged is None), None)
        if waiting is not None:  # prefilled, waiting for room on the decode side: its prefill pages go now
            self.engine.handoffs.remove(waiting)
            self.engine.free_prefill_pages(waiting)
            seq.set_finished(reason, stop_reason)
        elif seq in self.decode.get_request(seq.request_id):
            self.decode.finish(seq, reason, stop_reason)
        else:
            self.prefill.finish(seq, reason, stop_reason)

    def has_unfinished(self) -> bool:
        return self.prefill.has_unfinished() or bool(self.engine.handoffs) or self.decode.has_unfinished()

    @property
    def num_waiting(self) -> int:
        return (self.prefill.num_waiting + sum(h.staged is None for h in self.engine.handoffs)
                + self.decode.num_waiting)

    @property
    def num_running(self) -> int:
        return self.prefill.num_running + self.decode.num_running

    @property
    def running(self) -> list[Sequence]:  # what a failed step's caller aborts (AsyncEngine)
        return [s for r in (*getattr(self.prefill, "replicas", ()), *self.decode.replicas) for s in r.running]

    def stats(self) -> dict[str, int]:
        out = dict(self.decode.stats())
        out["num_running"] = self.num_running
        out["num_waiting"] = self.num_waiting
        for k, v in self.prefill.stats().items():
            out[f"prefill_{k}"] = v
        # The prefix cache lives on the prefill side: its counters are the engine's.
        for k in ("prefix_cache_queries", "prefix_cache_hits", "cache_evictions"):
            out[k] = out[f"prefill_{k}"]
        return out


class StagedEngine(Engine):
    """An ``Engine`` run as stages, each a (scheduler, executor) pair stepped by ``_stage_step``: the
    colocated engine's step, after which a prefill stage hands its finished prompts on (``_hand_off``)."""

    steps_async = False  # a stage hands a sequence on only once its tokens are on the host

    def _stage_step(self, scheduler: ReplicatedScheduler, executor: Executor, *, prefill: bool):
        plan = scheduler.schedule()
        executor.release(plan.preempted, finished=False)
        if plan.is_empty:
            return self._collect(scheduler.update(plan, []).finished, [])
        self._mark_scheduled(plan)
        try:
            result = executor.execute(plan)
        except StepFailed as e:
            affected = list(dict.fromkeys(en.seq.request_id for en in plan.scheduled))
            logger.error("a %s step failed; its requests %s finish with reason 'error'",
                         "prefill" if prefill else "decode", ", ".join(affected), exc_info=e)
            outs = [o for rid in affected if (o := self.abort_request(
                rid, "error", error=f"the step running this request failed: {e}")) is not None]
            if e.cache_lost:
                executor.release(scheduler.drop_cache(), finished=False)
            return outs
        if result.prompt_logprobs:
            self._record_prompt_logprobs(plan, result.prompt_logprobs)
        runs = result.spec_tokens or {}  # speculation (n-gram, on the decode side): entries emitting several
        before = {s.seq_id: s.num_output_tokens for s in plan.seqs}
        update = scheduler.update(plan, [runs[i] if i in runs else int(t) for i, t in enumerate(result.token_ids)])
        self.structured.accept(update.updated)
        self.stats_counters["steps"] += 1
        self.stats_counters["prefill_steps" if prefill else "decode_steps"] += 1
        logprobs = _logprobs(plan, result)
        for i, lps in (result.spec_logprobs or {}).items():
            logprobs[plan.scheduled[i].seq.seq_id] = lps
        outputs = self._collect(update.finished, update.updated, logprobs, before=before)
        # A finished sequence's penalty row goes back now, not when its request ends: a sibling may still be on the
        # other side, and this stage's rows are only enough for its own running sequences.
        executor.release([s for s in (*update.updated, *update.finished) if s.is_finished], finished=False)
        if prefill:  # prompts done (first token sampled, not finished by it): on to the decode side
            self._hand_off(scheduler, [seq for seq in update.updated if not seq.is_finished])
        return outputs

    def _hand_off(self, scheduler: ReplicatedScheduler, seqs: list[Sequence]) -> None:
        raise NotImplementedError



class DisaggregatedEngine(StagedEngine):
    """An ``Engine`` whose prompts run on a prefill mesh and whose decodes run on a decode mesh (module doc)."""

    def __init__(self, config: EngineConfig, *, executor_factory=None):
        if config.prefill_mesh is None or config.decode_mesh is None:
            raise ValueError("a disaggregated engine needs prefill_mesh and decode_mesh")
        devices = jax.devices()
        n_prefill = MeshConfig.parse(config.prefill_mesh).num_devices
        n_decode = MeshConfig.parse(config.decode_mesh).num_devices
        if n_prefill + n_decode > len(devices):
            raise ValueError(f"prefill_mesh={config.prefill_mesh} ({n_prefill} devices) and decode_mesh="
                             f"{config.decode_mesh} ({n_decode}) need {n_prefill + n_decode} devices; "
                             f"{len(devices)} are available")
        if jax.process_count() > 1:
            raise ValueError("prefill_mesh/decode_mesh split one process's devices; for several processes use "
                             "jaxserve serve --role prefill|decode|router")
        base = dataclasses.replace(config, prefill_mesh=None, decode_mesh=None)
        # The decode side needs no prefix cache: every sequence arrives with its KV computed.
        decode_config = dataclasses.replace(base, mesh=config.decode_mesh, enable_prefix_caching=False)
        # Speculation (n-gram) verifies decodes: the decode side's; the prefill side runs prompts only.
        prefill_config = dataclasses.replace(base, mesh=config.prefill_mesh, speculative_config=None)
        factory = executor_factory or Executor
        super().__init__(decode_config, executor_factory=functools.partial(
            factory, devices=devices[n_prefill:n_prefill + n_decode]))
        self.config = config
        self.prefill_executor = factory(prefill_config, model_path=self.executor.model_path,
                                        eos_token_ids=self.eos_token_ids, devices=devices[:n_prefill],
                                        model_config=self.model_config)
        self.prefill_executor.token_masks = self.structured.fill_bitmask
        self.prefill_scheduler = ReplicatedScheduler(self.prefill_executor.scheduler_config,
                                                     self.prefill_executor.num_replicas)
        self.decode_scheduler = self.scheduler
        self.scheduler = _Stages(self, self.prefill_scheduler, self.decode_scheduler)
        self.handoffs: deque[_Handoff] = deque()  # prefilled, in order: waiting for room, or being copied
        self.mover = KVMover(self.prefill_executor.runner, self.executor.runner)
        self.stats_counters.update(kv_transfers=0, kv_transfer_bytes=0, kv_transfer_seconds=0.0,
                                   kv_transfer_queue_seconds=0.0, prefill_steps=0, decode_steps=0)

    # Steps --------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Land finished copies, run a prefill step (unless the decode side is backed up), hand its finished
        prompts over, then run a decode step."""
        self._land()
        outputs: list[RequestOutput] = []
        waiting = sum(1 for h in self.handoffs if h.staged is None)
        if waiting < self.config.max_pending_transfers:
            outputs += self._stage_step(self.prefill_scheduler, self.prefill_executor, prefill=True)
        self._start_copies()
        outputs += self._stage_step(self.decode_scheduler, self.executor, prefill=False)
        return outputs

    def _hand_off(self, scheduler: ReplicatedScheduler, seqs: list[Sequence]) -> None:
        now = time.monotonic()
        for seq in seqs:
            replica, holder = scheduler.detach(seq)
            self.prefill_executor.release([seq], finished=False)
            self.handoffs.append(_Handoff(seq, replica, holder, now))

    def _start_copies(self) -> None:
        """Adopt waiting sequences on the decode side, in order, while it has room, and dispatch their copies."""
        for h in self.handoffs:
            if h.staged is not None:
                continue
            replica = self.decode_scheduler.adopt(h.seq)
            if replica is None:
                break  # full: they wait, in order, holding their prefill pages
            self.stats_counters["kv_transfer_queue_seconds"] += time.monotonic() - h.since
            h.staged, nbytes = self.mover.copy(h.replica, h.holder, replica, h.seq)
            h.started = time.monotonic()  # dispatched (a new page count's first copy compiles before this)
            self.stats_counters["kv_transfers"] += 1
            self.stats_counters["kv_transfer_bytes"] += nbytes

    def _land(self) -> None:
        """Free the prefill pages of every copy whose pages are on the decode side."""
        now = time.monotonic()
        for h in [h for h in self.handoffs if h.staged is not None]:
            if all(a.is_ready() for a in h.staged):
                self.handoffs.remove(h)
                self.free_prefill_pages(h)
                self.stats_counters["kv_transfer_seconds"] += now - h.started

    def free_prefill_pages(self, h: _Handoff) -> None:
        self.prefill_scheduler.replicas[h.replica].block_manager.free(h.holder)

    def drain_transfers(self) -> None:
        """Wait for every dispatched copy and free its prefill pages (tests, shutdown)."""
        for h in self.handoffs:
            if h.staged is not None:
                jax.block_until_ready(h.staged)
        self._land()

    def _finish_request(self, req, seqs, deltas=None):
        self.prefill_executor.release(seqs)
        return super()._finish_request(req, seqs, deltas)

    def stats(self) -> dict[str, float]:
        s = super().stats()
        s["num_pages"] = self.executor.cache_config.num_pages
        s["prefill_num_pages"] = self.prefill_executor.cache_config.num_pages
        s["kv_transfers_pending"] = len(self.handoffs)
        return s

    def describe(self) -> dict:
        info = super().describe()
        info["prefill_mesh"], info["decode_mesh"] = self.config.prefill_mesh, self.config.decode_mesh
        info["prefill_num_pages"] = int(self.prefill_executor.cache_config.num_pages)
        return info


def _parts(pages) -> tuple:
    """The arrays one layer's K (or V) pool keeps: its values, and an 8-bit pool's scales after them."""
    return (pages.values, pages.scales) if isinstance(pages, QuantizedPages) else (pages,)


class PageReader:
    """Takes a sequence's KV pages out of a runner's pool into compact arrays on that runner's mesh.

    One jitted gather over every layer (the windowed layers read the model's windowed pool where it has one)
    into a tuple of ``[layers, 2 (K, V), cache heads, pages, page_size, head_dim]`` arrays: the values, and for
    an 8-bit pool its scales (``head_dim`` 1) after them, so the scales move with the values they belong to.
    Heads split over ``tensor`` as in the cache, pages whole. Page counts are padded to powers of two so few
    shapes compile (padded rows read page 0).
    """

    def __init__(self, runner):
        self.runner = runner
        cfg = runner.cfg
        self.local = [uses_local_pool(cfg, runner.cache_cfg, layer) for layer in range(cfg.num_layers)]
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
                part.append(jnp.stack([kp[:, ids], vp[:, ids]]))
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
            kv = self.runner.cfg.num_kv_heads
            # This cache's head c holds model head c * kv // heads; take it from a source head holding it.
            head_map = np.array([(c * kv // self.heads) * src_heads // kv for c in range(self.heads)], np.int32)

            def put(pages, rows, ids):
                if isinstance(pages, QuantizedPages):  # rows: (values, scales), stored as they were
                    return QuantizedPages(pages.values.at[:, ids].set(rows[0], mode="drop"),
                                          pages.scales.at[:, ids].set(rows[1], mode="drop"), pages.dtype)
                return pages.at[:, ids].set(rows[0].astype(pages.dtype), mode="drop")

            def scatter(cache, staged, full_ids, local_ids):
                if src_heads != self.heads:
                    staged = tuple(a[:, :, head_map] for a in staged)
                out = []
                for layer, ((k, v), local) in enumerate(zip(cache, self.local)):
                    ids = local_ids if local else full_ids
                    out.append((put(k, [a[layer, 0] for a in staged], ids),
                                put(v, [a[layer, 1] for a in staged], ids)))
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


class KVMover:
    """Copies a sequence's KV pages from one runner's pool into another's, device to device (``PageReader`` on
    the source mesh, ``jax.device_put``, ``PageWriter`` on the destination mesh)."""

    def __init__(self, src, dst):
        self.reader, self.writer = PageReader(src), PageWriter(dst)

    def copy(self, src_replica: int, holder: PageHolder, dst_replica: int, seq: Sequence) -> tuple[list, int]:
        """Dispatch the copy of ``holder``'s pages into ``seq``'s (destination) tables; returns the staged arrays
        on the destination mesh (ready once the pages have left the source) and the bytes of KV moved."""
        staged, full, local, nbytes = self.reader.read(src_replica, holder, seq.num_computed_tokens)
        moved = self.writer.write(staged, full, local, dst_replica, seq)
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
