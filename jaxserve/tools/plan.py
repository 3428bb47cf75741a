"""Capacity planning: simulate a serving deployment from a step-time model and find what meets the SLOs.

    # 1. a step-time model: measured on this machine by the engine itself ...
    python -m jaxserve.plan calibrate --model M [engine flags, as serve's] --out steps.json
    # ... or predicted from compiled costs (python -m jaxserve.aot ... --json > aot.json), or from a chip's peaks
    # 2. the simulation
    python -m jaxserve.plan simulate --steps steps.json | --aot aot.json | --model M --chip v6e --tensor 8
        [--num-requests 200 --prompt-len 16:256 --output-len 32:64 --seed 0 | --trace trace.jsonl]
        [--rates 1,2,4] [--slo-ttft-ms 500 --slo-tpot-ms 50 --attainment 0.9]
        [--chips 8 --chips-per-instance 1] [--chunks 256,512,2048] [--splits 1:3,2:2]
        [--chip-hour-usd 1.2] [--transfer-gb-s 50] [--out-dir DIR] [--json]

The simulator runs the engine's own scheduler (``jaxserve.scheduler.scheduler``: chunked prefill, decodes riding in
prompt steps, page allocation, preemption) on a simulated clock; only the device is replaced, by a step-time
model that gives each planned step a duration from the shapes the executor would run (token and slot buckets
from ``jaxserve.executor.shapes``), the keys attention reads and the query-key pairs of prompt chunks. Deployments:

- colocated: ``chips / chips_per_instance`` engines, each running prompt chunks of at most C tokens
  (``max_num_batched_tokens`` = C, for every C in ``--chunks``) beside its decodes; requests go to the engine
  with the fewest sequences;
- disaggregated ``P:D``: P prefill engines (prompts only; the first token is emitted there) and D decode
  engines; a finished prompt's KV moves to the least-loaded decode engine in ``kv bytes / --transfer-gb-s``
  seconds (the first token does not wait for it; the second does) and joins its continuous batch.

Per deployment and rate it reports TTFT, TPOT and ITL (p50/p99), throughput, goodput (requests per second
meeting both SLOs), and then the largest rate at which ``--attainment`` of the requests meet both SLOs, per
chip, with the cost per million output tokens at that rate and ``--chip-hour-usd``. A step-time model is a
model: ``calibrate`` measures this machine's steps, ``--aot`` and ``--chip`` are roofline predictions, and
neither knows the server's network or tokenization time.

Windowed attention is planned per layer: a step's keys read and prompt query-key pairs are averaged over the
layers (a windowed layer reads at most its window), and so is the KV a disaggregated prompt moves. A model that
interleaves windowed and global layers (Gemma 2/3) gets the engine's two pools: the windowed layers' own pool,
sized as the engine sizes it, and a global pool whose pages hold only the global layers' KV (with ``--chip``,
as many as the HBM left after the weights and the windowed pool holds).

The workload generator draws the same lengths and Poisson arrivals as ``scripts/benchmark_serving.py`` for the
same ``--seed``, so a simulation can be held against a measured run of the real server.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import heapq
import itertools
import json
import math
import sys
import time
from collections.abc import Sequence as Seq
from pathlib import Path

import numpy as np

from jaxserve.config.scheduler import SchedulerConfig
from jaxserve.executor.shapes import StepShapes
from jaxserve.models.config import ModelConfig
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.scheduler import Scheduler, SchedulerOutput
from jaxserve.scheduler.sequence import Sequence
from jaxserve.scheduler.window_pool import global_pool_budget, window_pages_needed

# Workload ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PlannedRequest:
    arrival_s: float
    prompt_len: int
    output_len: int


def parse_range(text: str, name: str) -> tuple[int, int]:
    """``"LO:HI"`` (inclusive) or ``"N"``; ValueError naming ``name`` otherwise."""
    lo, _, hi = text.partition(":")
    try:
        lo_i, hi_i = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected LO:HI or N") from None
    if lo_i < 1 or hi_i < lo_i:
        raise ValueError(f"{name}={text!r}: need 1 <= LO <= HI")
    return lo_i, hi_i


def poisson_workload(num: int, rate: float, prompt_len: tuple[int, int], output_len: tuple[int, int], *,
                     seed: int) -> list[PlannedRequest]:
    """Uniform lengths and Poisson arrivals at ``rate`` req/s, drawn exactly as ``benchmark_serving.py`` draws
    them for the same seed (every rate scales one pattern of unit-rate gaps)."""
    if num < 1:
        raise ValueError(f"num_requests={num} must be >= 1")
    if not rate > 0:
        raise ValueError(f"rate={rate} must be > 0 (or inf)")
    shape = np.random.default_rng([seed, 0])
    p_lens = shape.integers(prompt_len[0], prompt_len[1] + 1, num)
    o_lens = shape.integers(output_len[0], output_len[1] + 1, num)
    if math.isinf(rate):
        arrivals = np.zeros(num)
    else:
        gaps = np.random.default_rng([seed, 2]).exponential(1.0, num)
        arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])]) / rate
    return [PlannedRequest(float(a), int(p), int(o)) for a, p, o in zip(arrivals, p_lens, o_lens)]


def read_trace(path: str | Path) -> list[PlannedRequest]:
    """JSON lines with ``arrival_s``, ``prompt_len`` and ``output_len`` (ValueError naming line and field)."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        for key in ("arrival_s", "prompt_len", "output_len"):
            if key not in row:
                raise ValueError(f"{path}:{n}: missing field {key!r}")
        if row["prompt_len"] < 1 or row["output_len"] < 1 or row["arrival_s"] < 0:
            raise ValueError(f"{path}:{n}: prompt_len and output_len must be >= 1 and arrival_s >= 0")
        out.append(PlannedRequest(float(row["arrival_s"]), int(row["prompt_len"]), int(row["output_len"])))
    if not out:
        raise ValueError(f"{path}: no requests")
    return sorted(out, key=lambda r: r.arrival_s)


