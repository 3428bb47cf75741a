"""The decoder shared by every supported family (the family files beside this one list them); MoE families
(Mixtral, Qwen2-MoE, Qwen3-MoE) have ``moe``'s block as the MLP of their sparse layers.

Flax NNX modules hold the parameters with their logical sharding axes; each ``__call__`` is a thin call into
the pure functions of ``layers``. Family differences are switches on ``ModelConfig`` (biases, q/k norm, norm
offset and placement, activation, embedding scale, soft caps, per-layer windows and rope), set by each family's
file, never copies of the code.

Shapes are noted ``dtype[dims]``, as in ``pallas_kernels``: ``i32``, ``f32`` are fixed dtypes, ``dt`` is the
model's dtype (bf16, f16 or f32), ``w8`` an 8-bit weight's (``jaxserve.models.quantization``), ``kv`` the KV
pool's (``AttentionBackend.cache_dtype``; an 8-bit pool is a ``QuantizedPages``). Dims: R data replicas, T token
rows per replica (a step runs R * T), N rows whose logits are taken, S sequence slots, P pages per slot, C hidden
size, H query heads, K KV heads, D head_dim, I the MLP's width, V vocabulary, B the edge of a block scale's blocks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models import gated_deltanet, layers, mla, moe
from jaxserve.models.attention import AttentionBackend, AttentionMetadata
from jaxserve.models.config import ModelConfig
from jaxserve.models.modules import Embed, Linear, RMSNorm, constrain, param
from sharding.layout import StepLayout

KVCache = list[tuple[jax.Array, jax.Array]]  # per layer: (k_pages, v_pages), kv[K, num_pages, page_size, D] each


def _pick(lora, group: str, name: str):
    """(a, b, rows) of one projection from a layer's ``lora`` (its slots by group and name, and the step's rows),
    or None."""
    if lora is None:
        return None
    weights, rows = lora
    ab = weights.get(group, {}).get(name)
    return None if ab is None else (*ab, rows)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype):
        h, d = cfg.hidden_size, cfg.head_dim
        # weight dt[C, H * D] (w8 when quantized; so for every Linear); dt[C, H * 2D] with an output gate (each
        # head's D query channels, then its D gate channels)
        gated = 2 if cfg.attn_output_gate else 1
        self.q_proj = Linear(h, cfg.num_heads * d * gated, bias=cfg.qkv_bias, dtype=dtype,
                             axes=("embed", "q_heads"))
        # weight dt[C, K * D] each
        self.k_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias, dtype=dtype, axes=("embed", "kv_heads"))
        self.v_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias, dtype=dtype, axes=("embed", "kv_heads"))
        # weight dt[H * D, C]
        self.o_proj = Linear(cfg.num_heads * d, h, bias=cfg.o_bias, dtype=dtype, axes=("q_heads", "embed"))
        self.q_norm = RMSNorm(d, cfg, dtype, ("head_dim",)) if cfg.qk_norm else None  # dt[D]
        self.k_norm = RMSNorm(d, cfg, dtype, ("head_dim",)) if cfg.qk_norm else None  # dt[D]
        # dt[H]: gpt-oss's per-head sink logits (pallas_kernels.ragged_paged_attention.reference)
        self.sinks = param((cfg.num_heads,), dtype, ("q_heads",)) if cfg.attn_sinks else None
        self.cfg, self.sliding_window = cfg, cfg.sliding_windows[layer]

    def __call__(self, x, rope_table, k_pages, v_pages, md: AttentionMetadata, backend: AttentionBackend,
                 layout: StepLayout | None = None, lora=None):
        """x: dt[R * T, C]; rope_table: (cos, sin) f32[R * T, D] each; k_pages, v_pages: kv[K, num_pages,
        page_size, D]; ``lora``: the layer's adapter slots and the step's rows (``DecoderLayer``). Returns
        (dt[R * T, C], k_pages, v_pages) with this step's K/V written."""
        cfg, t = self.cfg, x.shape[0]
        proj = lambda name: getattr(self, name)(x, _pick(lora, "self_attn", name))  # noqa: E731
        q = proj("q_proj")
        gate = None
        if cfg.attn_output_gate:  # dt[R * T, H, 2D] -> q dt[R * T, H, D], gate dt[R * T, H * D]
            q = q.reshape(t, cfg.num_heads, 2 * cfg.head_dim)
            q, gate = q[..., : cfg.head_dim], q[..., cfg.head_dim:].reshape(t, cfg.num_heads * cfg.head_dim)
        q = constrain(q.reshape(t, cfg.num_heads, cfg.head_dim), layout, "tokens", "act_heads",
                       None)  # dt[R * T, H, D]
        k = constrain(proj("k_proj").reshape(t, cfg.num_kv_heads, cfg.head_dim), layout, "tokens", "act_kv_heads",
                       None)  # dt[R * T, K, D]
        v = constrain(proj("v_proj").reshape(t, cfg.num_kv_heads, cfg.head_dim), layout, "tokens", "act_kv_heads",
                       None)  # dt[R * T, K, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # dt[R * T, H, D], dt[R * T, K, D]
        q, k = layers.rope(q, *rope_table), layers.rope(k, *rope_table)  # dt[R * T, H, D], dt[R * T, K, D]
        # Only families with sinks pass them: the others trace exactly the programs they did before.
        sinks = {} if self.sinks is None else {"sinks": self.sinks[...].astype(jnp.float32)}  # f32[H]
        out, k_pages, v_pages = backend(  # out: dt[R * T, H, D]; the pages: kv[K, num_pages, page_size, D]
            q, k, v, k_pages, v_pages, md, sm_scale=cfg.sm_scale, sliding_window=self.sliding_window,
            soft_cap=cfg.attn_soft_cap, **sinks,
        )
        out = out.reshape(t, cfg.num_heads * cfg.head_dim)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate)  # dt[R * T, H * D]
        out = self.o_proj(out, _pick(lora, "self_attn", "o_proj"))
        return out, k_pages, v_pages  # dt[R * T, C], ...


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, intermediate_size: int | None = None):
        h, m, b = cfg.hidden_size, intermediate_size or cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = Linear(h, m, bias=b, dtype=dtype, axes=("embed", "mlp"))  # weight dt[C, I]
        self.up_proj = Linear(h, m, bias=b, dtype=dtype, axes=("embed", "mlp"))  # weight dt[C, I]
        self.down_proj = Linear(m, h, bias=b, dtype=dtype, axes=("mlp", "embed"))  # weight dt[I, C]
        self.act = cfg.hidden_act

    def __call__(self, x, layout: StepLayout | None = None, lora=None):  # dt[R * T, C] -> dt[R * T, C]
        gate, up = self.gate_proj(x, _pick(lora, "mlp", "gate_proj")), self.up_proj(x, _pick(lora, "mlp", "up_proj"))
        hidden = layers.ACTIVATIONS[self.act](gate) * up  # dt[R * T, I]
        return self.down_proj(constrain(hidden, layout, "tokens", "act_mlp"), _pick(lora, "mlp", "down_proj"))


