"""The simulator: the engine's own scheduler on a simulated clock, a step-time model in place of the device.

Deployments are colocated engines (prompt chunks beside decodes) or disaggregated ``P:D`` prefill and decode
engines with the KV of each finished prompt moved between them; ``summarize`` turns the token times into TTFT,
TPOT, ITL and goodput, and ``max_rate`` finds the largest rate that meets the SLOs.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Sequence as Seq

import numpy as np

from jaxserve.config.scheduler import SchedulerConfig
from jaxserve.executor.kv_cache import local_pool_pages
from jaxserve.executor.kv_cache import pool_pages as kv_pool_pages
from jaxserve.executor.batch import StepShapes
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.scheduler import Scheduler
from jaxserve.scheduler.sequence import Sequence
from jaxserve.tools.plan.step_model import Windows, kv_tokens, step_features
from jaxserve.tools.plan.workload import PlannedRequest


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """The limits of one simulated engine instance."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    num_pages: int = 4096
    page_size: int = 16
    enable_prefix_caching: bool = False
    # Every layer windowed (Mistral-style): pages behind the window are released (the real scheduler's rule) and
    # steps read at most this many keys.
    attention_window: int | None = None
    # Windowed and global layers interleaved (Gemma 2/3): the windowed layers' own pool of ``local_pages`` pages
    # recycled behind ``local_window``, as the engine sizes it (``window_fields``), and each layer's window for
    # the keys a step reads. ``num_pages`` is then the global layers' pool.
    local_window: int | None = None
    local_pages: int = 0
    layer_windows: tuple[int | None, ...] = ()

    def scheduler(self, **overrides) -> Scheduler:
        fields = dataclasses.asdict(self) | overrides
        del fields["layer_windows"]
        return Scheduler(SchedulerConfig(**fields))

    def shapes(self, max_num_batched_tokens: int | None = None) -> StepShapes:
        return StepShapes(self.max_num_seqs, max_num_batched_tokens or self.max_num_batched_tokens,
                          -(-self.max_model_len // self.page_size))

    @property
    def windows(self) -> Windows:
        """What ``step_features`` takes: the per-layer windows, else the one window of every layer."""
        return self.layer_windows or self.attention_window


def window_fields(windows: Seq[int | None], *, page_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                  num_pages: int | None = None) -> dict:
    """``EngineShape`` fields for a model with these per-layer windows, as the engine sets its scheduler up
    (``executor.builder``): one window for all layers, or the windowed layers' own pool beside the global one."""
    windows = tuple(windows)
    given = [w for w in windows if w is not None]
    if not given:
        return {}
    if len(given) == len(windows):
        return {"attention_window": max(given)}
    local = local_pool_pages(windows, page_size, max_num_seqs, max_num_batched_tokens, global_pages=num_pages or None)
    return {"local_window": max(given), "local_pages": local,
            "layer_windows": windows}


def pool_pages(kv_bytes: float, kv_bytes_per_token: float, page_size: int, fields: dict) -> int:
    """Global-pool pages that ``kv_bytes`` of memory hold (``kv_bytes_per_token``: every layer's), after the
    windowed layers' own pool when the model has one (``window_fields``): its pages hold only the windowed
    layers' KV, and the global pool's only the global layers'. The engine's rule (``kv_cache.pool_pages``)."""
    return kv_pool_pages(kv_bytes, kv_bytes_per_token, page_size, windows=fields.get("layer_windows", ()),
                         local_pages=fields.get("local_pages", 0) if fields.get("layer_windows") else 0)


class _Instance:
    """One simulated engine: the real scheduler, a step-time model for the device."""

    def __init__(self, scheduler: Scheduler, shapes: StepShapes, model):
        self.scheduler, self.shapes, self.model = scheduler, shapes, model
        self.page_size = scheduler.config.page_size
        self.window = scheduler.config.attention_window
        self.transferred: set[int] = set()  # seq ids whose prompt KV arrived from a prefill engine

    @property
    def load(self) -> int:
        return self.scheduler.num_running + self.scheduler.num_waiting


@dataclasses.dataclass
class _Track:
    request: PlannedRequest
    token_times: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Deployment:
    """``colocated`` (``prefill`` engines = 0) or disaggregated (``prefill`` : ``decode`` engines)."""

    name: str
    chunk: int  # prompt tokens per step on engines that run prompts
    prefill: int = 0
    decode: int = 1

    @property
    def instances(self) -> int:
        return self.prefill + self.decode


class _Simulation:
    """One run of ``simulate``: the engines, the event queue (arrivals, finished steps, landed KV) and each
    request's token times."""

    def __init__(self, requests: Seq[PlannedRequest], deployment: Deployment, model, engine: EngineShape, *,
                 kv_bytes_per_token: float, transfer_bytes_per_s: float, slo_ttft_s: float):
        self.requests, self.model, self.engine = requests, model, engine
        self.kv_bytes_per_token, self.transfer_bytes_per_s, self.slo_ttft_s = (
            kv_bytes_per_token, transfer_bytes_per_s, slo_ttft_s)
        prompt_tokens = max(deployment.chunk, engine.max_num_seqs)
        if deployment.prefill == 0:
            self.entry, self.decoders = self._make(deployment.decode, prompt_tokens), []
        else:
            # A transferred sequence's whole prompt is admitted in one step (its KV is already there).
            self.entry = self._make(deployment.prefill, prompt_tokens)
            self.decoders = self._make(deployment.decode, engine.max_model_len + engine.max_num_seqs)
        self.engines = self.entry + self.decoders
        self.tracks = {str(i): _Track(r) for i, r in enumerate(requests)}
        self.events: list = []  # (time, order, kind, payload)
        self.order = itertools.count()
        for i, r in enumerate(requests):
            heapq.heappush(self.events, (r.arrival_s, next(self.order), "arrive", i))
        self.idle = set(range(len(self.engines)))
        self.misses = 0  # first tokens later than slo_ttft_s
        self.on_time = 0  # first tokens within slo_ttft_s
        self.arrivals = np.array([r.arrival_s for r in requests])
        self.sorted_arrivals = bool(np.all(np.diff(self.arrivals) >= 0))

    def _make(self, n: int, max_num_batched_tokens: int) -> list[_Instance]:
        engine = self.engine
        overrides = {"max_num_batched_tokens": max_num_batched_tokens}
        if engine.local_window is not None:  # the windowed pool as the engine sizes it for this token budget
            overrides["local_pages"] = local_pool_pages(engine.layer_windows, engine.page_size, engine.max_num_seqs,
                                                        max_num_batched_tokens, global_pages=engine.num_pages)
        out = [_Instance(engine.scheduler(**overrides), engine.shapes(max_num_batched_tokens), self.model)
               for _ in range(n)]
        for inst in out:
            inst.window = engine.windows
        return out

    def start(self, now: float, k: int) -> None:
        """Engine ``k`` schedules its next step, if it has one, and finishes it after the model's seconds."""
        inst = self.engines[k]
        if not inst.scheduler.has_unfinished():
            self.idle.add(k)
            return
        plan = inst.scheduler.schedule()
        if plan.is_empty:
            self.idle.add(k)
            return
        seconds = inst.model.seconds(step_features(plan, inst.shapes, inst.page_size, inst.transferred,
                                                   inst.window))
        self.idle.discard(k)
        heapq.heappush(self.events, (now + seconds, next(self.order), "done", (k, plan)))

    def arrive(self, now: float, i: int) -> int:
        """Request ``i`` joins the least-loaded engine that runs prompts; returns that engine."""
        r, entry = self.requests[i], self.entry
        k = min(range(len(entry)), key=lambda j: (entry[j].load, j))
        max_tokens = 1 if self.decoders else r.output_len
        entry[k].scheduler.add(Sequence(str(i), [1] * r.prompt_len, SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=0.0), arrival_time=now))
        return self.engines.index(entry[k])

    def done(self, now: float, k: int, plan) -> None:
        """Engine ``k``'s step finished: its tokens are recorded; a prefill engine's finished prompts send their
        KV to the decode side."""
        inst = self.engines[k]
        update = inst.scheduler.update(plan, [0] * plan.num_entries)
        for seq in update.updated:
            track = self.tracks[seq.request_id]
            if not track.token_times:
                if now - track.request.arrival_s > self.slo_ttft_s:
                    self.misses += 1
                else:
                    self.on_time += 1
            track.token_times.append(now)
            inst.transferred.discard(seq.seq_id)
        if self.decoders and inst in self.entry:
            for seq in update.finished:
                r = self.tracks[seq.request_id].request
                if r.output_len > 1:
                    delay = (kv_tokens(r.prompt_len, self.engine.windows) * self.kv_bytes_per_token
                             / self.transfer_bytes_per_s)
                    heapq.heappush(self.events, (now + delay, next(self.order), "landed", seq.request_id))

    def landed(self, now: float, rid: str) -> int:
        """A prompt's KV landed on the decode side: it joins the least-loaded decode engine; returns that engine."""
        r, decoders = self.tracks[rid].request, self.decoders
        j = min(range(len(decoders)), key=lambda i: (decoders[i].load, i))
        seq = Sequence(rid, [1] * (r.prompt_len + 1), SamplingParams(
            max_tokens=r.output_len - 1, ignore_eos=True, temperature=0.0), arrival_time=now)
        decoders[j].scheduler.add(seq)
        decoders[j].transferred.add(seq.seq_id)
        return self.engines.index(decoders[j])

    def certain_misses(self, now: float) -> int:
        """A lower bound on the requests that miss the TTFT SLO, known at ``now``: the late first tokens, or, of
        the requests that arrived more than ``slo_ttft_s`` ago, those without a first token in time (at least
        their number less every on-time first token so far)."""
        if not self.sorted_arrivals:
            return self.misses
        overdue = int(np.searchsorted(self.arrivals, now - self.slo_ttft_s, side="left"))
        return max(self.misses, overdue - self.on_time)

    def run(self, max_ttft_misses: int | None, max_steps: int) -> list[_Track]:
        steps = 0
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                touched = {self.arrive(now, payload)}
            elif kind == "done":
                self.done(now, *payload)
                if max_ttft_misses is not None and self.certain_misses(now) > max_ttft_misses:
                    break
                touched = {payload[0]}
            else:  # a prompt's KV landed on the decode side
                touched = {self.landed(now, payload)}
            for k in touched:
                if k in self.idle or kind == "done" and k == payload[0]:
                    self.start(now, k)
            steps += 1
            if steps > max_steps:
                raise RuntimeError(f"simulation did not finish within {max_steps} events")
        return list(self.tracks.values())


def simulate(requests: Seq[PlannedRequest], deployment: Deployment, model, engine: EngineShape, *,
             kv_bytes_per_token: float = 0.0, transfer_bytes_per_s: float = math.inf,
             slo_ttft_s: float = math.inf, max_ttft_misses: int | None = None,
             max_steps: int = 50_000_000) -> list[_Track]:
    """Run ``requests`` through ``deployment`` on a simulated clock; returns each request's token times.

    With ``max_ttft_misses``, the run stops early once more requests than that are sure to miss
    ``slo_ttft_s``: their first tokens came late, or they arrived longer ago than that and are still waiting (an
    overloaded deployment's queue only grows). The requests left have no tokens.
    """
    sim = _Simulation(requests, deployment, model, engine, kv_bytes_per_token=kv_bytes_per_token,
                      transfer_bytes_per_s=transfer_bytes_per_s, slo_ttft_s=slo_ttft_s)
    return sim.run(max_ttft_misses, max_steps)


@dataclasses.dataclass(frozen=True)
class Result:
    deployment: str
    rate: float
    chips: int
    duration_s: float
    throughput_tok_s: float
    request_rate: float
    goodput: float  # requests per second meeting both SLOs
    attainment: float  # fraction of requests meeting both SLOs
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float


def summarize(tracks: Seq[_Track], deployment: str, rate: float, chips: int, slo_ttft_s: float,
              slo_tpot_s: float) -> Result:
    ttft, tpot, itl, ok = [], [], [], 0
    start = min(t.request.arrival_s for t in tracks)
    end = max((t.token_times[-1] for t in tracks if t.token_times), default=start)
    tokens = 0
    for t in tracks:
        times = t.token_times
        if not times:  # never served: the run stopped once the deployment was clearly overloaded
            continue
        tokens += len(times)
        first = times[0] - t.request.arrival_s
        ttft.append(first)
        per = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
        if len(times) > 1:
            tpot.append(per)
            itl.extend(np.diff(times).tolist())
        ok += first <= slo_ttft_s and per <= slo_tpot_s and len(times) == t.request.output_len
    duration = max(end - start, 1e-9)

    def q(xs, p):
        return float(np.percentile(xs, p) * 1e3) if xs else 0.0

    return Result(deployment, rate, chips, duration, tokens / duration, len(tracks) / duration, ok / duration,
                  ok / len(tracks), q(ttft, 50), q(ttft, 99), q(tpot, 50), q(tpot, 99), q(itl, 50), q(itl, 99))


def max_rate(run, lo: float, hi: float, attainment: float, tolerance: float = 0.02) -> float:
    """The largest rate in [lo, hi] whose attainment is at least ``attainment``, to ``tolerance`` relative
    (0 if even ``lo`` misses). ``run(rate)`` returns a Result. From ``hi`` down, halving, to the first rate that
    meets it (an overloaded run stops early, and a nearly idle one costs a step per token), then geometric
    bisection between it and the rate above."""
    if run(hi).attainment >= attainment:
        return hi
    top = hi
    while True:
        rate = max(top / 2, lo)
        if run(rate).attainment >= attainment:
            lo, hi = rate, top
            break
        if rate <= lo:
            return 0.0
        top = rate
    while hi / lo > 1 + tolerance:
        mid = math.sqrt(lo * hi)
        if run(mid).attainment >= attainment:
            lo = mid
        else:
            hi = mid
    return lo


def parse_split(text: str) -> tuple[int, int]:
    p, _, d = text.partition(":")
    try:
        pi, di = int(p), int(d)
    except ValueError:
        raise ValueError(f"--splits: {text!r} is not P:D") from None
    if pi < 1 or di < 1:
        raise ValueError(f"--splits: {text!r} needs P >= 1 and D >= 1")
    return pi, di