def scale_arrivals(requests: Seq[PlannedRequest], factor: float) -> list[PlannedRequest]:
    """The same requests arriving ``factor`` times as fast."""
    return [dataclasses.replace(r, arrival_s=r.arrival_s / factor) for r in requests]


# Step-time models ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepFeatures:
    """What a planned step costs depends on: its compiled shape and the attention work inside it."""

    decode: bool  # every row is a decode (the decode step's shape), else the prompt step's
    padded_tokens: int  # rows of the compiled shape: the token bucket (prompt step) or slot bucket (decode)
    new_tokens: int  # rows that are real
    keys_read: int  # sum over sequences of the keys attention reads (the KV length after the step)
    prompt_pairs: float  # query-key pairs of the prompt chunks (causal): the quadratic part of prefill
    padded_keys: int = 0  # key slots of the compiled shape: sequence slots x page-table width (bucketed) x page

    def vector(self) -> list[float]:
        return [1.0, float(self.padded_tokens), float(self.padded_keys), float(self.prompt_pairs)]


# The linear model's features. Key slots, not keys: a compiled step walks its page-table bucket on the CPU
# path, so its cost follows the bucket (the roofline models, for kernels that walk only real pages, use keys).
FEATURES = ("constant_s", "per_padded_token_s", "per_padded_key_s", "per_prompt_pair_s")


Windows = "int | None | Seq[int | None]"


def layer_groups(window) -> tuple[tuple[int | None, float], ...]:
    """(window, fraction of the layers) pairs: ``window`` is one window for every layer (None: global) or the
    per-layer windows of a model (``ModelConfig.sliding_windows``; Gemma 2/3 interleave windowed and global)."""
    if window is None or isinstance(window, int):
        return ((window, 1.0),)
    n = len(window)
    return tuple((w, sum(x == w for x in window) / n) for w in dict.fromkeys(window)) or ((None, 1.0),)


def kv_tokens(length: int, window: Windows = None) -> float:
    """Tokens of KV a ``length``-token sequence holds and a query at its end reads, averaged over the layers
    (a windowed layer holds and reads at most its window): times the all-layer KV bytes per token, its bytes."""
    return sum(f * (length if w is None else min(length, w)) for w, f in layer_groups(window))


def step_features(plan: SchedulerOutput, shapes: StepShapes, page_size: int,
                  transferred: frozenset[int] = frozenset(), window: Windows = None) -> StepFeatures:
    """The features of one planned step. ``transferred``: sequence ids whose prompt KV arrived from elsewhere
    (disaggregation): their first step reads the cache and decodes one token instead of computing the prompt.
    ``window``: the attention window of every layer, or the per-layer windows; keys read and query-key pairs
    are averaged over the layers (a windowed layer reads at most its window per query), so times the all-layer
    KV bytes per token they give the bytes read."""
    decode, new, keys, pairs = True, 0, 0.0, 0.0
    groups = layer_groups(window)
    for e in plan.scheduled:
        n = e.num_new_tokens
        if e.seq.seq_id in transferred and e.num_computed_before == 0:
            n = 1
        new += n
        keys += kv_tokens(e.kv_len, window)
        if n > 1:
            decode = False
            pairs += sum(f * _causal_pairs(e.kv_len - n, e.kv_len, w) for w, f in groups)
    padded = shapes.seq_bucket(len(plan.scheduled)) if decode else shapes.token_bucket(new)
    slots = padded if decode else shapes.prefill_seqs(padded)
    width = shapes.step_pages(decode, max((len(e.page_table) for e in plan.scheduled), default=1))
    return StepFeatures(decode, padded, new, keys, pairs, slots * width * page_size)


