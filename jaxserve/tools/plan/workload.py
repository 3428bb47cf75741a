"""The planner's workloads: seeded Poisson arrivals drawn as ``scripts/benchmark_serving.py`` draws them, or a trace."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence as Seq
from pathlib import Path

import numpy as np


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
