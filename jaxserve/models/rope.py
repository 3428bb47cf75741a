"""Rotary embedding parameters of every rope type transformers uses for the families we serve.

Host-only (no jax): ``RopeConfig`` is read from a ``config.json`` and hashed into the compiled steps, which
build the cos/sin tables from it (``layers.rope_tables``). The frequencies follow transformers'
``modeling_rope_utils`` (``tests/models/test_rope.py`` checks each type against it):

- ``default``, ``linear`` (frequencies / factor), ``llama3`` (per-band scaling), ``yarn`` (NTK-by-parts ramp,
  cos and sin times the attention factor): one set of frequencies for every position.
- ``dynamic`` (NTK) and ``longrope`` (short / long factors) depend on the sequence length. A row at position
  ``p`` is rotated with the frequencies transformers computes for a sequence of ``p + 1`` tokens: for dynamic,
  the base grows with ``p`` past ``max_position_embeddings``; for longrope, the long factors apply from
  position ``original_max_position_embeddings`` on. That is what transformers' own cached generation does for
  every decoded token, and it means a key is rotated once, when it is written, and never again.

Arrays here are NumPy, noted ``dtype[dims]`` as in ``pallas_kernels`` (``f32``, ``f64``, ``bool``); F is the
number of frequencies, ``rotary_dim // 2``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; ``kind`` is one of ``ROPE_TYPES``."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # llama3, yarn, longrope: the pre-training context
    original_max_position_embeddings: int = 8192
    # dynamic: the context up to which the frequencies are the default ones (config.max_position_embeddings)
    max_position_embeddings: int = 4096
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    # yarn, longrope: cos and sin are multiplied by it (computed from the factor when the config has none)
    attention_factor: float = 1.0
    # longrope: per-frequency divisors, short up to the original context, long beyond
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def __post_init__(self):
        if self.kind not in ROPE_TYPES:
            raise ValueError(f"rope type {self.kind!r} is not supported (supported: "
                             f"{', '.join(map(repr, ROPE_TYPES))})")
        if self.theta <= 0:
            raise ValueError(f"rope_theta={self.theta} must be > 0")
        if self.kind in ("linear", "dynamic", "yarn", "llama3") and self.factor <= 0:
            raise ValueError(f"rope factor={self.factor} must be > 0")
        if self.kind == "longrope" and (not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise ValueError("longrope needs short_factor and long_factor lists of the same length "
                             f"(got {len(self.short_factor)} and {len(self.long_factor)})")

    @classmethod
    def from_hf(cls, params: dict[str, Any] | None, *, theta: float | None, max_position_embeddings: int,
                head_dim: int, original_max_position_embeddings: int | None = None) -> "RopeConfig":
        """From one rope dict of a ``config.json`` (``rope_parameters``, or the older ``rope_scaling`` with
        ``rope_theta`` beside it). ``theta`` is the value outside the dict, if any."""
        params = dict(params or {})
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        theta = params.get("rope_theta", theta if theta is not None else 10000.0)
        if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']} is not supported (only 1.0)")
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope type {kind!r} is not supported (supported: {', '.join(map(repr, ROPE_TYPES))})")
        original = int(params.get("original_max_position_embeddings") or original_max_position_embeddings
                       or max_position_embeddings)
        base = dict(theta=float(theta), kind=kind, max_position_embeddings=int(max_position_embeddings),
                    original_max_position_embeddings=original)
        if kind in ("linear", "dynamic"):
            return cls(**base, factor=float(params["factor"]))
        if kind == "llama3":
            return cls(**base, factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                       high_freq_factor=float(params["high_freq_factor"]))
        if kind == "yarn":
            factor = params.get("factor")
            factor = float(factor) if factor is not None else max_position_embeddings / original
            attention = params.get("attention_factor")
            if attention is None:
                mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
                attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                             else _yarn_mscale(factor))
            return cls(**base, factor=factor, attention_factor=float(attention),
                       beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                       truncate=bool(params.get("truncate", True)))
        if kind == "longrope":
            short, long = tuple(map(float, params["short_factor"])), tuple(map(float, params["long_factor"]))
            if len(short) != head_dim // 2:
                raise ValueError(f"longrope short_factor has {len(short)} entries, head_dim {head_dim} needs "
                                 f"{head_dim // 2}")
            factor = params.get("factor")
            factor = float(factor) if factor is not None else max_position_embeddings / original
            attention = params.get("attention_factor")
            if attention is None:
                attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
            return cls(**base, factor=factor, attention_factor=float(attention), short_factor=short,
                       long_factor=long)
        return cls(**base)

    @property
    def per_position(self) -> bool:
        """Whether the frequencies depend on the row's position (dynamic, longrope)."""
        return self.kind in ("dynamic", "longrope")

    def context_length(self, max_position_embeddings: int) -> int:
        """The longest sequence the scaling is made for: the configured context stretched by the factor for
        linear and dynamic scaling, the original context times the factor for yarn; else as configured."""
        if self.kind in ("linear", "dynamic"):
            return int(max_position_embeddings * self.factor)
        if self.kind == "yarn":
            return max(max_position_embeddings, int(self.original_max_position_embeddings * self.factor))
        return max_position_embeddings

    def inv_freq(self, rotary_dim: int) -> np.ndarray:
        """f32[F]: the inverse frequencies (longrope: the short ones; dynamic: the unscaled ones)."""
        exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim  # f64[F]
        inv = 1.0 / self.theta**exponents  # f64[F]
        if self.kind == "linear":
            inv = inv / self.factor  # f64[F]
        elif self.kind == "llama3":
            inv = self._llama3(inv)  # f64[F]
        elif self.kind == "yarn":
            inv = self._yarn(inv, rotary_dim)  # f64[F]
        elif self.kind == "longrope":
            inv = inv / np.asarray(self.short_factor, np.float64)  # f64[F]
        return inv.astype(np.float32)  # f32[F]

    def long_inv_freq(self, rotary_dim: int) -> np.ndarray:
        """f32[F]: longrope's frequencies past the original context."""
        exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim  # f64[F]
        return (1.0 / (np.asarray(self.long_factor, np.float64) * self.theta**exponents)).astype(np.float32)  # f32[F]

    def _llama3(self, inv: np.ndarray) -> np.ndarray:  # f64[F] -> f64[F]
        original = self.original_max_position_embeddings
        low_wavelen, high_wavelen = original / self.low_freq_factor, original / self.high_freq_factor
        wavelen = 2 * math.pi / inv  # f64[F]
        smooth = (original / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)  # f64[F]
        scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)  # f64[F]
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)  # bool[F]
        return np.where(medium, (1 - smooth) * scaled / self.factor + smooth * scaled, scaled)  # f64[F]

    def _yarn(self, inv: np.ndarray, dim: int) -> np.ndarray:  # f64[F] -> f64[F]
        original = self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as transformers: no zero-width ramp
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)  # f64[F]
        extrapolation = 1 - ramp  # f64[F]; 1: keep the frequency, 0: divide it by the factor
        return inv / self.factor * (1 - extrapolation) + inv * extrapolation  # f64[F]


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