@dataclasses.dataclass(frozen=True)
class LinearStepModel:
    """Seconds = c . (1, padded tokens, keys read, prompt pairs), one coefficient set per step kind, fitted to
    steps the engine timed on this machine (``calibrate``)."""

    decode: tuple[float, float, float, float]
    prompt: tuple[float, float, float, float]
    source: str = "calibrated"

    def seconds(self, f: StepFeatures) -> float:
        c = self.decode if f.decode else self.prompt
        return max(0.0, float(np.dot(c, f.vector())))

    @classmethod
    def fit(cls, samples: Seq[tuple[StepFeatures, float]], source: str = "calibrated",
            trim: float = 3.0) -> "LinearStepModel":
        """Non-negative least squares per kind on relative error (short and long steps count alike), then once
        more without the steps whose relative residual is over ``trim`` times the median one (a step that met a
        busy moment of the machine says nothing about the model)."""
        from scipy.optimize import nnls

        coeffs = {}
        for kind in (True, False):
            rows = [(f.vector(), s) for f, s in samples if f.decode == kind]
            if len(rows) < 2:
                raise ValueError(f"calibration has {len(rows)} {'decode' if kind else 'prompt'} steps; need >= 2")
            a = np.array([r for r, _ in rows])
            y = np.array([s for _, s in rows])
            keep = np.ones(len(y), bool)
            for _ in range(2):
                w = 1.0 / np.maximum(y[keep], 1e-6)
                c, _ = nnls(a[keep] * w[:, None], y[keep] * w)
                residual = np.abs(a @ c - y) / np.maximum(y, 1e-6)
                keep = residual <= trim * max(float(np.median(residual)), 1e-3)
                if keep.sum() < 2:
                    break
            coeffs[kind] = tuple(float(x) for x in c)
        return cls(coeffs[True], coeffs[False], source)

    def to_json(self) -> dict:
        return {"kind": "linear", "source": self.source, "features": FEATURES, "decode": list(self.decode),
                "prompt": list(self.prompt)}


def _causal_pairs(start: int, end: int, window: int | None) -> float:
    """Query-key pairs of queries at positions ``start .. end - 1`` attending causally (query at ``p`` sees
    ``p + 1`` keys, at most ``window``)."""
    n = end - start
    if window is None or end <= window:
        return n * start + n * (n + 1) / 2
    if start >= window:
        return float(n * window)
    return (window - start) * start + (window - start) * (window - start + 1) / 2 + (end - window) * window


@dataclasses.dataclass(frozen=True)
class RooflineStepModel:
    """Seconds = max(FLOPs / peak, bytes / bandwidth) / efficiency + overhead, per engine instance (its chips).

    ``flops_per_token`` covers the matmuls of one row; attention adds ``attn_flops_per_pair`` per query-key
    pair and reads ``kv_bytes_per_token`` per key; every step reads the weights once.
    """

    weight_bytes: float
    flops_per_token: float
    kv_bytes_per_token: float
    attn_flops_per_pair: float
    peak_flops: float
    peak_bytes_per_s: float
    efficiency: float = 0.6
    overhead_s: float = 0.0
    source: str = "roofline"

    def seconds(self, f: StepFeatures) -> float:
        pairs = f.prompt_pairs + (f.keys_read if f.decode else 0.0)
        flops = f.padded_tokens * self.flops_per_token + pairs * self.attn_flops_per_pair
        read = self.weight_bytes + f.keys_read * self.kv_bytes_per_token
        return max(flops / self.peak_flops, read / self.peak_bytes_per_s) / self.efficiency + self.overhead_s

    def to_json(self) -> dict:
        return {"kind": "roofline", **dataclasses.asdict(self)}


# Published figures per chip: (bf16 FLOP/s, HBM bytes/s, HBM bytes). Sources: the vendors' spec sheets (dense
# bf16; H100 and H200 SXM).
GiB = 2**30
CHIPS = {
    "v5e": (197e12, 819e9, 16 * GiB),
    "v5p": (459e12, 2765e9, 95 * GiB),
    "v6e": (918e12, 1640e9, 32 * GiB),
    "h100": (989e12, 3350e9, 80 * 10**9),
    "h200": (989e12, 4800e9, 141 * 10**9),
}


def roofline_from_config(cfg: ModelConfig, *, chip: str, chips: int, itemsize: int = 2, efficiency: float = 0.6,
                         overhead_s: float = 0.0) -> RooflineStepModel:
    """A roofline step model of one engine instance on ``chips`` chips of ``chip`` (tensor parallel: work and
    bytes divided evenly), from the model's shape and the chip's published peaks."""
    from jaxserve.tools.roofline import attention_flops, kv_bytes_per_token, matmul_flops_per_token, weight_bytes

    if chip not in CHIPS:
        raise ValueError(f"chip={chip!r} is not known (known: {', '.join(CHIPS)})")
    flops, bw, _ = CHIPS[chip]
    return RooflineStepModel(
        weight_bytes=weight_bytes(cfg, itemsize), flops_per_token=matmul_flops_per_token(cfg),
        kv_bytes_per_token=kv_bytes_per_token(cfg, itemsize), attn_flops_per_pair=attention_flops(cfg, 1, 1),
        peak_flops=flops * chips, peak_bytes_per_s=bw * chips, efficiency=efficiency, overhead_s=overhead_s,
        source=f"roofline: {cfg.architecture} on {chips} x {chip} at {efficiency:.0%} of peak")


