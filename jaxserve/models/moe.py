"""The Mixture-of-Experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss): router, top-k, tokens grouped by expert,
and a grouped matmul (``jax.lax.ragged_dot``) per projection.

One token's MLP output is ``sum_j w_j * expert_{e_j}(x)`` over its ``top_k`` experts ``e_j`` (softmax router
probabilities ``w_j``, renormalised over the chosen ones when ``norm_topk_prob``), plus, for Qwen2-MoE, a shared
dense expert scaled by ``sigmoid(x @ shared_expert_gate)``. gpt-oss (``MoeConfig``'s switches): a router bias,
the softmax over the top-k logits only, expert biases and the clamped gated activation (``activate``); the down
projection's bias is the same for every row of an expert, so its weighted sum is added once, outside the
grouped matmul and the mesh (``SparseMoeBlock``).

How it runs: the ``T * top_k`` (token, expert) pairs are sorted by expert, so each expert's rows are one
contiguous group; each projection is then one ``ragged_dot`` over the groups (a grouped matmul: natively on TPU
and GPU, and through XLA's expansion on CPU), and the rows return to their tokens by the inverse permutation and
a weighted sum over ``top_k``. No token is dropped: there is no capacity limit, so the result does not depend on
what else is in the batch.

Expert parallelism (the ``expert`` mesh axis, ``sharding.rules``): expert weights are split over ``expert``
(whole experts per device) and each expert's hidden width over ``tensor``. The residual stream arrives replicated
over both axes, so dispatch needs no communication: every device sorts the same pairs, takes the contiguous run
of rows that belongs to its own experts, and computes only those. The combine is one ``psum`` over
(``expert``, ``tensor``) of the ``[tokens, hidden]`` partial outputs, the same all-reduce a dense
tensor-parallel MLP ends with (docs/architecture.md, "Expert parallelism", says why not all-to-all).

``dense_reference`` (every expert on every token, weighted by the router) is the test reference, never served.

Shapes are noted ``dtype[dims]``, as in ``pallas_kernels``: ``i32``, ``f32`` are fixed dtypes, ``dt`` is the
model's dtype (bf16, f16 or f32), ``w8`` an 8-bit weight's (``jaxserve.models.quantization``). Dims: T tokens
(rows), C hidden size, E experts, G the experts a shard holds, I an expert's width, ``top_k`` experts per token,
M rows of a grouped matmul, ``in`` / ``out`` a weight's input and output widths, B the edge of a block scale's
blocks; a prime marks one shard's part (T' its rows, I' its slice of the width).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve.models import layers
from jaxserve.models.config import ModelConfig
from jaxserve.models.moe_config import MoeConfig
from sharding.layout import StepLayout

EXPERT_AXES = {  # logical axes of the stacked expert weights dt[E, C, I] (gate, up) and dt[E, I, C] (down)
    "gate_proj": ("experts", "embed", "moe_mlp"),
    "up_proj": ("experts", "embed", "moe_mlp"),
    "down_proj": ("experts", "moe_mlp", "embed"),
}


def route(x: jax.Array, router: jax.Array, moe: MoeConfig, bias: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array]:
    """Each row's top-k experts and their weights.

    Args:
      x: dt[T, C] the MLP input rows.
      router: dt[C, E] the gate's weight (f32 for DeepSeek's).
      bias: the router's bias dt[E] (gpt-oss: added to the logits), or DeepSeek-V3's ``e_score_correction_bias``
        f32[E] (``moe.correction_bias``: added to the scores to choose experts, not to their weights), or None.

    Returns:
      (weights f32[T, top_k], expert ids i32[T, top_k]); highest probability first for the softmax routers.
    """
    if moe.scoring == "softmax" and moe.topk_method == "greedy" and moe.routed_scaling_factor == 1.0:
        logits = layers.matmul_f32(x, router)  # f32[T, E]
        if bias is not None:  # gpt-oss's router bias, dt[E]
            logits = logits + bias.astype(jnp.float32)
        logits = logits.astype(x.dtype)  # dt[T, E]: transformers' router logits are in dt
        if moe.softmax_after_topk:  # gpt-oss: the k highest logits, then a softmax over those alone
            top, experts = jax.lax.top_k(logits.astype(jnp.float32), moe.top_k)  # f32[T, top_k], i32[T, top_k]
            return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # f32[T, E]
        weights, experts = jax.lax.top_k(probs, moe.top_k)  # f32[T, top_k], i32[T, top_k]
        if moe.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)  # f32[T, top_k], summing to 1 per row
        return weights, experts.astype(jnp.int32)  # f32[T, top_k], i32[T, top_k]
    return _route_grouped(x, router, moe, bias)


def _route_grouped(x: jax.Array, router: jax.Array, moe: MoeConfig, bias: jax.Array | None
                   ) -> tuple[jax.Array, jax.Array]:
    """DeepSeek's routers (``MoeConfig``): the scores in f32 from f32 operands, as transformers computes them;
    the choice limited to the best ``topk_group`` groups; the weights scaled by ``routed_scaling_factor``."""
    logits = layers.matmul_f32(x.astype(jnp.float32), router.astype(jnp.float32))  # f32[T, E]
    scores = jax.nn.sigmoid(logits) if moe.scoring == "sigmoid" else jax.nn.softmax(logits, axis=-1)  # f32[T, E]
    choice = scores if bias is None else scores + bias[None, :].astype(jnp.float32)  # f32[T, E]
    if moe.n_group > 1 and moe.topk_method != "greedy":
        t, per_group = x.shape[0], moe.num_experts // moe.n_group
        grouped = choice.reshape(t, moe.n_group, per_group)  # f32[T, groups, E / groups]
        if moe.topk_method == "noaux_tc":  # a group's two best scores summed
            group_scores = jnp.sum(jax.lax.top_k(grouped, min(2, per_group))[0], axis=-1)  # f32[T, groups]
        else:  # group_limited_greedy: a group's best score
            group_scores = jnp.max(grouped, axis=-1)  # f32[T, groups]
        _, best = jax.lax.top_k(group_scores, moe.topk_group)  # i32[T, topk_group]
        keep = jnp.zeros((t, moe.n_group), bool).at[jnp.arange(t)[:, None], best].set(True)  # bool[T, groups]
        choice = jnp.where(jnp.repeat(keep, per_group, axis=1), choice, -jnp.inf)  # f32[T, E]
    _, experts = jax.lax.top_k(choice, moe.top_k)  # i32[T, top_k]
    weights = jnp.take_along_axis(scores, experts, axis=-1)  # f32[T, top_k]
    if moe.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)  # f32[T, top_k]
    return weights * moe.routed_scaling_factor, experts.astype(jnp.int32)  # f32[T, top_k], i32[T, top_k]


def group_by_expert(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Sort the ``T * top_k`` (token, expert) pairs by expert.

    Args:
      experts: i32[T, top_k]

    Returns:
      (order i32[T * top_k]: pair indices sorted by expert (stable, so ties keep token order; pair ``p`` is
      token ``p // top_k``), group_sizes i32[E]: rows per expert).
    """
    flat = experts.reshape(-1)  # i32[T * top_k]: pair p's expert
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # i32[T * top_k]
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)  # i32[E]
    return order, sizes


