"""The decoder shared by every supported family (Llama 2/3/3.x, Mistral, Qwen2/2.5, Qwen3; with ``moe``'s block
as the MLP: Mixtral, Qwen2-MoE, Qwen3-MoE).

Flax NNX modules hold the parameters with their logical sharding axes; each ``__call__`` is a thin call into
the pure functions of ``layers``. Family differences are switches on ``ModelConfig`` (biases, q/k norm,
sliding windows, tied embeddings, rope scaling), never copies of the code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.attention import AttentionBackend, AttentionMetadata
from jaxserve.config import ModelConfig
from jaxserve.models import layers, moe
from sharding.layout import StepLayout

KVCache = list[tuple[jax.Array, jax.Array]]  # per layer: (k_pages, v_pages) [KVH, num_pages, page_size, D]


def _constrain(x: jax.Array, layout: StepLayout | None, *axes: str | None) -> jax.Array:
    """Pin an activation's sharding by logical axes (no-op without a mesh layout)."""
    return x if layout is None else layout.constrain(x, axes)


def _param(shape, dtype, axes) -> nnx.Param:
    # Real values come from a checkpoint (or the demo initialiser); modules are built under nnx.eval_shape.
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, axes=("norm",)):
        self.weight = _param((dim,), dtype, axes)
        self.eps = eps

    def __call__(self, x):
        return layers.rms_norm(x, self.weight[...], self.eps)


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, dtype):
        self.embedding = _param((vocab, dim), dtype, ("vocab", "embed"))

    def __call__(self, token_ids):
        return self.embedding[...][token_ids]


class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, *, bias: bool, dtype, axes: tuple[str, str]):
        self.weight = _param((din, dout), dtype, axes)
        self.bias = _param((dout,), dtype, axes[1:]) if bias else None

    def __call__(self, x):
        return layers.linear(x, self.weight[...], None if self.bias is None else self.bias[...])


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype):
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias, dtype=dtype, axes=("embed", "q_heads"))
        self.k_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias, dtype=dtype, axes=("embed", "kv_heads"))
        self.v_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias, dtype=dtype, axes=("embed", "kv_heads"))
        self.o_proj = Linear(cfg.num_heads * d, h, bias=cfg.o_bias, dtype=dtype, axes=("q_heads", "embed"))
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, ("head_dim",)) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, ("head_dim",)) if cfg.qk_norm else None
        self.cfg, self.sliding_window = cfg, cfg.sliding_windows[layer]

    def __call__(self, x, positions, inv_freq, k_pages, v_pages, md: AttentionMetadata, backend: AttentionBackend,
                 layout: StepLayout | None = None):
        cfg, t = self.cfg, x.shape[0]
        q = _constrain(self.q_proj(x).reshape(t, cfg.num_heads, cfg.head_dim), layout, "tokens", "act_heads", None)
        k = _constrain(self.k_proj(x).reshape(t, cfg.num_kv_heads, cfg.head_dim), layout, "tokens", "act_kv_heads",
                       None)
        v = _constrain(self.v_proj(x).reshape(t, cfg.num_kv_heads, cfg.head_dim), layout, "tokens", "act_kv_heads",
                       None)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = layers.rope(q, positions, inv_freq), layers.rope(k, positions, inv_freq)
        out, k_pages, v_pages = backend(
            q, k, v, k_pages, v_pages, md, sm_scale=cfg.head_dim**-0.5, sliding_window=self.sliding_window
        )
        return self.o_proj(out.reshape(t, cfg.num_heads * cfg.head_dim)), k_pages, v_pages


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, intermediate_size: int | None = None):
        h, m, b = cfg.hidden_size, intermediate_size or cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = Linear(h, m, bias=b, dtype=dtype, axes=("embed", "mlp"))
        self.up_proj = Linear(h, m, bias=b, dtype=dtype, axes=("embed", "mlp"))
        self.down_proj = Linear(m, h, bias=b, dtype=dtype, axes=("mlp", "embed"))

    def __call__(self, x, layout: StepLayout | None = None):
        hidden = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(_constrain(hidden, layout, "tokens", "act_mlp"))


def make_mlp(cfg: ModelConfig, layer: int, dtype) -> nnx.Module:
    """The layer's MLP: dense, or a Mixture-of-Experts block (``models.moe``) where the family has one."""
    if not cfg.is_sparse(layer):
        return MLP(cfg, dtype)
    shared = cfg.moe.shared_expert_size
    return moe.SparseMoeBlock(cfg, dtype, MLP(cfg, dtype, shared) if shared else None)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, layer, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = make_mlp(cfg, layer, dtype)

    def __call__(self, x, positions, inv_freq, k_pages, v_pages, md, backend, layout: StepLayout | None = None):
        attn, k_pages, v_pages = self.self_attn(
            self.input_layernorm(x), positions, inv_freq, k_pages, v_pages, md, backend, layout
        )
        x = _constrain(x + attn, layout, "tokens", "act_embed")
        x = x + self.mlp(self.post_attention_layernorm(x), layout)
        return _constrain(x, layout, "tokens", "act_embed"), k_pages, v_pages


class DecoderLM(nnx.Module):
    """Token embedding, the decoder layers, the final norm and the LM head (absent when tied)."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32):
        self.cfg = cfg
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = (
            None if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, axes=("embed", "vocab"))
        )


def forward(
    model: DecoderLM,
    token_ids: jax.Array,  # i32[R * T]
    positions: jax.Array,  # i32[R * T]  each row's absolute position (0 for padding rows)
    md: AttentionMetadata,  # every field with a leading replica axis R
    kv_cache: KVCache,
    logits_indices: jax.Array,  # i32[N]
    attention,
    layout: StepLayout | None = None,
) -> tuple[jax.Array, KVCache]:
    """Run the decoder over ``R`` data replicas' ragged batches side by side, writing their K/V into the cache.

    Rows ``r*T .. (r+1)*T - 1`` of ``token_ids`` are replica ``r``'s; ``attention`` is a
    ``ShardedAttention`` (it takes the stacked metadata and hands each shard its replica's block).
    ``logits_indices`` are rows of the whole array. ``layout`` (the mesh and rules of the step) pins activation
    shardings; None runs unconstrained.

    Returns:
      (logits f32[N, vocab] at the ``logits_indices`` rows, gathered over the mesh; the updated cache).
    """
    cfg = model.cfg
    inv_freq = jnp.asarray(np.array(cfg.rope.inv_freq(cfg.head_dim), np.float32))
    x = _constrain(model.embed_tokens(_constrain(token_ids, layout, "tokens")), layout, "tokens", "act_embed")
    new_cache = []
    for layer, (k_pages, v_pages) in zip(model.layers, kv_cache, strict=True):
        x, k_pages, v_pages = layer(x, positions, inv_freq, k_pages, v_pages, md, attention, layout)
        new_cache.append((k_pages, v_pages))
    x = model.norm(x[logits_indices])
    head = model.embed_tokens.embedding[...].T if model.lm_head is None else model.lm_head.weight[...]
    # Each tensor shard computes its vocab slice; then the [N, vocab] logits (not the head) are gathered.
    logits = _constrain(layers.matmul_f32(x, head), layout, "slots", "act_vocab")
    return _constrain(logits, layout, "slots", "logits_vocab"), new_cache
