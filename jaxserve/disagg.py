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

from jaxserve.block_manager import RELEASED, PageHolder
from jaxserve.engine import Engine, _logprobs
from jaxserve.engine_config import EngineConfig
from jaxserve.executor import Executor
from jaxserve.kv_cache import uses_local_pool
from jaxserve.outputs import RequestOutput
from jaxserve.replicas import ReplicatedScheduler
from jaxserve.sequence import Sequence
from jaxserve.step_result import StepFailed
from sharding.mesh import MeshConfig

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
        moving = [h.seq for h in self.engine.handoffs if h.seq.request_id == request_id]
        return self.prefill.get_request(request_id) + moving + self.decode.get_request(request_id)

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        if seq.is_finished:
            return
        waiting = next((h for h in self.engine.handoffs if h.seq is seq), None)
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
        return self.prefill.num_waiting + len(self.engine.handoffs) + self.decode.num_waiting

    @property
    def num_running(self) -> int:
        return self.prefill.num_running + self.decode.num_running

    @property
    def running(self) -> list[Sequence]:  # what a failed step's caller aborts (AsyncEngine)
        return [s for r in (*self.prefill.replicas, *self.decode.replicas) for s in r.running]

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


class DisaggregatedEngine(Engine):
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
        prefill_config = dataclasses.replace(base, mesh=config.prefill_mesh)
        factory = executor_factory or Executor
        super().__init__(decode_config, executor_factory=functools.partial(
            factory, devices=devices[n_prefill:n_prefill + n_decode]))
        self.config = config
        self.prefill_executor = factory(prefill_config, model_path=self.executor.model_path,
                                        eos_token_ids=self.eos_token_ids, devices=devices[:n_prefill])
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

    def _stage_step(self, scheduler: ReplicatedScheduler, executor: Executor, *, prefill: bool):
        plan = scheduler.schedule()
        executor.release(plan.preempted, finished=False)
        if plan.is_empty:
            return self._collect(scheduler.update(plan, []).finished, [])
        now = time.monotonic()
        for e in plan.scheduled:
            req = self._requests.get(e.seq.request_id)
            if req is not None and req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
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
        update = scheduler.update(plan, [int(t) for t in result.token_ids])
        self.structured.accept(update.updated)
        self.stats_counters["steps"] += 1
        self.stats_counters["prefill_steps" if prefill else "decode_steps"] += 1
        outputs = self._collect(update.finished, update.updated, _logprobs(plan.scheduled, result))
        if prefill:  # prompts done (first token sampled, not finished by it): on to the decode side
            now = time.monotonic()
            for seq in update.updated:
                if not seq.is_finished:
                    replica, holder = scheduler.detach(seq)
                    self.prefill_executor.release([seq], finished=False)
                    self.handoffs.append(_Handoff(seq, replica, holder, now))
        return outputs

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