def make_mlp(cfg: ModelConfig, layer: int, dtype) -> nnx.Module:
    """The layer's MLP: dense, or a Mixture-of-Experts block (``models.moe``) where the family has one."""
    if not cfg.is_sparse(layer):
        return MLP(cfg, dtype)
    shared = cfg.moe.shared_expert_size
    return moe.SparseMoeBlock(cfg, dtype, MLP(cfg, dtype, shared) if shared else None)


class DecoderLayer(nnx.Module):
    """Pre-norm residual blocks. With ``sandwich_norms`` (Gemma) ``post_attention_layernorm`` normalises the
    attention output and the MLP has its own norms before and after; otherwise ``post_attention_layernorm`` is
    the MLP's input norm (the checkpoints' names, kept as they are)."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype):
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg, dtype)
        linear = cfg.is_linear(layer)  # a hybrid's Gated DeltaNet layer in place of attention
        attention = Attention if cfg.mla is None else mla.MlaAttention
        self.self_attn = None if linear else attention(cfg, layer, dtype)
        self.linear_attn = gated_deltanet.GatedDeltaNet(cfg, dtype) if linear else None
        self.post_attention_layernorm = RMSNorm(h, cfg, dtype)
        self.pre_feedforward_layernorm = RMSNorm(h, cfg, dtype) if cfg.sandwich_norms else None
        self.post_feedforward_layernorm = RMSNorm(h, cfg, dtype) if cfg.sandwich_norms else None
        self.mlp = make_mlp(cfg, layer, dtype)

    def __call__(self, x, rope_table, k_pages, v_pages, md, backend, layout: StepLayout | None = None, lora=None):
        """x: dt[R * T, C] -> (dt[R * T, C], k_pages, v_pages) (as ``Attention``). ``lora``: (this layer's adapter
        slots {group: {name: (a, b)}}, the step's ``LoraRows``), or None."""
        # The named scopes only label the compiled program's ops (a profile's split by layer kind:
        # scripts/benchmark_offline.py --profile); they change no computation.
        with jax.named_scope("norm"):
            h = self.input_layernorm(x)  # dt[R * T, C]
        with jax.named_scope("attention"):
            if self.linear_attn is not None:  # k_pages, v_pages: the layer's state slots (gated_deltanet)
                attn, k_pages, v_pages = self.linear_attn(h, k_pages, v_pages, *(
                    (None, None) if md is None else md), decode=bool(getattr(getattr(backend, "backend", None),
                                                                             "decode", False)))
            else:
                attn, k_pages, v_pages = self.self_attn(  # attn: dt[R * T, C]
                    h, rope_table, k_pages, v_pages, md, backend, layout, lora
                )

        def mlp(h):  # a Mixture-of-Experts block takes no adapter
            with jax.named_scope("mlp"):
                return self.mlp(h, layout, lora) if isinstance(self.mlp, MLP) else self.mlp(h, layout)

        def norm(module, h):
            with jax.named_scope("norm"):
                return module(h)

        if self.pre_feedforward_layernorm is None:
            x = constrain(x + attn, layout, "tokens", "act_embed")  # dt[R * T, C]
            x = x + mlp(norm(self.post_attention_layernorm, x))  # dt[R * T, C]
        else:
            x = constrain(x + norm(self.post_attention_layernorm, attn), layout, "tokens", "act_embed")
            x = x + norm(self.post_feedforward_layernorm, mlp(norm(self.pre_feedforward_layernorm, x)))
        return constrain(x, layout, "tokens", "act_embed"), k_pages, v_pages  # dt[R * T, C], ...


class DecoderLM(nnx.Module):
    """Token embedding, the decoder layers, the final norm and the LM head (absent when tied)."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32):
        self.cfg = cfg
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype, scale=cfg.embed_scale)  # dt[V, C]
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg, dtype)  # dt[C]
        self.lm_head = (  # weight dt[C, V]
            None if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, axes=("embed", "vocab"))
        )


def forward(
    model: DecoderLM,
    token_ids: jax.Array,  # i32[R * T]
    positions: jax.Array,  # i32[R * T]  each row's absolute position (0 for padding rows)
    md: AttentionMetadata,  # every field with a leading replica axis R: page_indices i32[R, S, P], ...
    kv_cache: KVCache,  # per layer: (k_pages, v_pages), kv[K, num_pages, page_size, D] each
    logits_indices: jax.Array,  # i32[N]
    attention,
    layout: StepLayout | None = None,
    local_pool: bool = False,
    lora=None,
) -> tuple[jax.Array, KVCache]:
    """Run the decoder over ``R`` data replicas' ragged batches side by side, writing their K/V into the cache.

    Rows ``r*T .. (r+1)*T - 1`` of ``token_ids`` are replica ``r``'s; ``attention`` is a
    ``ShardedAttention`` (it takes the stacked metadata and hands each shard its replica's block).
    ``logits_indices`` are rows of the whole array. ``layout`` (the mesh and rules of the step) pins activation
    shardings; None runs unconstrained. With ``local_pool`` the windowed layers keep their pages in a pool of
    their own: each page-table row is the global table followed by the windowed one, of equal widths. ``lora``:
    (per layer, its adapter slots {group: {name: (a, b)}}; the step's ``LoraRows``), or None (no adapters).

    Returns:
      (logits f32[N, V] at the ``logits_indices`` rows, gathered over the mesh; the updated cache).
    """
    cfg = model.cfg
    # One cos/sin table per distinct rope (Gemma 3: global and local), shared by the layers that use it.
    tables = {}  # rope -> (cos, sin), f32[R * T, D] each (f32[R * T, rotary_dim] with partial rotary)
    for i in range(cfg.num_layers):
        rope = cfg.layer_rope(i)
        if rope not in tables:
            tables[rope] = layers.rope_tables(positions, rope, cfg.rope_dim)
    state_md = None
    if cfg.linear_attention is not None:
        # A hybrid: each page-table row ends with the sequence's state slot (one replica, gated_deltanet).
        if md.page_indices.shape[0] != 1:
            raise ValueError("linear-attention models run on one data replica")
        state_md = (jax.tree.map(lambda a: a[0], md), md.page_indices[0, :, -1])  # (metadata, slots i32[S])
        md = dataclasses.replace(md, page_indices=md.page_indices[..., :-1])  # i32[R, S, P]
    md_global = md_local = md
    if local_pool:
        width = md.page_indices.shape[-1] // 2  # P / 2: each pool's pages per slot
        md_global = dataclasses.replace(md, page_indices=md.page_indices[..., :width])  # i32[R, S, P / 2]
        md_local = dataclasses.replace(md, page_indices=md.page_indices[..., width:])  # i32[R, S, P / 2]
    # dt[R * T, C]
    with jax.named_scope("embed"):
        x = constrain(model.embed_tokens(constrain(token_ids, layout, "tokens")), layout, "tokens", "act_embed")
    new_cache = []
    for i, (layer, (k_pages, v_pages)) in enumerate(zip(model.layers, kv_cache, strict=True)):
        layer_md = state_md if cfg.is_linear(i) else md_local if cfg.sliding_windows[i] is not None else md_global
        # x: dt[R * T, C]; the pages: kv[K, num_pages, page_size, D]
        x, k_pages, v_pages = layer(x, tables[cfg.layer_rope(i)], k_pages, v_pages, layer_md, attention, layout,
                                    None if lora is None else (lora[0][i], lora[1]))
        new_cache.append((k_pages, v_pages))
    with jax.named_scope("norm"):
        x = model.norm(x[logits_indices])  # dt[N, C]
    head_module = model.embed_tokens if model.lm_head is None else model.lm_head
    head, head_scale = (getattr(head_module, n) for n in (("embedding", "embedding_scale") if model.lm_head is None
                                                          else ("weight", "weight_scale")))
    head = head[...].T if model.lm_head is None else head[...]  # dt[C, V] (w8[C, V] when quantized)
    head_scale = None if head_scale is None else head_scale[...]  # f32[V] (or f32[C / B, V / B]) when quantized
    # Each tensor shard computes its vocab slice; then the f32[N, V] logits (not the head) are gathered.
    with jax.named_scope("lm_head"):
        logits = layers.soft_cap(constrain(layers.matmul_f32(x, head, head_scale), layout, "slots", "act_vocab"),
                                 cfg.final_soft_cap)  # f32[N, V]
    return constrain(logits, layout, "slots", "logits_vocab"), new_cache  # f32[N, V], per layer the pages
