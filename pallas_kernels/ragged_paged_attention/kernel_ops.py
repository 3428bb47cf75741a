"""Small in-kernel helpers shared by the TPU and GPU kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def div_by(x: jax.Array, d: int) -> jax.Array:
    """x // d for non-negative ints (scalars or vectors) without jnp's floor-division sign fix-ups."""
    if d & (d - 1) == 0:
        return lax.shift_right_logical(x, jnp.int32(d.bit_length() - 1))
    return lax.div(x, jnp.int32(d))


def rem_by(x: jax.Array, d: int) -> jax.Array:
    """x % d for non-negative ints."""
    if d & (d - 1) == 0:
        return x & jnp.int32(d - 1)
    return lax.rem(x, jnp.int32(d))


def matmul(a: jax.Array, b: jax.Array, *, transpose_b: bool = False) -> jax.Array:
    """a @ b (or a @ b.T) accumulated in fp32.

    16-bit operands always take the native MXU / tensor-core path: Mosaic rejects a bf16 matmul asked for at
    HIGHEST precision, which ``jax_default_matmul_precision="highest"`` would otherwise request. fp32 operands
    follow the global default, as XLA's own matmuls do (TF32 on GPU and a reduced-precision MXU path on TPU by
    default, exact fp32 under "highest").
    """
    precision = None if a.dtype == jnp.float32 else (lax.Precision.DEFAULT, lax.Precision.DEFAULT)
    contract = ((1,), (1,)) if transpose_b else ((1,), (0,))
    return lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32)