def roofline_from_aot(report: dict, *, efficiency: float = 0.6, overhead_s: float = 0.0) -> RooflineStepModel:
    """A roofline step model from ``python -m jaxserve.aot --json``: the weights per device and the matmul FLOPs
    per token as the compiler counted them for the compiled decode steps, attention's FLOPs per query-key pair
    as the report added them, all times the mesh's devices, at the chip's published peaks."""
    chip, mem = report["chip"], report["memory_per_device"]
    devices = math.prod(int(part.split("=")[1]) for part in report["mesh"].split(","))
    per_chip = report.get("devices_per_chip", 1)
    probes = sorted(report["decode"].values(), key=lambda p: p["batch"])
    if len(probes) < 2:
        raise ValueError("the aot report needs decode probes at two batch sizes")
    lo, hi = probes[0], probes[-1]
    flops_per_token = (hi["xla_flops"] - lo["xla_flops"]) / (hi["batch"] - lo["batch"]) * devices
    attn_per_pair = (hi["flops"] - hi["xla_flops"]) * devices / (hi["batch"] * (hi["context"] + 1))
    return RooflineStepModel(
        weight_bytes=mem["weights"] * devices, flops_per_token=flops_per_token,
        kv_bytes_per_token=mem["kv_bytes_per_page"] / report["page_size"] * devices,
        attn_flops_per_pair=attn_per_pair, peak_flops=chip["peak_flops"] * devices / per_chip,
        peak_bytes_per_s=chip["hbm_bytes_per_s"] * devices / per_chip, efficiency=efficiency,
        overhead_s=overhead_s,
        source=f"aot: {report['model']} on {report['topology']} ({report['mesh']}) at {efficiency:.0%} of peak")


def load_step_model(path: str | Path) -> LinearStepModel | RooflineStepModel:
    data = json.loads(Path(path).read_text())
    if data.get("kind") == "linear":
        return LinearStepModel(tuple(data["decode"]), tuple(data["prompt"]), data.get("source", str(path)))
    if data.get("kind") == "roofline":
        return RooflineStepModel(**{k: v for k, v in data.items() if k != "kind"})
    raise ValueError(f"{path}: not a step-time model (kind must be 'linear' or 'roofline')")


# Simulation ----------------------------------------------------------------------------------------------------


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
    (``Executor``): one window for all layers, or the windowed layers' own pool beside the global one."""
    windows = tuple(windows)
    given = [w for w in windows if w is not None]
    if not given:
        return {}
    if len(given) == len(windows):
        return {"attention_window": max(given)}
    local = window_pages_needed(max(given), page_size, max_num_seqs, max_num_batched_tokens)
    return {"local_window": max(given), "local_pages": min(local, num_pages) if num_pages else local,
            "layer_windows": windows}


