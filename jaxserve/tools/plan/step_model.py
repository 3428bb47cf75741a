"""Step-time models: what a planned step costs, from the shapes the executor would run it at.

``step_features`` describes a scheduler's planned step (its compiled shape, the keys attention reads, the
query-key pairs of prompt chunks, averaged over the layers' windows); a ``LinearStepModel`` fitted to steps the
engine timed (``calibration``) or a ``RooflineStepModel`` from a chip's peaks or an aot report turns it into
seconds.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence as Seq
from collections.abc import Set as AbstractSet
from pathlib import Path

import numpy as np

from jaxserve.executor.batch import StepShapes
from jaxserve.models.config import ModelConfig
from jaxserve.scheduler.plan import ReplicatedPlan, SchedulerOutput
from jaxserve.tools.chips import CHIPS


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


def _kv_tokens_sum(lengths: np.ndarray, groups) -> float:
    """``kv_tokens`` summed over sequences of these KV ``lengths`` (i64[n]), for the layers' ``groups``."""
    return float(sum(f * (lengths.sum() if w is None else np.minimum(lengths, w).sum()) for w, f in groups))


def step_features(plan: "SchedulerOutput | ReplicatedPlan", shapes: StepShapes, page_size: int,
                  transferred: AbstractSet[int] = frozenset(), window: Windows = None) -> StepFeatures:
    """The features of one planned step. ``transferred``: sequence ids whose prompt KV arrived from elsewhere
    (disaggregation): their first step reads the cache and decodes one token instead of computing the prompt.
    ``window``: the attention window of every layer, or the per-layer windows; keys read and query-key pairs
    are averaged over the layers (a windowed layer reads at most its window per query), so times the all-layer
    KV bytes per token they give the bytes read."""
    decode, new, keys, pairs = True, 0, 0.0, 0.0
    groups = layer_groups(window)
    width = 0
    parts = getattr(plan, "plans", (plan,))  # a replicated engine's plan: one per replica
    for run in (p.run for p in parts if p.run is not None and len(p.run)):
        # plain decodes planned in bulk: read from their arrays, one token each
        new += len(run)
        keys += _kv_tokens_sum(run.kv_lens, groups)
        width = max(width, int(run.num_pages.max()))
    for e in (e for p in parts for e in p.entries):
        n = e.num_new_tokens
        if e.seq.seq_id in transferred and e.num_computed_before == 0:
            n = 1
        new += n
        keys += kv_tokens(e.kv_len, window)
        if n > 1:
            decode = False
            pairs += sum(f * _causal_pairs(e.kv_len - n, e.kv_len, w) for w, f in groups)
        width = max(width, len(e.page_table))
    padded = shapes.seq_bucket(plan.num_entries) if decode else shapes.token_bucket(new)
    slots = padded if decode else shapes.prefill_seqs(padded)
    width = shapes.step_pages(decode, width if plan.num_entries else 1)
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


def roofline_from_config(cfg: ModelConfig, *, chip: str, chips: int, itemsize: int = 2, efficiency: float = 0.6,
                         overhead_s: float = 0.0) -> RooflineStepModel:
    """A roofline step model of one engine instance on ``chips`` chips of ``chip`` (tensor parallel: work and
    bytes divided evenly), from the model's shape and the chip's published peaks."""
    from jaxserve.tools.roofline import attention_flops, kv_bytes_per_token, matmul_flops_per_token, weight_bytes

    if chip not in CHIPS:
        raise ValueError(f"chip={chip!r} is not known (known: {', '.join(CHIPS)})")
    flops, bw = CHIPS[chip].peak_flops, CHIPS[chip].hbm_bytes_per_s
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
