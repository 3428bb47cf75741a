"""Roofline arithmetic: what a decode step and a prefill must move and compute, and the bounds that follow.

All counts are per step for the whole model (divide by the mesh size for per-device figures when sharded).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

from jaxserve.models.config import ModelConfig


def weight_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """Bytes of parameters a step reads: every matrix once; of the embedding only the looked-up rows."""
    embed = cfg.vocab_size * cfg.hidden_size
    read = cfg.num_params - embed * (1 if cfg.tie_word_embeddings else 2)  # layers and norms
    return (read + embed) * itemsize  # + the LM head (which is the embedding when tied)


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    """KV-cache bytes one token occupies over all layers (K and V): the seed formula
    2 * layers * kv_heads * head_dim * bytes; multi-head latent attention caches one latent entry of head_dim
    values per token and layer, no separate V."""
    return (1 if cfg.mla else 2) * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def matmul_flops_per_token(cfg: ModelConfig) -> int:
    """2 * (parameters touched by one token's matmuls): projections, MLP and the LM head."""
    h, d = cfg.hidden_size, cfg.head_dim
    if cfg.mla is not None:  # DeepSeek: its active parameters (top-k experts), less the embedding's lookup (no matmul)
        return 2 * (cfg.num_active_params - (0 if cfg.tie_word_embeddings else cfg.vocab_size * h))
    attn = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    mlp = 3 * h * cfg.intermediate_size
    return 2 * (cfg.num_layers * (attn + mlp) + h * cfg.vocab_size)


def attention_flops(cfg: ModelConfig, query_tokens: int, keys_per_query: float) -> float:
    """QK^T and PV: 4 * heads * head_dim FLOPs per (query, key) pair, per layer (for latent attention head_dim is
    the latent entry's width, which both products span, the PV one reading its latent prefix)."""
    return 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * query_tokens * keys_per_query


@dataclasses.dataclass(frozen=True)
class StepCost:
    flops: float
    bytes: float

    def bound_seconds(self, peak_flops: float, peak_bytes_per_s: float) -> float:
        """The roofline lower bound on the step's time."""
        return max(self.flops / peak_flops, self.bytes / peak_bytes_per_s)


def decode_cost(cfg: ModelConfig, itemsize: int, batch: int, context: float) -> StepCost:
    """One decode step of ``batch`` sequences with ``context`` cached tokens each (mean)."""
    kv = kv_bytes_per_token(cfg, itemsize)
    return StepCost(
        flops=batch * matmul_flops_per_token(cfg) + attention_flops(cfg, batch, context + 1),
        bytes=weight_bytes(cfg, itemsize) + batch * (context + 1) * kv,
    )


def prefill_cost(cfg: ModelConfig, itemsize: int, tokens: int) -> StepCost:
    """A prefill of one ``tokens``-long prompt (causal: (tokens + 1) / 2 keys per query on average).

    The LM head runs on the last position only.
    """
    head = 2 * cfg.hidden_size * cfg.vocab_size
    return StepCost(
        flops=tokens * (matmul_flops_per_token(cfg) - head) + head + attention_flops(cfg, tokens, (tokens + 1) / 2),
        bytes=weight_bytes(cfg, itemsize) + tokens * kv_bytes_per_token(cfg, itemsize),
    )


def _time(fn, *args, repeats: int = 5, calls: int = 1) -> float:
    """Seconds of one call: the best of ``repeats`` samples, each ``calls`` back-to-back calls (so the host's
    dispatch and the wait overlap the device's work instead of adding to it) divided by ``calls``."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(calls)])
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def measure_peaks(dtype=jnp.float32, *, read_mib: int = 512, matmul_n: int = 4096) -> tuple[float, float]:
    """(FLOP/s, bytes/s) the default device reaches on a large matmul and a large read (a sum).

    A decode step mostly reads (weights and KV), so the bandwidth is a read-only pass's. Each sample times 8
    back-to-back reads: a 2 GiB read takes ~0.5 ms on an H200, where one call's dispatch and wait moved the figure
    between 3.0 and 3.7 TB/s from one run to the next.
    """
    x = jnp.ones((read_mib * 2**20 // 4,), jnp.float32)
    bandwidth = x.nbytes / _time(jax.jit(jnp.sum), x, calls=8)
    a = jnp.ones((matmul_n, matmul_n), dtype)
    flops = 2 * matmul_n**3 / _time(jax.jit(lambda p, q: p @ q), a, a)
    return flops, bandwidth
