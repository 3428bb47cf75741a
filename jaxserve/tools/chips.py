"""Published per-chip figures: the one table ``aot`` (by jax's ``device_kind``) and ``plan`` (by name) read.

TPUs: the Google Cloud TPU system-architecture pages (docs.cloud.google.com/tpu/docs/v4, v5e, v5p, v6e): bf16 peak
and HBM bandwidth as published, HBM capacity taken as 32 / 16 / 95 / 32 GiB. GPUs: the vendor's spec sheets
(H100 and H200 SXM, dense bf16; HBM in decimal GB as sold).
"""

from __future__ import annotations

import dataclasses

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes: int
    peak_flops: float  # bf16 FLOP/s, dense
    hbm_bytes_per_s: float


CHIPS: dict[str, Chip] = {c.name: c for c in (
    Chip("v4", 32 * GiB, 275e12, 1200e9),
    Chip("v5e", 16 * GiB, 197e12, 819e9),
    Chip("v5p", 95 * GiB, 459e12, 2765e9),
    Chip("v6e", 32 * GiB, 918e12, 1640e9),
    Chip("h100", 80 * 10**9, 989e12, 3350e9),
    Chip("h200", 141 * 10**9, 989e12, 4800e9),
)}

# jax's ``device_kind`` of each chip a described topology (``jax.experimental.topologies``) can hold.
DEVICE_KINDS: dict[str, Chip] = {
    "TPU v4": CHIPS["v4"],
    "TPU v5 lite": CHIPS["v5e"],
    "TPU v5": CHIPS["v5p"],
    "TPU v6 lite": CHIPS["v6e"],
    "NVIDIA H100 80GB HBM3": CHIPS["h100"],
    "NVIDIA H200": CHIPS["h200"],
}
