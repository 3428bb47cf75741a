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
import time
from collections import deque

import jax

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.executor.executor import Executor
from jaxserve.executor.kv_pages import KVMover
from jaxserve.executor.protocol import StepExecutor
from jaxserve.outputs import RequestOutput
from jaxserve.scheduler.block_manager import PageHolder
from jaxserve.scheduler.replicas import ReplicatedScheduler
from jaxserve.scheduler.sequence import Sequence
from sharding.config import MeshConfig


@dataclasses.dataclass
class _Handoff:
    seq: Sequence
    replica: int  # on the prefill side
    holder: PageHolder
    since: float  # when the prefill finished
    staged: list | None = None  # the copy's arrays on the decode mesh, once dispatched
    started: float = 0.0


class _Stages:
    """The ``RequestScheduler`` (``jaxserve.scheduler.protocol``) the ``Engine`` keeps its requests through, over
    the prefill and decode schedulers and the sequences between them: each call goes to the stage holding the
    sequence."""

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
    def max_num_running(self) -> int:
        return self.prefill.max_num_running + self.decode.max_num_running

    @property
    def running(self) -> list[Sequence]:
        return self.prefill.running + self.decode.running

    def stats(self) -> dict[str, int]:
        out = dict(self.decode.stats())
        out["num_running"] = self.num_running
        out["num_waiting"] = self.num_waiting
        out["max_num_running"] = self.max_num_running
        for k, v in self.prefill.stats().items():
            out[f"prefill_{k}"] = v
        # The prefix cache lives on the prefill side: its counters are the engine's.
        for k in ("prefix_cache_queries", "prefix_cache_hits", "cache_evictions"):
            out[k] = out[f"prefill_{k}"]
        return out


class StagedEngine(Engine):
    """An ``Engine`` run as stages, each a (scheduler, executor) pair stepped by ``_stage_step``: the engine's
    one synchronous step (``Engine._step_on``), after which a prefill stage hands its finished prompts on
    (``_hand_off``)."""

    steps_async = False  # a stage hands a sequence on only once its tokens are on the host

    def _stage_step(self, scheduler: ReplicatedScheduler, executor: StepExecutor, *, prefill: bool
                    ) -> list[RequestOutput]:
        outputs, update = self._step_on(scheduler, executor, "prefill" if prefill else "decode")
        if prefill and update is not None:  # prompts done (first token sampled, not finished by it): on to decode
            self._hand_off(scheduler, [seq for seq in update.updated if not seq.is_finished])
        return outputs

    def _hand_off(self, scheduler: ReplicatedScheduler, seqs: list[Sequence]) -> None:
        raise NotImplementedError


class DisaggregatedEngine(StagedEngine):
    """An ``Engine`` whose prompts run on a prefill mesh and whose decodes run on a decode mesh (module doc)."""

    def __init__(self, config: EngineConfig, *, executor_factory=None, final_outputs_only: bool = False):
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
            factory, devices=devices[n_prefill:n_prefill + n_decode]), final_outputs_only=final_outputs_only)
        self.config = config
        self.prefill_executor: StepExecutor = factory(
            prefill_config, model_path=self.executor.info.model_path, eos_token_ids=self.eos_token_ids,
            devices=devices[:n_prefill], model_config=self.model_config, token_masks=self.structured.fill_bitmask)
        self.prefill_scheduler = ReplicatedScheduler(self.prefill_executor.info.scheduler_config,
                                                     self.prefill_executor.info.num_replicas)
        self.decode_scheduler = self.scheduler
        self.scheduler = _Stages(self, self.prefill_scheduler, self.decode_scheduler)
        self.handoffs: deque[_Handoff] = deque()  # prefilled, in order: waiting for room, or being copied
        self.mover = KVMover(self.prefill_executor.kv_pages, self.executor.kv_pages)
        self.stats_counters.update(kv_transfers=0, kv_transfer_bytes=0, kv_transfer_seconds=0.0,
                                   kv_transfer_queue_seconds=0.0, prefill_steps=0, decode_steps=0)

    def close(self) -> None:
        self.prefill_executor.close()
        super().close()

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

    def executors(self) -> list:
        return [self.prefill_executor, self.executor]

    def _forget_prefixes(self) -> None:
        self.prefill_scheduler.forget_prefixes()
        self.decode_scheduler.forget_prefixes()

    def stats(self) -> dict[str, float]:
        s = super().stats()
        s["num_pages"] = self.executor.info.num_pages
        s["prefill_num_pages"] = self.prefill_executor.info.num_pages
        s["kv_transfers_pending"] = len(self.handoffs)
        return s

    def describe(self) -> dict:
        info = super().describe()
        info["prefill_mesh"], info["decode_mesh"] = self.config.prefill_mesh, self.config.decode_mesh
        info["prefill_num_pages"] = int(self.prefill_executor.info.num_pages)
        return info