def pool_pages(kv_bytes: float, kv_bytes_per_token: float, page_size: int, fields: dict) -> int:
    """Global-pool pages that ``kv_bytes`` of memory hold (``kv_bytes_per_token``: every layer's), after the
    windowed layers' own pool when the model has one (``window_fields``): its pages hold only the windowed
    layers' KV, and the global pool's only the global layers'."""
    windows = fields.get("layer_windows")
    if not windows:
        return int(kv_bytes // (kv_bytes_per_token * page_size))
    kv_bytes, page_bytes = global_pool_budget(kv_bytes, kv_bytes_per_token * page_size, windows, fields["local_pages"])
    return int(kv_bytes // page_bytes)

    def shapes(self, max_num_batched_tokens: int | None = None) -> StepShapes:
        return StepShapes(self.max_num_seqs, max_num_batched_tokens or self.max_num_batched_tokens,
                          -(-self.max_model_len // self.page_size))


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


def simulate(requests: Seq[PlannedRequest], deployment: Deployment, model, engine: EngineShape, *,
             kv_bytes_per_token: float = 0.0, transfer_bytes_per_s: float = math.inf,
             slo_ttft_s: float = math.inf, max_ttft_misses: int | None = None,
             max_steps: int = 50_000_000) -> list[_Track]:
    """Run ``requests`` through ``deployment`` on a simulated clock; returns each request's token times.

    With ``max_ttft_misses``, the run stops early once more first tokens than that came later than
    ``slo_ttft_s`` (an overloaded deployment's queue only grows): the requests left have no tokens.
    """
    prompt_tokens = max(deployment.chunk, engine.max_num_seqs)

    def make(n: int, max_num_batched_tokens: int) -> list[_Instance]:
        overrides = {"max_num_batched_tokens": max_num_batched_tokens}
        if engine.local_window is not None:  # the windowed pool as the engine sizes it for this token budget
                    overrides["local_pages"] = min(engine.num_pages, window_pages_needed(
                engine.local_window, engine.page_size, engine.max_num_seqs, max_num_batched_tokens))
        out = [_Instance(engine.scheduler(**overrides), engine.shapes(max_num_batched_tokens), model)
               for _ in range(n)]
        for inst in out:
            inst.window = engine.windows
        return out

    if deployment.prefill == 0:
        entry, decoders = make(deployment.decode, prompt_tokens), []
    else:
        # A transferred sequence's whole prompt is admitted in one step (its KV is already there).
        entry = make(deployment.prefill, prompt_tokens)
        decoders = make(deployment.decode, engine.max_model_len + engine.max_num_seqs)
    engines = entry + decoders
    tracks = {str(i): _Track(r) for i, r in enumerate(requests)}
    events: list = []  # (time, order, kind, payload)
    order = itertools.count()
    for i, r in enumerate(requests):
        heapq.heappush(events, (r.arrival_s, next(order), "arrive", i))
    idle = set(range(len(engines)))

    def start(now: float, k: int) -> None:
        inst = engines[k]
        if not inst.scheduler.has_unfinished():
            idle.add(k)
            return
        plan = inst.scheduler.schedule()
        if plan.is_empty:
            idle.add(k)
            return
        seconds = inst.model.seconds(step_features(plan, inst.shapes, inst.page_size, frozenset(inst.transferred),
                                                   inst.window))
        idle.discard(k)
        heapq.heappush(events, (now + seconds, next(order), "done", (k, plan)))

    steps = misses = 0
    while events:
        now, _, kind, payload = heapq.heappop(events)
        touched: set[int] = set()
        if kind == "arrive":
            r = requests[payload]
            rid = str(payload)
            k = min(range(len(entry)), key=lambda j: (entry[j].load, j))
            max_tokens = 1 if decoders else r.output_len
            entry[k].scheduler.add(Sequence(rid, [1] * r.prompt_len, SamplingParams(
                max_tokens=max_tokens, ignore_eos=True, temperature=0.0), arrival_time=now))
            touched.add(engines.index(entry[k]))
        elif kind == "done":
            k, plan = payload
            inst = engines[k]
            update = inst.scheduler.update(plan, [0] * len(plan.scheduled))
            for seq in update.updated:
                track = tracks[seq.request_id]
                if not track.token_times and now - track.request.arrival_s > slo_ttft_s:
                    misses += 1
                track.token_times.append(now)
                inst.transferred.discard(seq.seq_id)
            if max_ttft_misses is not None and misses > max_ttft_misses:
                break
            if decoders and inst in entry:
                for seq in update.finished:
                    r = tracks[seq.request_id].request
                    if r.output_len > 1:
                        delay = kv_tokens(r.prompt_len, engine.windows) * kv_bytes_per_token / transfer_bytes_per_s
                        heapq.heappush(events, (now + delay, next(order), "landed", seq.request_id))
            touched.add(k)
        else:  # a prompt's KV landed on the decode side
            rid = payload
            r = tracks[rid].request
            j = min(range(len(decoders)), key=lambda i: (decoders[i].load, i))
            seq = Sequence(rid, [1] * (r.prompt_len + 1), SamplingParams(
                max_tokens=r.output_len - 1, ignore_eos=True, temperature=0.0), arrival_time=now)
            decoders[j].scheduler.add(seq)
            decoders[j].transferred.add(seq.seq_id)
            touched.add(engines.index(decoders[j]))
        for k in touched:
            if k in idle or kind == "done" and k == payload[0]:
                start(now, k)
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"simulation did not finish within {max_steps} events")
    return list(tracks.values())


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
    (geometric bisection; 0 if even ``lo`` misses). ``run(rate)`` returns a Result."""
    if run(lo).attainment < attainment:
        return 0.0
    if run(hi).attainment >= attainment:
        return hi
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


# Calibration ---------------------------------------------------------------------------------------------------


class _RecordingScheduler:
    """Passes every call to the engine's scheduler and keeps the plans ``schedule`` returns."""

    def __init__(self, inner):
        self._inner = inner
        self.plans: list = []

    def schedule(self):
        plan = self._inner.schedule()
        self.plans.append(plan)
        return plan

    def __getattr__(self, name):
        return getattr(self._inner, name)


def calibrate(engine, *, contexts: Seq[int] = (), decode_steps: int = 8, seed: int = 0,
              log=print) -> tuple[LinearStepModel, list[tuple[StepFeatures, float]]]:
    """Time the engine's own steps over its buckets and fit a ``LinearStepModel``.

    For each decode slot bucket B and context C: B requests with C-token prompts (their prompt steps are
    timed too, chunked as the engine chunks them), then ``decode_steps`` decode steps. Each timed step is
    ``Engine.step()`` as the server runs it (schedule, device step, sampling, outputs), compiled beforehand.
    """
    ex = engine.executor
    shapes = ex.shapes
    if getattr(ex, "num_replicas", 1) != 1:
        raise ValueError("calibrate runs one engine replica: use a mesh without a data axis")
    limit = engine.max_model_len
    contexts = list(contexts) or sorted({min(limit // 8, 64), min(limit // 2, 512)})
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    recorder = _RecordingScheduler(engine.scheduler)
    engine.scheduler = recorder
    samples: list[tuple[StepFeatures, float]] = []
    try:
        for c in contexts:
            for b in shapes.decode_buckets():
                ids = []
                for _ in range(b):
                    prompt = rng.integers(3, vocab, c).tolist()
                    ids.append(engine.add_request(None, prompt, SamplingParams(max_tokens=decode_steps + 1,
                                                                               ignore_eos=True, temperature=0.0)))
                while engine.has_unfinished():
                    t0 = time.perf_counter()
                    engine.step()
                    seconds = time.perf_counter() - t0
                    plan = recorder.plans[-1]
                    if not plan.is_empty:
                        samples.append((step_features(plan, shapes, engine.config.page_size,
                                                      window=engine.model_config.sliding_windows), seconds))
                log(f"calibrate: context {c}, {b} sequences: {len(samples)} steps timed")
    finally:
        engine.scheduler = recorder._inner
    return LinearStepModel.fit(samples, source=f"calibrated on {engine.model_path}"), samples


# Command line --------------------------------------------------------------------------------------------------


def _calibrate_main(argv: list[str]) -> int:
    from jaxserve.config.args import add_engine_args, engine_config_from_args
    from jaxserve.engine.engine import Engine
    from jaxserve.executor.kv_cache import bytes_per_token

    p = argparse.ArgumentParser(prog="python -m jaxserve.plan calibrate",
                                description="Time the engine's steps on this machine and fit a step-time model.")
    p.add_argument("--out", required=True, help="where to write the step-time model (JSON)")
    p.add_argument("--contexts", default="", help="prompt lengths to calibrate at, e.g. 64,256 (default: two)")
    p.add_argument("--decode-steps", type=int, default=8)
    add_engine_args(p)
    args = p.parse_args(argv)
    engine = Engine(engine_config_from_args(args))
    contexts = [int(x) for x in args.contexts.split(",") if x]
    model, samples = calibrate(engine, contexts=contexts, decode_steps=args.decode_steps,
                               log=lambda m: print(m, file=sys.stderr))
    errors = [abs(model.seconds(f) - s) / s for f, s in samples]
    data = model.to_json() | {
        "engine": {"max_num_seqs": engine.config.max_num_seqs,
                   "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                   "max_model_len": engine.max_model_len, "page_size": engine.config.page_size,
                   "num_pages": engine.executor.cache_config.pages_per_replica,
                   "attention_window": engine.model_config.attention_window,
                   "sliding_windows": list(engine.model_config.sliding_windows)},
        "kv_bytes_per_token": bytes_per_token(engine.model_config, engine.executor.cache_dtype),
        "fit_relative_error_median": float(np.median(errors)),
        "samples": [[dataclasses.asdict(f), s] for f, s in samples],
    }
    Path(args.out).write_text(json.dumps(data, indent=1))
    print(f"{len(samples)} steps timed; fit's median relative error {np.median(errors):.1%}; "
          f"decode {model.decode}, prompt {model.prompt} -> {args.out}")
    return 0


def _simulate_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxserve.plan simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("step-time model (one of)")
    src.add_argument("--steps", help="a model from `plan calibrate` (or a saved roofline model)")
    src.add_argument("--aot", help="`python -m jaxserve.aot --json` output")
    src.add_argument("--model", help="with --chip: a Hugging Face folder or an aot preset name")
    src.add_argument("--chip", choices=sorted(CHIPS))
    src.add_argument("--tensor", type=int, default=1, help="with --chip: chips per engine instance")
    src.add_argument("--efficiency", type=float, default=0.6, help="roofline models: fraction of peak reached")
    src.add_argument("--step-overhead-ms", type=float, default=0.0, help="roofline models: host time per step")
    w = p.add_argument_group("workload")
    w.add_argument("--trace", help="JSON lines of arrival_s, prompt_len, output_len (instead of Poisson)")
    w.add_argument("--num-requests", type=int, default=200)
    w.add_argument("--prompt-len", default="16:256")
    w.add_argument("--output-len", default="32:64")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--rates", default="", help="request rates to report, e.g. 1,2,4 (default: none, only the "
                                               "largest rate that meets the SLOs)")
    s = p.add_argument_group("SLOs and deployments")
    s.add_argument("--slo-ttft-ms", type=float, default=500.0)
    s.add_argument("--slo-tpot-ms", type=float, default=50.0)
    s.add_argument("--attainment", type=float, default=0.9, help="fraction of requests that must meet both SLOs")
    s.add_argument("--chips", type=int, default=None, help="chips in the deployment (default: chips per instance)")
    s.add_argument("--chips-per-instance", type=int, default=None,
                   help="chips of one engine (default: --tensor, or 1)")
    s.add_argument("--chunks", default="512", help="colocated deployments' prompt tokens per step, e.g. 256,2048")
    s.add_argument("--splits", default="", help="disaggregated P:D engine splits, e.g. 1:3,2:2")
    s.add_argument("--max-num-seqs", type=int, default=None)
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--num-pages", type=int, default=None,
                   help="KV pages per engine (default: the calibrated engine's, the aot report's pool, or what "
                        "90%% of the chips' HBM holds after the weights)")
    s.add_argument("--page-size", type=int, default=16)
    s.add_argument("--kv-bytes-per-token", type=float, default=None, help="for KV transfers (default: the model's)")
    s.add_argument("--transfer-gb-s", type=float, default=50.0, help="prefill -> decode KV bandwidth, GB/s")
    s.add_argument("--chip-hour-usd", type=float, default=None)
    s.add_argument("--search", action=argparse.BooleanOptionalAction, default=True,
                   help="search each deployment's largest rate that meets the SLOs")
    s.add_argument("--search-duration-s", type=float, default=60.0,
                   help="the largest-rate search runs at least this many seconds of arrivals at each rate, so an "
                        "overloaded deployment's queue has time to show (default: 60)")
    s.add_argument("--max-rate", type=float, default=None, help="upper end of the largest-rate search (default: "
                                                                "from the step model)")
    o = p.add_argument_group("output")
    o.add_argument("--out-dir", default=None, help="write results.json, results.csv, results.md and plan.png")
    o.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    calibrated: dict = {}
    if sum(x is not None for x in (args.steps, args.aot, args.chip)) != 1:
        p.error("give exactly one of --steps, --aot, --chip (with --model)")
    if args.steps:
        model = load_step_model(args.steps)
        calibrated = json.loads(Path(args.steps).read_text())
    elif args.aot:
        model = roofline_from_aot(json.loads(Path(args.aot).read_text()), efficiency=args.efficiency,
                                  overhead_s=args.step_overhead_ms / 1e3)
        calibrated = json.loads(Path(args.aot).read_text())
    else:
        if not args.model:
            p.error("--chip needs --model")
        model = roofline_from_config(_model_config(args.model), chip=args.chip, chips=args.tensor,
                                     efficiency=args.efficiency, overhead_s=args.step_overhead_ms / 1e3)
    per_instance = args.chips_per_instance or (args.tensor if args.chip else 1)
    chips = args.chips or per_instance
    if chips % per_instance:
        p.error(f"--chips {chips} is not a multiple of --chips-per-instance {per_instance}")
    n_inst = chips // per_instance
    eng = calibrated.get("engine", {})
    max_num_seqs = args.max_num_seqs or eng.get("max_num_seqs", 256)
    # Each layer's window: the model's (--chip), the calibrated engine's, or the aot report's model's.
    if args.chip:
        windows = _model_config(args.model).sliding_windows
    elif "sliding_windows" in eng:
        windows = eng["sliding_windows"]
    elif eng.get("attention_window"):
        windows = [eng["attention_window"]]
    else:
        windows = _report_windows(calibrated)
    pages = args.num_pages or eng.get("num_pages") or calibrated.get("memory_per_device", {}).get("pool_pages")
    # The windowed layers' pool beside the global one (Gemma 2/3), sized as the engine sizes it.
    fields = window_fields(windows, page_size=args.page_size, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=eng.get("max_num_batched_tokens", 2048), num_pages=pages)
    if not pages and args.chip:  # what is left of 90% of the instance's HBM after the weights
        hbm = CHIPS[args.chip][2] * per_instance * 0.9 - model.weight_bytes
        pages = pool_pages(hbm, model.kv_bytes_per_token, args.page_size, fields)
        if pages < 1:
            p.error(f"the weights ({model.weight_bytes / GiB:.1f} GiB) do not fit {per_instance} x {args.chip}")
        if fields.get("local_pages"):
            fields["local_pages"] = min(fields["local_pages"], pages)
    engine = EngineShape(
        max_num_seqs=max_num_seqs,
        max_model_len=args.max_model_len or eng.get("max_model_len") or calibrated.get("max_model_len", 4096),
        num_pages=pages or 65536, page_size=args.page_size, **fields)
    kv_token = args.kv_bytes_per_token
    if kv_token is None:
        kv_token = calibrated.get("kv_bytes_per_token") or getattr(model, "kv_bytes_per_token", 0.0)
    deployments = [Deployment(f"colocated x{n_inst}, chunk {c}", int(c), 0, n_inst)
                   for c in args.chunks.split(",") if c]
    for text in filter(None, args.splits.split(",")):
        pi, di = parse_split(text)
        if pi + di != n_inst:
            p.error(f"--splits {text}: {pi}+{di} engines, but the deployment has {n_inst}")
        chunk = int(args.chunks.split(",")[-1])
        deployments.append(Deployment(f"disaggregated {pi}:{di}, chunk {chunk}", chunk, pi, di))
    prompt_len, output_len = parse_range(args.prompt_len, "--prompt-len"), parse_range(args.output_len, "--output-len")
    trace = read_trace(args.trace) if args.trace else None
    slo_ttft, slo_tpot = args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3

    def workload(rate: float, min_seconds: float) -> list[PlannedRequest]:
        if trace is not None:  # replayed, its arrivals scaled to the rate
            return scale_arrivals(trace, rate * max(trace[-1].arrival_s - trace[0].arrival_s, 1e-9) / len(trace))
        num = max(args.num_requests, math.ceil(rate * min_seconds))
        return poisson_workload(num, rate, prompt_len, output_len, seed=args.seed)

    def run(dep: Deployment, rate: float, min_seconds: float = 0.0, early_stop: bool = False) -> Result:
        reqs = workload(rate, min_seconds)
        misses = int(len(reqs) * (1 - args.attainment)) if early_stop else None
        tracks = simulate(reqs, dep, model, engine, kv_bytes_per_token=kv_token,
                          transfer_bytes_per_s=args.transfer_gb_s * 1e9, slo_ttft_s=slo_ttft,
                          max_ttft_misses=misses)
        return summarize(tracks, dep.name, rate, chips, slo_ttft, slo_tpot)

    rates = [float(r) for r in args.rates.split(",") if r]
    results = [run(d, r) for d in deployments for r in rates]
    best = []
    for d in deployments if args.search else ():
        hi = args.max_rate or _rate_ceiling(model, engine, workload(1.0, 0.0), n_inst)
        cache: dict[float, Result] = {}

        def at(rate, d=d, cache=cache):
            if rate not in cache:
                cache[rate] = run(d, rate, args.search_duration_s, early_stop=True)
            return cache[rate]

        r_max = max_rate(at, hi / 1000, hi, args.attainment)
        res = at(r_max) if r_max > 0 else None
        row = {"deployment": d.name, "chips": chips, "max_rate": r_max, "max_rate_per_chip": r_max / chips,
               "throughput_tok_s": res.throughput_tok_s if res else 0.0,
               "ttft_p99_ms": res.ttft_p99_ms if res else None, "tpot_p99_ms": res.tpot_p99_ms if res else None}
        if args.chip_hour_usd is not None and res and res.throughput_tok_s > 0:
            row["usd_per_million_output_tokens"] = args.chip_hour_usd * chips / (res.throughput_tok_s * 3600) * 1e6
        best.append(row)
        for rate in sorted(cache):
            if rate not in rates:
                results.append(cache[rate])
    report = {"step_model": model.to_json(), "engine": dataclasses.asdict(engine), "chips": chips,
              "chips_per_instance": per_instance, "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
              "attainment": args.attainment, "results": [dataclasses.asdict(r) for r in results
                                                           if r.rate in rates], "best": best,
              "search": [dataclasses.asdict(r) for r in results if r.rate not in rates]}
    text = format_report(report)
    if args.out_dir:
        _write(Path(args.out_dir), report, text)
    print(json.dumps(report, indent=1) if args.json else text)
    return 0


def _model_config(name: str) -> ModelConfig:
    try:
        from jaxserve.models.checkpoint import resolve_model_path

        return ModelConfig.from_pretrained(resolve_model_path(name))
    except (OSError, ValueError):
        from jaxserve.tools.aot import model_config  # the preset shapes

        return model_config(name)


def _report_windows(report: dict) -> list:
    """The per-layer windows of an aot report's model, where its name resolves to a config (else none)."""
    try:
        return list(_model_config(report["model"]).sliding_windows) if report.get("model") else []
    except Exception:  # noqa: BLE001 - a report of a model this machine cannot resolve: planned as global
        return []


def _rate_ceiling(model, engine: EngineShape, base: Seq[PlannedRequest], instances: int) -> float:
    """A rate no deployment can sustain: every instance decoding full batches back to back, no prompts."""
    out = float(np.mean([r.output_len for r in base]))
    shapes = engine.shapes()
    b = engine.max_num_seqs
    f = StepFeatures(True, shapes.seq_bucket(b), b, b, 0.0, shapes.seq_bucket(b) * engine.page_size)
    return 2.0 * instances * b / max(model.seconds(f), 1e-9) / out


def format_report(r: dict) -> str:
    lines = [f"step model: {r['step_model'].get('source')}",
             f"SLOs: TTFT <= {r['slo_ttft_ms']:g} ms, TPOT <= {r['slo_tpot_ms']:g} ms, for "
             f"{r['attainment']:.0%} of requests; {r['chips']} chips, {r['chips_per_instance']} per engine", ""]
    if r["results"]:
        lines.append("| deployment | rate | output tok/s | goodput | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
                     "ITL p50 / p99 ms |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- |")
        for x in r["results"]:
            lines.append(f"| {x['deployment']} | {x['rate']:g} | {x['throughput_tok_s']:.1f} | {x['goodput']:.2f} | "
                         f"{x['ttft_p50_ms']:.0f} / {x['ttft_p99_ms']:.0f} | {x['tpot_p50_ms']:.1f} / "
                         f"{x['tpot_p99_ms']:.1f} | {x['itl_p50_ms']:.1f} / {x['itl_p99_ms']:.1f} |")
        lines.append("")
    if not r["best"]:
        return "\n".join(lines)
    lines.append("| deployment | largest rate meeting the SLOs | per chip | output tok/s there | USD per 1M output tokens |")
    lines.append("| --- | --- | --- | --- | --- |")
    for b in r["best"]:
        usd = b.get("usd_per_million_output_tokens")
        lines.append(f"| {b['deployment']} | {b['max_rate']:.3g} req/s | {b['max_rate_per_chip']:.3g} | "
                     f"{b['throughput_tok_s']:.0f} | {'-' if usd is None else f'{usd:.3f}'} |")
    return "\n".join(lines)


def _write(out: Path, report: dict, text: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "results.md").write_text(text + "\n")
    rows = report["results"] + report["search"]
    if rows:
        with open(out / "results.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["deployment"] for r in rows):
        pts = sorted((r["rate"], r["goodput"]) for r in rows if r["deployment"] == name)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("goodput (req/s meeting both SLOs)")
    ax.set_title(f"TTFT <= {report['slo_ttft_ms']:g} ms, TPOT <= {report['slo_tpot_ms']:g} ms")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "plan.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("calibrate", "simulate"):
        print("usage: python -m jaxserve.plan {calibrate,simulate} ... (see --help of each)", file=sys.stderr)
        return 2
    return (_calibrate_main if argv[0] == "calibrate" else _simulate_main)(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