class KVMover:
    """Copies a sequence's KV pages from one runner's pool into another's, device to device.

    A jitted gather takes the pages (with the windowed layers' own pool where the model has one) out of the
    source cache into a compact array, ``jax.device_put`` moves it onto the destination mesh, and a jitted
    scatter (cache donated) writes it into the destination pages. Page counts are padded to powers of two so
    few shapes compile; padded rows read page 0 and are dropped on write. Cache heads are remapped when the two
    meshes' ``tensor`` sizes store the model's KV heads differently.
    """

    def __init__(self, src, dst):
        self.src, self.dst = src, dst
        cfg = src.cfg
        self.local = [uses_local_pool(cfg, src.cache_cfg, layer) for layer in range(cfg.num_layers)]
        src_heads, dst_heads = src.kv_cache[0][0].shape[0], dst.kv_cache[0][0].shape[0]
        kv = cfg.num_kv_heads
        # Destination cache head c holds model head c * kv // dst_heads; take it from a source head holding it.
        self.head_map = np.array([(c * kv // dst_heads) * src_heads // kv for c in range(dst_heads)], np.int32)
        self.same_heads = src_heads == dst_heads
        dst_spec = dst.kv_cache[0][0].sharding.spec
        src_spec = src.kv_cache[0][0].sharding.spec
        src_tensor, dst_tensor = int(src.mesh.shape["tensor"]), int(dst.mesh.shape["tensor"])
        # Staged arrays: heads split over tensor as in the caches, pages not split (whole pages of a sequence).
        self.src_staged = NamedSharding(src.mesh, PartitionSpec(_first(src_spec), None, None, None))
        self.dst_staged = (NamedSharding(dst.mesh, PartitionSpec(_first(dst_spec), None, None, None))
                           if self.same_heads and src_tensor == dst_tensor else NamedSharding(dst.mesh, PartitionSpec()))
        self._gather = jax.jit(self._gather_fn, out_shardings=self.src_staged)
        self._scatter = jax.jit(self._scatter_fn, donate_argnums=(0,),
                                out_shardings=jax.tree.map(lambda a: a.sharding, dst.kv_cache))

    def _gather_fn(self, cache, full_ids, local_ids):
        out = []
        for (k, v), local in zip(cache, self.local):
            ids = local_ids if local else full_ids
            out.append(jnp.stack([k[:, ids], v[:, ids]]))
        return jnp.stack(out)  # [layers, 2, heads, pages, page_size, head_dim]

    def _scatter_fn(self, cache, staged, full_ids, local_ids):
        if not self.same_heads:
            staged = staged[:, :, self.head_map]
        out = []
        for layer, ((k, v), local) in enumerate(zip(cache, self.local)):
            ids = local_ids if local else full_ids
            out.append((k.at[:, ids].set(staged[layer, 0].astype(k.dtype), mode="drop"),
                        v.at[:, ids].set(staged[layer, 1].astype(v.dtype), mode="drop")))
        return out

    def copy(self, src_replica: int, holder: PageHolder, dst_replica: int, seq: Sequence) -> tuple[list, int]:
        """Dispatch the copy of ``holder``'s pages into ``seq``'s (decode-side) tables; returns the staged
        arrays on the destination mesh (ready once the pages have left the source) and the bytes moved."""
        held = -(-seq.num_computed_tokens // self.src.cache_cfg.page_size)  # pages holding computed KV
        src_full, dst_full = _pairs(holder.page_table, seq.page_table[:held])
        src_local, dst_local = _pairs(holder.local_page_table, seq.local_page_table[:held])
        n = max(len(src_full), len(src_local), 1)
        width = 1 << (n - 1).bit_length()
        sc, dc = self.src.cache_cfg, self.dst.cache_cfg
        src_local_per = sc.num_local_pages // sc.num_replicas if sc.num_local_pages else 0
        dst_local_per = dc.num_local_pages // dc.num_replicas if dc.num_local_pages else 0
        args_src = (_ids(src_full, width, src_replica * sc.pages_per_replica, 0),
                    _ids(src_local, width, src_replica * src_local_per, 0))
        args_dst = (_ids(dst_full, width, dst_replica * dc.pages_per_replica, dc.num_pages),
                    _ids(dst_local, width, dst_replica * dst_local_per, max(dc.num_local_pages, 1)))
        staged = self._gather(self.src.kv_cache, *args_src)
        moved = jax.device_put(staged, self.dst_staged)
        self.dst.kv_cache = self._scatter(self.dst.kv_cache, moved, *args_dst)
        per_page = staged.nbytes // (staged.shape[3] or 1)
        nbytes = per_page * (len(src_full) * sum(not x for x in self.local) + len(src_local) * sum(self.local)) \
            // len(self.local)
        return [moved], int(nbytes)


def _first(spec: PartitionSpec):
    return spec[0] if len(spec) else None


def _pairs(src_table: list[int], dst_table: list[int]) -> tuple[list[int], list[int]]:
    """(source pages, destination pages) to copy: every page the destination holds (the destination releases
    at least as many pages behind a window as the source had, never fewer)."""
    src, dst = [], []
    for i, d in enumerate(dst_table):
        if d == RELEASED:
            continue
        s = src_table[i] if i < len(src_table) else RELEASED
        if s == RELEASED:
            raise AssertionError(f"page {i} is needed on the decode side but was released on the prefill side")
        src.append(s)
        dst.append(d)
    return src, dst


def _ids(pages: list[int], width: int, offset: int, pad: int) -> np.ndarray:
    out = np.full(width, pad, np.int32)
    out[: len(pages)] = np.asarray(pages, np.int32) + offset
    return out
