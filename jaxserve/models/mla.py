"""Multi-head latent attention (DeepSeek-V2/V3) over a latent page pool, in the absorbed form.

Each token caches only its latent ``c`` (``kv_lora_rank`` values, after ``kv_a_layernorm``) and its rotary key
``k_r`` (``qk_rope_head_dim``, shared by every head): one cache "head" of ``latent_dim`` values per token and layer
(576 for V3's shapes, against 2 x 128 heads x 192 expanded). Head ``h``'s no-rotary key is ``W_UK[h] c`` and its
value ``W_UV[h] c`` (``kv_b_proj`` split per head), so

    q_h . k_h = (W_UK[h]^T q_nope_h) . c + q_rope_h . k_r      and      sum_j p_j W_UV[h] c_j = W_UV[h] sum_j p_j c_j

The up-projections fold into the query (``W_UK``) and output (``W_UV``) sides: attention is then multi-query
attention with one shared KV head whose key is ``[c ‖ k_r]`` and whose value is the same entry's ``c`` prefix.
The pool holds that key once; the value pool is a placeholder of one value per page (``AttentionBackend``
reads the value as the key's entry, ``attention.is_latent``), and the first ``kv_lora_rank`` columns of the
output are the attended latent. Every step (prefill and decode) runs this form, so each page of the latent is
read once per query token for all heads.

With tensor parallelism the query heads (and ``q_b_proj``, ``kv_b_proj``, ``o_proj`` by head) are split; the
latent, shared by all heads, is replicated on every tensor shard (``kv_cache.py``: ``cache_heads(1, tensor)``).

Shapes as in ``decoder.py``; here H query heads, L ``kv_lora_rank``, Dn ``qk_nope_head_dim``, Dr
``qk_rope_head_dim``, Dv ``v_head_dim``, Q ``q_lora_rank``, D = L + Dr the latent entry's width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models import layers
from jaxserve.models.attention import AttentionBackend, AttentionMetadata
from jaxserve.models.config import ModelConfig
from jaxserve.models.modules import Linear, RMSNorm, constrain
from sharding.layout import StepLayout

# transformers' DeepSeek q_a_layernorm and kv_a_layernorm keep their default eps, not the config's rms_norm_eps
LORA_NORM_EPS = 1e-6


def deinterleave(x: jax.Array) -> jax.Array:
    """The rotary pairs (x0, x1), (x2, x3), ... laid out as the rotate-half layout expects: evens, then odds.
    dt[..., Dr] -> dt[..., Dr]. Applied to queries and keys alike, so their dot products are unchanged."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class MlaAttention(nnx.Module):
    """The checkpoint's projections (names as in transformers), and the absorbed attention over latent pages."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype):

        m, c, h = cfg.mla, cfg.hidden_size, cfg.num_heads
        bias = m.attention_bias
        if m.q_lora_rank:
            self.q_a_proj = Linear(c, m.q_lora_rank, bias=bias, dtype=dtype, axes=("embed", None))  # weight dt[C, Q]
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, cfg, dtype, (None,))  # dt[Q]
            self.q_a_layernorm.eps = LORA_NORM_EPS
            # weight dt[Q, H * (Dn + Dr)]
            self.q_b_proj = Linear(m.q_lora_rank, h * m.qk_head_dim, bias=False, dtype=dtype, axes=(None, "q_heads"))
            self.q_proj = None
        else:
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
            # weight dt[C, H * (Dn + Dr)]
            self.q_proj = Linear(c, h * m.qk_head_dim, bias=False, dtype=dtype, axes=("embed", "q_heads"))
        # weight dt[C, L + Dr]
        self.kv_a_proj_with_mqa = Linear(c, m.latent_dim, bias=bias, dtype=dtype, axes=("embed", None))
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, cfg, dtype, (None,))  # dt[L]
        self.kv_a_layernorm.eps = LORA_NORM_EPS
        # weight dt[L, H * (Dn + Dv)]
        self.kv_b_proj = Linear(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), bias=False, dtype=dtype,
                                axes=(None, "q_heads"))
        self.o_proj = Linear(h * m.v_head_dim, c, bias=bias, dtype=dtype, axes=("q_heads", "embed"))  # dt[H*Dv, C]
        self.cfg = cfg

    def _kv_b(self, dtype) -> jax.Array:
        """``kv_b_proj``'s weight dt[L, H, Dn + Dv] (dequantized when 8-bit)."""
        p, m = self.kv_b_proj, self.cfg.mla
        w = p.weight[...]
        if p.weight_scale is not None:
            w = layers.dequantize(w, p.weight_scale[...], dtype)
        return w.reshape(m.kv_lora_rank, self.cfg.num_heads, m.qk_nope_head_dim + m.v_head_dim)

    def __call__(self, x, rope_table, k_pages, v_pages, md: AttentionMetadata, backend: AttentionBackend,
                 layout: StepLayout | None = None, lora=None):
        """x: dt[R * T, C]; rope_table: (cos, sin) f32[R * T, Dr] each; k_pages: kv[1, num_pages, page_size, D]
        (the latent pool), v_pages: kv[1, num_pages, 1, 1] (its placeholder). Returns (dt[R * T, C], k_pages, v_pages)
        with this step's latents written. ``lora`` must be None (no adapters on latent attention)."""

        if lora is not None:
            raise ValueError("LoRA adapters are not supported on multi-head latent attention")
        cfg, m, t = self.cfg, self.cfg.mla, x.shape[0]
        h, nope, lat = cfg.num_heads, m.qk_nope_head_dim, m.kv_lora_rank
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = constrain(q.reshape(t, h, m.qk_head_dim), layout, "tokens", "act_heads", None)  # dt[R * T, H, Dn + Dr]
        q_nope, q_rope = q[..., :nope], q[..., nope:]  # dt[R * T, H, Dn], dt[R * T, H, Dr]
        ckv = self.kv_a_proj_with_mqa(x)  # dt[R * T, L + Dr]
        latent = self.kv_a_layernorm(ckv[:, :lat])  # dt[R * T, L]
        k_rope = ckv[:, None, lat:]  # dt[R * T, 1, Dr]
        if m.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = layers.rope(q_rope, *rope_table), layers.rope(k_rope, *rope_table)
        w = self._kv_b(x.dtype)  # dt[L, H, Dn + Dv]
        w_uk, w_uv = w[..., :nope], w[..., nope:]  # dt[L, H, Dn], dt[L, H, Dv]
        # The no-rotary query in latent space: dt[R * T, H, L]
        q_lat = jnp.einsum("thn,lhn->thl", q_nope, w_uk, preferred_element_type=jnp.float32).astype(x.dtype)
        q_lat = constrain(q_lat, layout, "tokens", "act_heads", None)
        q_full = jnp.concatenate([q_lat, q_rope], axis=-1)  # dt[R * T, H, D]
        k_full = jnp.concatenate([latent[:, None, :], k_rope], axis=-1)  # dt[R * T, 1, D]
        out, k_pages, v_pages = backend(  # out: dt[R * T, H, D], its first L columns the attended latent
            q_full, k_full, k_full, k_pages, v_pages, md, sm_scale=cfg.sm_scale, sliding_window=None)
        # dt[R * T, H, Dv]
        out = jnp.einsum("thl,lhv->thv", out[..., :lat], w_uv, preferred_element_type=jnp.float32).astype(x.dtype)
        out = constrain(out, layout, "tokens", "act_heads", None)
        return self.o_proj(out.reshape(t, h * m.v_head_dim)), k_pages, v_pages  # dt[R * T, C], ...
