"""Model configuration read from a Hugging Face ``config.json``: the shape of the network and its switches.

The shape every family shares is read here; each family's switches come from its file in ``jaxserve/models/``
(through ``jaxserve.models.registry``). Host-only: no jax.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxserve.models.mla_config import MlaConfig
from jaxserve.models.moe_config import MoeConfig
from jaxserve.models.registry import SUPPORTED_ARCHITECTURES, family_for
from jaxserve.models.rope import RopeConfig
from jaxserve.models.state_config import LinearAttentionConfig

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES"]


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
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (Qwen3, Gemma 3)
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    hidden_act: str = "silu"  # the gated MLP's activation: SwiGLU (silu) or GeGLU (gelu_pytorch_tanh)
    norm_offset: float = 0.0  # RMSNorms scale by (norm_offset + w), in fp32 when nonzero (Gemma: 1)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), rounded to the model dtype (Gemma)
    sandwich_norms: bool = False  # norms after attention and around the MLP too (Gemma 2/3)
    query_pre_attn_scalar: float | None = None  # scores scaled by its ** -0.5 instead of head_dim ** -0.5
    attn_soft_cap: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax (Gemma 2)
    final_soft_cap: float | None = None  # the same on the logits (Gemma 2)
    sliding_rope: RopeConfig | None = None  # rope of the windowed layers when it differs (Gemma 3's local base)
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    # The checkpoint's ``quantization_config`` (or ``compression_config``) as published, read with the rest of
    # config.json so the loader need not read it again (``models.quantization.quantization_of``); not part of
    # the network's identity (equality, hash).
    quantization_config: dict | None = dataclasses.field(default=None, compare=False, repr=False)
    moe: MoeConfig | None = None  # Mixture-of-Experts families
    attn_sinks: bool = False  # a learned sink logit per query head in every softmax denominator (gpt-oss)
    # Hybrid families (Qwen3-Next, Qwen3.5): their Gated DeltaNet layers; the others are full attention, gated
    # (``attn_output_gate``: q_proj also yields a per-channel sigmoid gate of the attention output) and rotating
    # only the first ``rotary_dim`` channels of each head (partial rotary; None: all of them).
    linear_attention: LinearAttentionConfig | None = None
    attn_output_gate: bool = False
    rotary_dim: int | None = None
    # Multi-head latent attention (DeepSeek): num_kv_heads is then 1 and head_dim the latent's width, the shape
    # of what the cache holds per token and layer (one shared latent "KV head", ``jaxserve.models.mla``).
    mla: MlaConfig | None = None

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
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden activation {self.hidden_act!r} is not supported (supported: "
                             f"{', '.join(map(repr, ACTIVATIONS))})")
        for name in ("attn_soft_cap", "final_soft_cap", "query_pre_attn_scalar"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)} must be > 0")
        if any(w is not None and w < 1 for w in self.sliding_windows):
            raise ValueError(f"sliding windows {self.sliding_windows} must be >= 1")
        if self.linear_attention is not None and len(self.linear_attention.layers) != self.num_layers:
            raise ValueError(f"layer_types names {len(self.linear_attention.layers)} layers, the model has "
                             f"{self.num_layers}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary dimensions {self.rotary_dim} must be even and within head_dim={self.head_dim}")

    def is_linear(self, layer: int) -> bool:
        """Whether ``layer`` is a linear-attention (Gated DeltaNet) layer: a state slot, no KV pages."""
        return self.linear_attention is not None and self.linear_attention.layers[layer]

    @property
    def num_attention_layers(self) -> int:
        """Layers that keep KV pages (every layer but the linear-attention ones)."""
        return self.num_layers - (self.linear_attention.num_linear_layers if self.linear_attention else 0)

    @property
    def sm_scale(self) -> float:
        """The multiplier of q·k before the softmax."""
        if self.mla is not None:
            return self.mla.sm_scale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rope_dim(self) -> int:
        """The width rope rotates: the head, multi-head latent attention's rotary part, or a partial rotary's
        ``rotary_dim`` (Qwen3-Next)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return self.rotary_dim or self.head_dim

    def layer_rope(self, layer: int) -> RopeConfig:
        """The rope of one layer: ``sliding_rope`` for windowed layers when set, else ``rope``."""
        if self.sliding_rope is not None and self.sliding_windows[layer] is not None:
            return self.sliding_rope
        return self.rope

    @property
    def attention_window(self) -> int | None:
        """The widest window when every layer is windowed (the KV older than it is never read again); None
        when some layer attends to the whole sequence."""
        if not self.sliding_windows or any(w is None for w in self.sliding_windows):
            return None
        return max(self.sliding_windows)

    @property
    def local_window(self) -> int | None:
        """The widest window when windowed and global layers are interleaved (the windowed layers then get
        their own page pool, ``scheduler/window_pool.py``); None when all or none of the layers are windowed."""
        windows = [w for w in self.sliding_windows if w is not None]
        if not windows or len(windows) == len(self.sliding_windows):
            return None
        return max(windows)

    @property
    def max_context(self) -> int:
        """The longest sequence the model is configured for (rope scaling may stretch the configured one)."""
        return max(self.rope.context_length(self.max_position_embeddings), self.max_position_embeddings)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        """From a ``config.json`` dict; an unsupported architecture, rope type or switch is refused (ValueError
        naming it and what is supported)."""
        arch, family = family_for(hf.get("architectures") or [], hf.get("model_type"))
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        layers = hf["num_hidden_layers"]
        eos = hf.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        fields = family.config(hf)
        if "rope" not in fields:
            fields["rope"] = RopeConfig.from_hf(
                hf.get("rope_parameters") or hf.get("rope_scaling"), theta=hf.get("rope_theta"),
                max_position_embeddings=hf.get("max_position_embeddings", 4096), head_dim=head_dim,
                original_max_position_embeddings=hf.get("original_max_position_embeddings"))
        shared = dict(
            architecture=arch,
            family=family.name,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf.get("intermediate_size") or hf["moe_intermediate_size"],  # (Qwen3.5-MoE: none)
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
            torch_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
            quantization_config=hf.get("quantization_config") or hf.get("compression_config"),
        )
        return cls(**{**shared, **fields})

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
        attn = self.hidden_size * self.head_dim * ((3 if self.attn_output_gate else 2) * self.num_heads
                                                   + 2 * self.num_kv_heads)
        la = self.linear_attention
        linear = la.num_linear_layers * (la.layer_params(self.hidden_size) - attn) if la else 0
        if self.mla is not None:
            attn = self.mla.attention_params(self.hidden_size, self.num_heads)
        mlp = sum(self.moe.mlp_params(self.hidden_size, active=active) if self.is_sparse(i)
                  else 3 * self.hidden_size * self.intermediate_size for i in range(self.num_layers))
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        norms = (4 if self.sandwich_norms else 2) * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        norms += self.num_heads if self.attn_sinks else 0
        return self.num_layers * (attn + norms) + linear + mlp + embed + self.hidden_size
