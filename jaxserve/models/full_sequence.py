"""The decoder over whole sequences with plain causal attention and no KV cache: differentiable, for a JAX
training loop that trains the weights an engine serves (``LLM.get_weights`` / ``LLM.update_weights``).

The same layers as serving (``jaxserve.models.decoder``), with an attention that ignores the page arguments and
attends over the sequence itself, so the logits equal the engine's prompt logits up to float rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models import layers
from jaxserve.models.decoder import DecoderLM


def _causal_attention(q, k, v, k_pages, v_pages, md, *, sm_scale: float, sliding_window: int | None,
                      soft_cap: float | None, sinks: jax.Array | None = None):
    """q: dt[T, H, D]; k, v: dt[T, K, D] of one sequence. Returns (dt[T, H, D], k_pages, v_pages untouched)."""
    t, h, d = q.shape
    groups = h // k.shape[1]
    k, v = jnp.repeat(k, groups, axis=1), jnp.repeat(v, groups, axis=1)  # dt[T, H, D]
    scores = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32)) * sm_scale  # f32[H, T, T]
    scores = layers.soft_cap(scores, soft_cap)
    pos = jnp.arange(t)
    allowed = pos[None, :] <= pos[:, None]  # bool[T, T]  (query, key)
    if sliding_window is not None:
        allowed &= pos[:, None] - pos[None, :] < sliding_window
    scores = jnp.where(allowed[None], scores, -jnp.inf)
    if sinks is not None:  # f32[H]: one more logit per head, in the denominator only
        sink = jnp.broadcast_to(sinks[:, None, None], (h, t, 1))  # f32[H, T, 1]
        weights = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]  # f32[H, T, T]
    else:
        weights = jax.nn.softmax(scores, axis=-1)  # f32[H, T, T]
    out = jnp.einsum("hqk,khd->qhd", weights, v.astype(jnp.float32))  # f32[T, H, D]
    return out.astype(q.dtype), k_pages, v_pages


def sequence_logits(graphdef: nnx.GraphDef, params, token_ids: jax.Array) -> jax.Array:
    """Logits of every position of every sequence: f32[B, T, V] for ``token_ids`` i32[B, T].

    ``graphdef`` and ``params``: the model's structure and weights (``LLM.graphdef``, ``LLM.get_weights``: a
    nested dict of arrays, or an ``nnx.State``). Differentiable in ``params``.
    """
    model: DecoderLM = nnx.merge(graphdef, params)
    return jax.vmap(lambda ids: _one(model, ids))(token_ids)


def _one(model: DecoderLM, token_ids: jax.Array) -> jax.Array:
    """f32[T, V] of one sequence i32[T]."""
    cfg = model.cfg
    positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
    tables = {}
    for i in range(cfg.num_layers):
        rope = cfg.layer_rope(i)
        if rope not in tables:
            tables[rope] = layers.rope_tables(positions, rope, cfg.rope_dim)
    x = model.embed_tokens(token_ids)
    for i, layer in enumerate(model.layers):
        x, _, _ = layer(x, tables[cfg.layer_rope(i)], None, None, None, _causal_attention)
    x = model.norm(x)
    if model.lm_head is None:
        head, scale = model.embed_tokens.embedding[...].T, getattr(model.embed_tokens, "embedding_scale", None)
    else:
        head, scale = model.lm_head.weight[...], model.lm_head.weight_scale
    logits = layers.matmul_f32(x, head, None if scale is None else scale[...])
    return layers.soft_cap(logits, cfg.final_soft_cap)


def token_logprobs(graphdef: nnx.GraphDef, params, token_ids: jax.Array) -> jax.Array:
    """f32[B, T - 1]: the log-probability of each token ``token_ids[:, 1:]`` given the tokens before it."""
    logp = jax.nn.log_softmax(sequence_logits(graphdef, params, token_ids[:, :-1]), axis=-1)
    return jnp.take_along_axis(logp, token_ids[:, 1:, None], axis=-1)[..., 0]
