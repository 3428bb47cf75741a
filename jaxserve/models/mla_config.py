"""The shape of multi-head latent attention (DeepSeek-V2/V3), read from a ``config.json``. Host-only (no jax)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention: every head's key and value are up-projections of one shared latent.

    A token's keys and values are ``kv_b_proj`` of its ``kv_lora_rank`` latent (the no-rotary key part,
    ``qk_nope_head_dim`` per head, and the value, ``v_head_dim``), plus one rotary key of ``qk_rope_head_dim``
    shared by all heads. The queries come from ``q_proj``, or with ``q_lora_rank`` through a low-rank
    ``q_a_proj`` / ``q_b_proj`` pair. The cache holds the latent and the rotary key only (``latent_dim`` values
    per token and layer); attention runs in the absorbed form (``jaxserve.models.mla``). ``rope_interleave``:
    the rotary dimensions come in (even, odd) pairs. ``sm_scale`` is ``(nope + rope) ** -0.5`` times yarn's
    squared ``mscale_all_dim`` correction.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    sm_scale: float = 1.0

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank={self.q_lora_rank} must be >= 1 (or null: no query compression)")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")

    @property
    def latent_dim(self) -> int:
        """Values one token's cache entry holds per layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def replicated_params(self, hidden: int) -> int:
        """Parameters of one layer's attention that tensor parallelism does not split (split by head: the rest):
        the low-rank down-projections and their norms."""
        q = hidden * self.q_lora_rank + self.q_lora_rank if self.q_lora_rank else 0
        return q + hidden * self.latent_dim + self.kv_lora_rank

    def attention_params(self, hidden: int, heads: int) -> int:
        """Parameters of one layer's attention (projections and the two low-rank norms)."""
        qk = heads * self.qk_head_dim
        q = hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * qk if self.q_lora_rank else hidden * qk
        kv = hidden * self.latent_dim + self.kv_lora_rank + self.kv_lora_rank * heads * (
            self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * hidden
