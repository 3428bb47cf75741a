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
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models import gated_deltanet, layers, mla, moe
from jaxserve.models.attention import AttentionBackend, AttentionMetadata
from jaxserve.models.config import ModelConfig
from jaxserve.models.modules import Embed, Linear, RMSNorm, constrain, param
from sharding.layout import StepLayout

KVCache = list[tuple[jax.Array, jax.Array]]  # per layer: (k_pages, v_pages), kv[K, num_pages, page_size, D] each


def _out_spec(weight):
    """The mesh axis a weight dt[in, out]'s output columns are split over (None: whole, or not on a mesh)."""
    sharding = getattr(weight, "sharding", None)
    spec = tuple(sharding.spec) if isinstance(sharding, jax.sharding.NamedSharding) else ()
    return spec[1] if len(spec) > 1 else None


# A fused weight's name -> the projections it joins (``Attention.fuse_qkv``, ``MLP.fuse_gate_up``).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# The logical sharding axes of those projections' weights and of the fused weights.
AXES = {"q_proj": ("embed", "q_heads"), "k_proj": ("embed", "kv_heads"), "v_proj": ("embed", "kv_heads"),
        "gate_proj": ("embed", "mlp"), "up_proj": ("embed", "mlp"),
        "qkv_proj": ("embed", "kv_heads", None, "head_dim"), "gate_up_proj": ("embed", None, "mlp")}
_PART_DIM = {"qkv_proj": 1, "gate_up_proj": 2}  # the fused dim that carries the parts' output split


def join_projections(name: str, parts, num_kv_heads: int, head_dim: int) -> jax.Array:
    """The parts (dt[C, out] each, in ``FUSED[name]``'s order) as one weight: Q/K/V dt[C, K, G + 2, D] (per KV head
    its G query heads, its key, its value), gate/up dt[C, 2, I]."""
    if name == "gate_up_proj":
        return jnp.stack(parts, axis=1)
    c = parts[0].shape[0]
    q, k, v = (p.reshape(c, num_kv_heads, -1, head_dim) for p in parts)
    return jnp.concatenate([q, k, v], axis=2)


def split_projections(name: str, fused: jax.Array) -> tuple[jax.Array, ...]:
    """``join_projections`` undone: the parts, dt[C, out] each."""
    if name == "gate_up_proj":
        return fused[:, 0], fused[:, 1]
    c, group = fused.shape[0], fused.shape[2] - 2
    return tuple(p.reshape(c, -1) for p in (fused[:, :, :group], fused[:, :, group], fused[:, :, group + 1]))


def fused_sharding(name: str, part):
    """The sharding of ``name``'s fused weight whose parts are sharded as ``part`` (a NamedSharding of dt[C, out];
    None off a mesh): the input dim as it was, the output split on the dim that carries it."""
    if not isinstance(part, jax.sharding.NamedSharding):
        return None
    spec = tuple(part.spec) + (None,) * (2 - len(part.spec))
    dims = [spec[0], None, None] + ([None] if name == "qkv_proj" else [])
    dims[_PART_DIM[name]] = spec[1]
    return jax.sharding.NamedSharding(part.mesh, jax.sharding.PartitionSpec(*dims))


def part_sharding(name: str, fused):
    """``fused_sharding`` undone: the sharding of each part of a fused weight sharded as ``fused``."""
    if not isinstance(fused, jax.sharding.NamedSharding):
        return None
    spec = tuple(fused.spec) + (None,) * (4 - len(fused.spec))
    return jax.sharding.NamedSharding(fused.mesh, jax.sharding.PartitionSpec(spec[0], spec[_PART_DIM[name]]))


@functools.cache
def joiner(name: str, num_kv_heads: int, head_dim: int, out_sharding):
    """``join_projections`` compiled once per (weight, heads, sharding): every layer and every swap of new
    weights (``executor.live_weights.fuse_like``) reuses it."""
    return jax.jit(lambda *parts: join_projections(name, parts, num_kv_heads, head_dim), out_shardings=out_sharding)


@functools.cache
def splitter(name: str, part_sharding):
    """``split_projections`` compiled once per (weight, sharding) (``executor.live_weights.split_fused``)."""
    out = None if part_sharding is None else tuple(part_sharding for _ in FUSED[name])
    return jax.jit(lambda fused: split_projections(name, fused), out_shardings=out)


