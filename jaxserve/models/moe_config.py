"""The shape of a Mixture-of-Experts MLP, read from a ``config.json``. Host-only (no jax)."""

from __future__ import annotations

import dataclasses
from typing import Any

SCORING = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")

@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """A Mixture-of-Experts MLP: ``top_k`` of ``num_experts`` SwiGLU experts per token, softmax router.

    ``norm_topk_prob`` renormalises the chosen experts' probabilities to sum to 1 (always for Mixtral).
    ``shared_expert_size`` > 0 adds Qwen2-MoE's shared expert, a dense SwiGLU MLP of that width scaled by a
    sigmoid gate. ``sparse_layers[i]`` says whether layer ``i`` has the MoE block (else the dense MLP of
    ``ModelConfig.intermediate_size``), from ``decoder_sparse_step`` and ``mlp_only_layers``.

    gpt-oss: the router has a bias and its softmax runs over the top-k logits only (``softmax_after_topk``); the
    experts have biases (``expert_bias``) and the clamped gated activation (``activation="gpt_oss"``):
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]
    shared_expert_size: int = 0
    router_bias: bool = False
    softmax_after_topk: bool = False
    expert_bias: bool = False
    activation: str = "silu"  # "silu" (SwiGLU) or "gpt_oss" (the clamped variant above)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    scoring: str = "softmax"  # "softmax" or "sigmoid"
    topk_method: str = "greedy"  # "greedy", "group_limited_greedy" or "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False
    shared_expert_gated: bool = True

    def __post_init__(self):
        for name in ("num_experts", "top_k", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoeConfig.{name}={getattr(self, name)} must be >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} exceeds num_experts={self.num_experts}")
        if self.activation not in ("silu", "gpt_oss"):
            raise ValueError(f"expert activation {self.activation!r} is not supported (supported: 'silu', 'gpt_oss')")
        for name in ("swiglu_alpha", "swiglu_limit"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.scoring not in SCORING:
            raise ValueError(f"scoring_func={self.scoring!r} is not supported (supported: {', '.join(SCORING)})")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method={self.topk_method!r} is not supported (supported: "
                             f"{', '.join(TOPK_METHODS)})")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_group={self.n_group} must be >= 1 and divide n_routed_experts={self.num_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must be in 1..n_group={self.n_group}")
        if self.top_k > self.topk_group * self.num_experts // self.n_group:
            raise ValueError(f"num_experts_per_tok={self.top_k} exceeds the experts of topk_group={self.topk_group} "
                             f"groups")

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], family: str, layers: int) -> "MoeConfig":
        experts = hf.get("num_local_experts") or hf.get("num_experts")
        if family == "mixtral":
            return cls(experts, hf["num_experts_per_tok"], hf["intermediate_size"], True, (True,) * layers)
        if family == "gpt_oss":
            return cls(experts, hf["num_experts_per_tok"], hf["intermediate_size"], False, (True,) * layers,
                       router_bias=True, softmax_after_topk=True, expert_bias=True, activation="gpt_oss",
                       swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                       swiglu_limit=float(hf.get("swiglu_limit", 7.0)))
        step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or ())
        return cls(experts, hf["num_experts_per_tok"], hf["moe_intermediate_size"], bool(hf.get("norm_topk_prob")),
                   tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
                   hf.get("shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0)

    def routed_params(self, hidden: int) -> int:
        """Parameters of every layer's routed experts (what the ``expert`` mesh axis divides)."""
        bias = (2 * self.intermediate_size + hidden) if self.expert_bias else 0
        return sum(self.sparse_layers) * self.num_experts * (3 * hidden * self.intermediate_size + bias)

    def mlp_params(self, hidden: int, *, active: bool) -> int:
        """Parameters of one MoE block: router, experts (only ``top_k`` of them if ``active``), shared expert."""
        experts = self.top_k if active else self.num_experts
        gate = hidden if self.shared_expert_gated else 0
        shared = 3 * hidden * self.shared_expert_size + gate if self.shared_expert_size else 0
        bias = (2 * self.intermediate_size + hidden) if self.expert_bias else 0
        router = (hidden + 1 if self.router_bias else hidden) * self.num_experts
        return router + experts * (3 * hidden * self.intermediate_size + bias) + shared
