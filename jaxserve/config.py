"""Model configuration read from a Hugging Face ``config.json``: the shape of the network and its switches."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

# Architecture name -> family switches. Families share one decoder; these are the only differences.
_FAMILIES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(family="llama", qkv_bias=None, qk_norm=False),
    "MistralForCausalLM": dict(family="mistral", qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(family="qwen2", qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": dict(family="qwen3", qkv_bias=None, qk_norm=True),
    # Mixture-of-Experts families: the same decoder, with an MoE block in place of the MLP (``MoeConfig``).
    # qkv_bias: a bool, None (from attention_bias) or a config key of its own (Qwen2-MoE's, default True).
    "MixtralForCausalLM": dict(family="mixtral", qkv_bias=False, qk_norm=False, moe=True),
    "Qwen2MoeForCausalLM": dict(family="qwen2_moe", qkv_bias="qkv_bias", qk_norm=False, moe=True),
    "Qwen3MoeForCausalLM": dict(family="qwen3_moe", qkv_bias=None, qk_norm=True, o_bias=True, moe=True),
}
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; ``kind`` is "default" or "llama3"."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.kind not in ("default", "llama3"):
            raise ValueError(f"rope type {self.kind!r} is not supported (supported: 'default', 'llama3')")
        if self.theta <= 0:
            raise ValueError(f"rope_theta={self.theta} must be > 0")

    def inv_freq(self, rotary_dim: int) -> list[float]:
        """Inverse frequencies of the rotary pairs (llama3 scaling applied)."""
        inv = [1.0 / self.theta ** (i / rotary_dim) for i in range(0, rotary_dim, 2)]
        if self.kind == "default":
            return inv
        low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / self.factor)
            else:
                smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                    self.high_freq_factor - self.low_freq_factor
                )
                out.append((1 - smooth) * f / self.factor + smooth * f)
        return out


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """A Mixture-of-Experts MLP: ``top_k`` of ``num_experts`` SwiGLU experts per token, softmax router.

    ``norm_topk_prob`` renormalises the chosen experts' probabilities to sum to 1 (always for Mixtral).
    ``shared_expert_size`` > 0 adds Qwen2-MoE's shared expert, a dense SwiGLU MLP of that width scaled by a
    sigmoid gate. ``sparse_layers[i]`` says whether layer ``i`` has the MoE block (else the dense MLP of
    ``ModelConfig.intermediate_size``), from ``decoder_sparse_step`` and ``mlp_only_layers``.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]
    shared_expert_size: int = 0

    def __post_init__(self):
        for name in ("num_experts", "top_k", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoeConfig.{name}={getattr(self, name)} must be >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} exceeds num_experts={self.num_experts}")

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], family: str, layers: int) -> "MoeConfig":
        experts = hf.get("num_local_experts") or hf.get("num_experts")
        if family == "mixtral":
            return cls(experts, hf["num_experts_per_tok"], hf["intermediate_size"], True, (True,) * layers)
        step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or ())
        return cls(experts, hf["num_experts_per_tok"], hf["moe_intermediate_size"], bool(hf.get("norm_topk_prob")),
                   tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
                   hf.get("shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0)

    def routed_params(self, hidden: int) -> int:
        """Parameters of every layer's routed experts (what the ``expert`` mesh axis divides)."""
        return sum(self.sparse_layers) * self.num_experts * 3 * hidden * self.intermediate_size

    def mlp_params(self, hidden: int, *, active: bool) -> int:
        """Parameters of one MoE block: router, experts (only ``top_k`` of them if ``active``), shared expert."""
        experts = self.top_k if active else self.num_experts
        shared = 3 * hidden * self.shared_expert_size + hidden if self.shared_expert_size else 0
        return hidden * self.num_experts + experts * 3 * hidden * self.intermediate_size + shared


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape and per-family switches."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections
    o_bias: bool = False  # bias on the output projection (Llama attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (Qwen3)
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    moe: MoeConfig | None = None  # Mixture-of-Experts families

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.moe is not None and len(self.moe.sparse_layers) < self.num_layers:
            raise ValueError(f"MoeConfig.sparse_layers names {len(self.moe.sparse_layers)} layers, the model has "
                             f"{self.num_layers}")
        if len(self.sliding_windows) != self.num_layers:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in _FAMILIES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        fam = _FAMILIES[arch]
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        layers = hf["num_hidden_layers"]
        eos = hf.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        attention_bias = bool(hf.get("attention_bias", False))
        qkv_bias = fam["qkv_bias"]
        if qkv_bias is None:
            qkv_bias = attention_bias
        elif isinstance(qkv_bias, str):
            qkv_bias = bool(hf.get(qkv_bias, True))
        return cls(
            architecture=arch,
            family=fam["family"],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope=_rope_from_hf(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=attention_bias if fam["family"] == "llama" or fam.get("o_bias") else False,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=fam["qk_norm"],
            sliding_windows=_sliding_windows_from_hf(hf, fam["family"], layers),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
            torch_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
            moe=MoeConfig.from_hf_dict(hf, fam["family"], layers) if fam.get("moe") else None,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        with open(Path(path) / "config.json") as f:
            return cls.from_hf_dict(json.load(f))

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer`` has a Mixture-of-Experts block in place of the dense MLP."""
        return self.moe is not None and self.moe.sparse_layers[layer]

    @property
    def num_params(self) -> int:
        return self._params(active=False)

    @property
    def num_active_params(self) -> int:
        """Parameters one token's forward pass reads: for an MoE model only its ``top_k`` experts per layer."""
        return self._params(active=True)

    def _params(self, *, active: bool) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = sum(self.moe.mlp_params(self.hidden_size, active=active) if self.is_sparse(i)
                  else 3 * self.hidden_size * self.intermediate_size for i in range(self.num_layers))
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        norms = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        return self.num_layers * (attn + norms) + mlp + embed + self.hidden_size


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older checkpoints have `rope_theta` plus
    # an optional `rope_scaling` dict whose type key is `rope_type` or the older `type`.
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            kind=kind,
            factor=params["factor"],
            low_freq_factor=params["low_freq_factor"],
            high_freq_factor=params["high_freq_factor"],
            original_max_position_embeddings=params["original_max_position_embeddings"],
        )
    return RopeConfig(theta=theta, kind=kind)


def _sliding_windows_from_hf(hf: dict[str, Any], family: str, layers: int) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    if family.startswith("qwen") and not hf.get("use_sliding_window", False):
        window = None
    if window is None:
        return (None,) * layers
    types = hf.get("layer_types")
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if family in ("qwen2", "qwen3"):
        first = hf.get("max_window_layers", layers)
        return tuple(window if i >= first else None for i in range(layers))
    return (window,) * layers