def _join_in_place(module, name: str, num_kv_heads: int, head_dim: int) -> None:
    """Replace ``module``'s ``FUSED[name]`` Linears by one weight ``name`` on the same devices."""
    parts = [getattr(module, p).weight.get_value() for p in FUSED[name]]
    sharding = fused_sharding(name, getattr(parts[0], "sharding", None))
    join = joiner(name, num_kv_heads, head_dim, sharding)
    # Abstract weights (jaxserve.aot): the fused weight's shape, dtype and sharding alone.
    fused = jax.eval_shape(join, *parts) if isinstance(parts[0], jax.ShapeDtypeStruct) else join(*parts)
    setattr(module, name, nnx.Param(fused, logical_axes=AXES[name]))
    for p in FUSED[name]:
        setattr(module, p, nnx.data(None))


def _fused_product(x, weight):
    """dt[T, C] times a fused weight dt[C, ...] (``fuse_qkv``, ``fuse_gate_up``), accumulated in fp32: dt[T, ...].
    The weight's trailing dims are contiguous, so this is one matrix product of C by their product."""
    return jax.lax.dot_general(x, weight, (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(x.dtype)


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
                             axes=AXES["q_proj"])
        # weight dt[C, K * D] each
        self.k_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias, dtype=dtype, axes=AXES["k_proj"])
        self.v_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias, dtype=dtype, axes=AXES["v_proj"])
        # weight dt[H * D, C]
        self.o_proj = Linear(cfg.num_heads * d, h, bias=cfg.o_bias, dtype=dtype, axes=("q_heads", "embed"))
        self.q_norm = RMSNorm(d, cfg, dtype, ("head_dim",)) if cfg.qk_norm else None  # dt[D]
        self.k_norm = RMSNorm(d, cfg, dtype, ("head_dim",)) if cfg.qk_norm else None  # dt[D]
        # dt[H]: gpt-oss's per-head sink logits (pallas_kernels.ragged_paged_attention.reference)
        self.sinks = param((cfg.num_heads,), dtype, ("q_heads",)) if cfg.attn_sinks else None
        # dt[C, K, G + 2, D]: the Q, K and V weights as one (``fuse_qkv``), in place of the three Linears; per KV
        # head its G query heads, then its key, then its value, so a shard of the KV heads keeps whole groups.
        self.qkv_proj = nnx.data(None)
        self.cfg, self.sliding_window = cfg, cfg.sliding_windows[layer]

    def can_fuse_qkv(self) -> bool:
        """Whether the Q, K and V weights can be one: plain float weights, no biases, no output gate, and the
        query and KV heads split alike over the mesh (whole GQA groups per shard)."""
        if self.qkv_proj is not None or self.cfg.attn_output_gate:
            return False
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if any(p.bias is not None or p.weight_scale is not None for p in projs):
            return False
        specs = {_out_spec(p.weight.get_value()) for p in projs}
        return len(specs) == 1

    def fuse_qkv(self) -> None:
        """Replace the Q, K and V Linears by one dt[C, K, G + 2, D] weight, sharded as they were (``can_fuse_qkv``
        must hold); one product then reads all three."""
        _join_in_place(self, "qkv_proj", self.cfg.num_kv_heads, self.cfg.head_dim)

    def __call__(self, x, rope_table, k_pages, v_pages, md: AttentionMetadata, backend: AttentionBackend,
                 layout: StepLayout | None = None, lora=None):
        """x: dt[R * T, C]; rope_table: (cos, sin) f32[R * T, D] each; k_pages, v_pages: kv[K, num_pages,
        page_size, D]; ``lora``: the layer's adapter slots and the step's rows (``DecoderLayer``). Returns
        (dt[R * T, C], k_pages, v_pages) with this step's K/V written."""
        cfg, t = self.cfg, x.shape[0]
        proj = lambda name: getattr(self, name)(x, _pick(lora, "self_attn", name))  # noqa: E731
        gate = None
        if self.qkv_proj is not None:  # one product: dt[R * T, K, G + 2, D] (adapters need separate weights)
            qkv = _fused_product(x, self.qkv_proj[...])
            group = qkv.shape[2] - 2
            q, k, v = qkv[:, :, :group].reshape(t, -1), qkv[:, :, group], qkv[:, :, group + 1]
        else:
            q, k, v = proj("q_proj"), proj("k_proj"), proj("v_proj")
        if cfg.attn_output_gate:  # dt[R * T, H, 2D] -> q dt[R * T, H, D], gate dt[R * T, H * D]
            q = q.reshape(t, cfg.num_heads, 2 * cfg.head_dim)
            q, gate = q[..., : cfg.head_dim], q[..., cfg.head_dim:].reshape(t, cfg.num_heads * cfg.head_dim)
        q = constrain(q.reshape(t, cfg.num_heads, cfg.head_dim), layout, "tokens", "act_heads",
                       None)  # dt[R * T, H, D]
        k = constrain(k.reshape(t, cfg.num_kv_heads, cfg.head_dim), layout, "tokens", "act_kv_heads",
                       None)  # dt[R * T, K, D]
        v = constrain(v.reshape(t, cfg.num_kv_heads, cfg.head_dim), layout, "tokens", "act_kv_heads",
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
        self.gate_proj = Linear(h, m, bias=b, dtype=dtype, axes=AXES["gate_proj"])  # weight dt[C, I]
        self.up_proj = Linear(h, m, bias=b, dtype=dtype, axes=AXES["up_proj"])  # weight dt[C, I]
        self.down_proj = Linear(m, h, bias=b, dtype=dtype, axes=("mlp", "embed"))  # weight dt[I, C]
        # dt[C, 2, I]: the gate and up weights as one (``fuse_gate_up``), in place of the two Linears; each row of C
        # holds its gate then its up columns, so the product is one matrix [C, 2I] and a shard of I keeps both.
        self.gate_up_proj = nnx.data(None)
        self.act = cfg.hidden_act

    def can_fuse(self) -> bool:
        """Whether the gate and up weights can be one (plain float weights, no biases)."""
        return self.gate_up_proj is None and all(
            p.bias is None and p.weight_scale is None for p in (self.gate_proj, self.up_proj))

    def fuse_gate_up(self) -> None:
        """Replace the gate and up Linears by one dt[C, 2, I] weight on the same devices (sharded over I as they
        were); ``can_fuse`` must hold. One product reads both: on an H200 the seven products of a Llama-8B layer
        took 172 us fused (Q/K/V and gate/up) against 235 us at one row (docs/benchmarks/gpu-kit.md)."""
        _join_in_place(self, "gate_up_proj", 0, 0)

    def __call__(self, x, layout: StepLayout | None = None, lora=None):  # dt[R * T, C] -> dt[R * T, C]
        if self.gate_up_proj is not None:  # adapters are served on unfused weights only
            gate_up = _fused_product(x, self.gate_up_proj[...])  # dt[R * T, 2, I]
            gate, up = gate_up[:, 0], gate_up[:, 1]
        else:
            gate = self.gate_proj(x, _pick(lora, "mlp", "gate_proj"))
            up = self.up_proj(x, _pick(lora, "mlp", "up_proj"))
        hidden = layers.ACTIVATIONS[self.act](gate) * up  # dt[R * T, I]
        return self.down_proj(constrain(hidden, layout, "tokens", "act_mlp"), _pick(lora, "mlp", "down_proj"))


def fuse_projections(model: "DecoderLM") -> int:
    """Make each layer's Q/K/V weights one (``Attention.fuse_qkv``) and each dense MLP's gate and up weights one
    (``MLP.fuse_gate_up``) where they can be; latent attention, linear attention and Mixture-of-Experts blocks keep
    their layouts. Returns how many weights were fused."""
    count = 0
    for layer in model.layers:
        if isinstance(layer.self_attn, Attention) and layer.self_attn.can_fuse_qkv():
            layer.self_attn.fuse_qkv()
            count += 1
        if isinstance(layer.mlp, MLP) and layer.mlp.can_fuse():
            layer.mlp.fuse_gate_up()
            count += 1
    return count


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
    head = head[...]  # dt[C, V], or tied: the embedding dt[V, C] (w8 when quantized)
    head_scale = None if head_scale is None else head_scale[...]  # f32[V] (or f32[C / B, V / B]) when quantized
    # Each tensor shard computes its vocab slice; then the f32[N, V] logits (not the head) are gathered.
    with jax.named_scope("lm_head"):
        product = layers.matmul_f32(x, head, head_scale, transposed=model.lm_head is None)  # f32[N, V]
        logits = layers.soft_cap(constrain(product, layout, "slots", "act_vocab"), cfg.final_soft_cap)  # f32[N, V]
    return constrain(logits, layout, "slots", "logits_vocab"), new_cache  # f32[N, V], per layer the pages