def activate(gate: jax.Array, up: jax.Array, moe: MoeConfig | None = None) -> jax.Array:
    """The gated activation of f32[M, I] gate and up projections: SwiGLU ``silu(gate) * up``, or gpt-oss's
    clamped variant (``MoeConfig``). Returns f32[M, I]."""
    if moe is None or moe.activation == "silu":
        return jax.nn.silu(gate) * up
    gate = jnp.minimum(gate, moe.swiglu_limit)
    up = jnp.clip(up, -moe.swiglu_limit, moe.swiglu_limit)
    return (up + 1.0) * gate * jax.nn.sigmoid(gate * moe.swiglu_alpha)


def grouped_swiglu(rows: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                   group_sizes: jax.Array, moe: MoeConfig | None = None,
                   biases: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """``down(act(gate(x), up(x)))`` of consecutive row groups, group ``g`` through expert ``g`` (``activate``).

    Args:
      rows: dt[M, C] sorted by expert; rows past ``sum(group_sizes)`` give zeros.
      gate, up: dt[G, C, I];  down: dt[G, I, C]
      group_sizes: i32[G]
      moe: the activation's switches (None: SwiGLU).
      biases: (gate bias, up bias), each f32[M, I]: row by row, already zero past ``sum(group_sizes)``; or None.

    Returns:
      f32[M, C] (without the down projection's bias)
    """
    # 16-bit operands gain nothing from a higher precision, and Mosaic's TPU grouped matmul refuses one for them
    # (a process-wide jax_default_matmul_precision="highest" would otherwise reach it).
    precision = jax.lax.Precision.DEFAULT if rows.dtype.itemsize == 2 else None
    # dt[M, in] @ dt[G, in, out] (row group g through matrix g) -> f32[M, out]
    mm = lambda a, w: jax.lax.ragged_dot(a, w, group_sizes, precision=precision,  # noqa: E731
                                         preferred_element_type=jnp.float32)
    g, u = mm(rows, gate), mm(rows, up)  # f32[M, I] each
    if biases is not None:
        g, u = g + biases[0], u + biases[1]
    # Rows past the groups stay 0 through the activation (act(0, 0) = 0 for both), so they still give zeros.
    hidden = activate(g, u, moe).astype(rows.dtype)  # dt[M, I]
    return mm(hidden, down)  # f32[M, C]


def experts_local(x: jax.Array, weights: jax.Array, experts: jax.Array, gate: jax.Array, up: jax.Array,
                  down: jax.Array, first_expert: jax.Array | int, num_experts: int, moe: MoeConfig | None = None,
                  biases: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """The weighted sum over each row's chosen experts, counting only experts ``first_expert ..
    first_expert + G - 1`` (the ``G`` whose weights are given); the rest contribute 0.

    With all experts given (``first_expert`` 0) this is the whole MoE output; on an ``expert`` shard it is that
    shard's part, and the parts sum to the whole.

    Args:
      x: dt[T, C];  weights: f32[T, top_k];  experts: i32[T, top_k]
      gate, up: dt[G, C, I];  down: dt[G, I, C]
      moe: the activation's switches (None: SwiGLU);  biases: (gate, up) dt[G, I] each, or None.

    Returns:
      f32[T, C]
    """
    t, k = experts.shape
    order, all_sizes = group_by_expert(experts, num_experts)  # i32[T * top_k], i32[E]
    sizes = jax.lax.dynamic_slice_in_dim(all_sizes, first_expert, gate.shape[0])  # i32[G]
    start = jnp.sum(jnp.where(jnp.arange(num_experts) < first_expert, all_sizes, 0))  # i32[]
    # This shard's experts own sorted rows start .. start + sum(sizes) - 1: rotate them to the front.
    mine = jnp.roll(order, -start)  # i32[T * top_k]
    row_biases = None
    if biases is not None:  # each sorted row's own expert's biases; rows past the local ones get 0
        local = jnp.arange(t * k) < jnp.sum(sizes)  # bool[T * top_k]
        which = jnp.clip(experts.reshape(-1)[mine] - first_expert, 0, gate.shape[0] - 1)  # i32[T * top_k]
        row_biases = tuple(jnp.where(local[:, None], b[which].astype(jnp.float32), 0.0) for b in biases)
    # f32[T * top_k, C], zero past the local rows
    out = grouped_swiglu(x[mine // k], gate, up, down, sizes, moe, row_biases)
    pair_out = jnp.zeros_like(out).at[mine].set(out)  # f32[T * top_k, C]: back to pair order (token-major)
    return jnp.einsum("tkh,tk->th", pair_out.reshape(t, k, -1), weights)  # f32[T, C]


def dense_reference(x: jax.Array, router: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                    moe: MoeConfig, bias: jax.Array | None = None) -> jax.Array:
    """Every expert on every row, weighted by the router (zero for experts not chosen): the test reference for
    the routed MoE (shared expert excluded): x dt[T, C], router dt[C, E], gate and up dt[E, C, I], down
    dt[E, I, C]. Returns f32[T, C]."""
    weights, experts = route(x, router, moe, bias)  # f32[T, top_k], i32[T, top_k]
    dense = jnp.zeros((x.shape[0], moe.num_experts), jnp.float32)  # f32[T, E]
    dense = dense.at[jnp.arange(x.shape[0])[:, None], experts].set(weights)  # f32[T, E], zero where not chosen
    hi = jax.lax.Precision.HIGHEST
    # dt[E, T, I]
    h = jax.nn.silu(jnp.einsum("th,ehi->eti", x, gate, precision=hi)) * jnp.einsum("th,ehi->eti", x, up, precision=hi)
    return jnp.einsum("eti,eih,te->th", h, down, dense, precision=hi)  # f32[T, C]


def _param(shape, dtype, axes) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)  # dtype[*shape]


class Weight(nnx.Module):
    """One dt[in, out] matrix (the router dt[C, E], the shared expert's gate dt[C, 1]), named ``weight`` as in
    the checkpoint; with ``bias`` its dt[out] bias (gpt-oss's router); DeepSeek-V3's router also holds its
    ``e_score_correction_bias`` f32[E]."""

    def __init__(self, din: int, dout: int, dtype, bias: bool = False, correction_bias: bool = False):
        self.weight = _param((din, dout), dtype, ("embed", None))  # dt[in, out]
        self.bias = _param((dout,), dtype, (None,)) if bias else None  # dt[out]
        self.e_score_correction_bias = _param((dout,), jnp.float32, (None,)) if correction_bias else None  # f32[E]


class Experts(nnx.Module):
    """The routed experts' SwiGLU weights, stacked: gate/up dt[E, C, I], down dt[E, I, C] (w8 when quantized)."""

    def __init__(self, moe: MoeConfig, hidden: int, dtype):
        e, i = moe.num_experts, moe.intermediate_size
        shapes = {"gate_proj": (e, hidden, i), "up_proj": (e, hidden, i), "down_proj": (e, i, hidden)}
        for name, shape in shapes.items():
            setattr(self, name, _param(shape, dtype, EXPERT_AXES[name]))  # dt[E, C, I] or dt[E, I, C]
            # Set when quantized (jaxserve.models.quantization): f32[E, out], or f32[E, in / B, out / B]
            setattr(self, name + "_scale", nnx.data(None))
            # gpt-oss: dt[E, out], each expert's bias (never quantized)
            axes = (EXPERT_AXES[name][0], EXPERT_AXES[name][2])
            setattr(self, name + "_bias", _param((e, shape[2]), dtype, axes) if moe.expert_bias else None)

    def weight(self, name: str, dtype) -> jax.Array:
        """A stacked weight in ``dtype`` (dequantized from its 8-bit values when quantized)."""
        scale = getattr(self, name + "_scale")
        w = getattr(self, name)[...]  # dt[E, in, out] (w8 when quantized)
        return w if scale is None else layers.dequantize(w, scale[...], dtype)  # dtype[E, in, out]


class SparseMoeBlock(nnx.Module):
    """Router (``gate``), routed ``experts`` and, for Qwen2-MoE, a gated ``shared_expert`` (any MLP module
    with the decoder's ``(x, layout)`` call, built by the decoder so the dense MLP is not duplicated here)."""

    def __init__(self, cfg: ModelConfig, dtype, shared_expert: nnx.Module | None = None):
        moe, h = cfg.moe, cfg.hidden_size
        self.moe = moe
        self.gate = Weight(h, moe.num_experts, dtype, bias=moe.router_bias, correction_bias=moe.correction_bias)
        self.experts = Experts(moe, h, dtype)
        self.shared_expert = shared_expert
        self.shared_expert_gate = None if shared_expert is None or not moe.shared_expert_gated else Weight(h, 1, dtype)

    def __call__(self, x: jax.Array, layout: StepLayout | None = None) -> jax.Array:
        """x: dt[T, C] -> dt[T, C]."""
        bias = self.gate.bias if self.gate.bias is not None else self.gate.e_score_correction_bias
        # f32[T, top_k], i32[T, top_k]
        weights, experts = route(x, self.gate.weight[...], self.moe, None if bias is None else bias[...])
        ex = self.experts
        biases = None if ex.gate_proj_bias is None else (ex.gate_proj_bias[...], ex.up_proj_bias[...])
        out = expert_parallel(x, weights, experts, ex.weight("gate_proj", x.dtype), ex.weight("up_proj", x.dtype),
                              ex.weight("down_proj", x.dtype), self.moe.num_experts, layout, self.moe,
                              biases)  # f32[T, C]
        if ex.down_proj_bias is not None:  # sum_k w_k b_{e_k}: f32[T, top_k] . dt[T, top_k, C] -> f32[T, C]
            out = out + jnp.einsum("tk,tkc->tc", weights, ex.down_proj_bias[...][experts].astype(jnp.float32))
        if self.shared_expert is not None and self.shared_expert_gate is None:  # DeepSeek: added as is
            out = out.astype(x.dtype) + self.shared_expert(x, layout)  # dt[T, C]
        elif self.shared_expert is not None:
            # dt[T, 1]
            gate = jax.nn.sigmoid(layers.matmul_f32(x, self.shared_expert_gate.weight[...]).astype(x.dtype))
            out = out.astype(x.dtype) + gate * self.shared_expert(x, layout)  # dt[T, C]
        return out.astype(x.dtype)  # dt[T, C]


def expert_parallel(x, weights, experts, gate, up, down, num_experts: int, layout: StepLayout | None,
                    moe: MoeConfig | None = None, biases: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """``experts_local`` over the mesh: one ``shard_map`` in which each device runs its own experts (and its
    slice of their hidden width) on every row of its data/sequence shard, then one ``psum`` over the axes the
    weights are split on. Without a mesh (or on one device) it is ``experts_local`` over all experts.

    x dt[T, C], weights f32[T, top_k], experts i32[T, top_k], gate and up dt[E, C, I], down dt[E, I, C] (a device
    holds G of the experts, and its slice I' of their width); ``moe`` the activation's switches; ``biases`` (gate,
    up) dt[E, I] each (split as the weights' columns), or None. Returns f32[T, C]."""
    if layout is None or layout.mesh.size == 1:
        return experts_local(x, weights, experts, gate, up, down, 0, num_experts, moe, biases)  # f32[T, C]
    rows = layout.spec(("tokens",), x.shape[:1])[0]
    w_specs = [layout.spec(EXPERT_AXES[n], w.shape) for n, w in
               (("gate_proj", gate), ("up_proj", up), ("down_proj", down))]
    split = tuple(a for a in ("expert", "tensor") if any(a in _axes(s) for s in w_specs))
    expert_split = "expert" in _axes(w_specs[0])

    def local(x, weights, experts, gate, up, down, *biases):  # x dt[T', C], ..., gate dt[G, C, I'], ...
        first = jax.lax.axis_index("expert") * gate.shape[0] if expert_split else 0
        # f32[T', C]: this part
        out = experts_local(x, weights, experts, gate, up, down, first, num_experts, moe, tuple(biases) or None)
        return jax.lax.psum(out, split) if split else out  # f32[T', C]: the parts summed

    row_spec = P(rows, None)
    b_specs = () if biases is None else tuple(P(s[0], s[2]) for s in w_specs[:2])  # (experts, moe_mlp) as the weights
    return jax.shard_map(local, mesh=layout.mesh, in_specs=(row_spec, row_spec, row_spec, *w_specs, *b_specs),
                         out_specs=row_spec, check_vma=False)(x, weights, experts, gate, up, down,
                                                              *(biases or ()))  # f32[T, C]


def _axes(spec: P) -> set[str]:
    out: set[str] = set()
    for entry in spec:
        if entry is not None:
            out.update((entry,) if isinstance(entry, str) else entry)
    return out
