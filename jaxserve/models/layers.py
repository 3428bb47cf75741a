"""Pure functions the decoder is made of. Arrays in, arrays out; no parameters held here."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in fp32 and cast back before the weight (as transformers does)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def matmul_f32(x: jax.Array, weight: jax.Array) -> jax.Array:
    """``x @ weight`` for 2-D ``x``, accumulated and returned in fp32.

    Asking for the fp32 result is also what makes bf16 fast on CPU: XLA:CPU runs a bf16 x bf16 -> fp32 matmul
    on the bf16 dot-product instructions (~2x fp32's rate here) but a bf16 -> bf16 one several times slower;
    and its one-row bf16 matmul is ~10x slower than a two-row one, so a single 16-bit row is padded to two.
    """
    if x.shape[0] == 1 and x.dtype.itemsize == 2 and jax.default_backend() == "cpu":
        return jnp.dot(jnp.pad(x, ((0, 1), (0, 0))), weight, preferred_element_type=jnp.float32)[:1]
    return jnp.dot(x, weight, preferred_element_type=jnp.float32)


def linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """``x @ weight (+ bias)`` with weight stored [in, out], accumulated in fp32 and returned in x's dtype."""
    y = matmul_f32(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[-1])
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
