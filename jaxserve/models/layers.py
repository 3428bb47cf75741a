"""Pure functions the decoder is made of. Arrays in, arrays out; no parameters held here."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in fp32 and cast back before the weight (as transformers does)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """``x @ weight (+ bias)`` with weight stored [in, out], accumulated in fp32 and returned in x's dtype.

    Asking for the fp32 result is also what makes bf16 fast on CPU: XLA:CPU runs a bf16 x bf16 -> fp32 matmul
    on the bf16 dot-product instructions (~2x fp32's rate here) but a bf16 -> bf16 one several times slower.
    """
    y = jnp.dot(x, weight, preferred_element_type=jnp.float32)
    return (y if bias is None else y + bias).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding in the rotate-half layout Hugging Face checkpoints use.

    Args:
      x: [T, heads, head_dim]
      positions: i32[T]
      inv_freq: f32[head_dim // 2]
    """
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, None, :].astype(x.dtype)
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
