"""The shape of a hybrid model's linear-attention layers, read from a ``config.json``. Host-only (no jax).

Qwen3-Next and Qwen3.5 interleave Gated DeltaNet layers (``jaxserve.models.gated_deltanet``) with full attention.
A Gated DeltaNet layer keeps no KV per token: each sequence carries a fixed-size recurrent state instead (the
last ``conv_kernel - 1`` inputs of its short causal convolution, and one ``head_k_dim x head_v_dim`` matrix per
value head). The engine keeps those states in a pool of state slots beside the KV pages
(``jaxserve.scheduler.state_pool``); ``state_bytes`` is what one slot costs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.models.family import check_layer_types

STATE_ITEMSIZE = 4  # both states are kept in float32: the delta rule accumulates in it


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers: ``num_k_heads`` query/key heads of ``head_k_dim``, ``num_v_heads`` value heads of
    ``head_v_dim`` (each key head serves ``num_v_heads / num_k_heads`` consecutive value heads), a depthwise
    causal convolution of width ``conv_kernel`` over the concatenated q, k, v. ``layers[i]``: whether layer ``i``
    is one (else it is a full-attention layer). ``fused_projections``: Qwen3-Next's ``in_proj_qkvz`` and
    ``in_proj_ba``, grouped by key head; otherwise Qwen3.5's separate ``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    layers: tuple[bool, ...]
    fused_projections: bool

    def __post_init__(self):
        for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel"):
            if getattr(self, name) < 1:
                raise ValueError(f"LinearAttentionConfig.{name}={getattr(self, name)} must be >= 1")
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim={self.conv_kernel} must be >= 2")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads={self.num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={self.num_k_heads}")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def num_linear_layers(self) -> int:
        return sum(self.layers)

    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_kernel - 1, self.conv_dim)

    def recurrent_state_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's state slot over every linear layer (both states, float32)."""
        (w, c), (h, k, v) = self.conv_state_shape(), self.recurrent_state_shape()
        return self.num_linear_layers * (w * c + h * k * v) * STATE_ITEMSIZE

    def layer_params(self, hidden: int) -> int:
        """Parameters of one Gated DeltaNet layer."""
        return (hidden * (self.conv_dim + self.value_dim + 2 * self.num_v_heads) + self.conv_dim * self.conv_kernel
                + 2 * self.num_v_heads + self.head_v_dim + self.value_dim * hidden)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, fused_projections: bool) -> "LinearAttentionConfig":
        layers = hf["num_hidden_layers"]
        types = hf.get("layer_types")
        if types is None:
            interval = hf.get("full_attention_interval", 4)
            types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
        check_layer_types(types, layers, ("linear_attention", "full_attention"))
        return cls(hf.get("linear_num_key_heads", 16), hf.get("linear_num_value_heads", 32),
                   hf.get("linear_key_head_dim", 128), hf.get("linear_value_head_dim", 128),
                   hf.get("linear_conv_kernel_dim", 4), tuple(t == "linear_attention" for t in types),
                   fused_projections)
