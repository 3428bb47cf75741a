"""Pure functions the decoder is made of. Arrays in, arrays out; no parameters held here.

Shapes are noted ``dtype[dims]``, as in ``pallas_kernels``: ``f32``, ``i32``, ``i8`` are fixed dtypes, ``dt`` is
the model's dtype (bf16, f16 or f32), ``w8`` an 8-bit weight's (int8 or float8_e4m3fn), ``...`` any leading dims.
Dims: T tokens (the rows of a step), H query heads, K KV heads, D head_dim, C hidden size, M rows of a matmul,
``in`` / ``out`` a weight's input and output widths, B the edge of a block scale's blocks.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.rope import RopeConfig
from pallas_kernels.matmul import native as native_dense


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm over the last axis, computed in fp32, rounded as transformers does.

    With ``offset`` 0 (Llama, Qwen, Mistral) the normalised value is cast back before the weight multiplies
    it; with an offset (Gemma's ``1 + w``) the scaling is done in fp32 too and the product cast back.
    """
    xf = x.astype(jnp.float32)  # f32[..., C]
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)  # f32[..., C], unit RMS per row
    if offset:
        return (xf * (offset + weight.astype(jnp.float32))).astype(x.dtype)  # dt[..., C]
    return weight * xf.astype(x.dtype)  # dt[..., C]


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(x / cap)`` (Gemma 2's logit soft-capping); ``x`` itself when ``cap`` is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)  # x's dtype and shape


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def dequantize(weight: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """An 8-bit ``weight`` w8[..., in, out] times its ``scale`` (f32[..., out] per channel, or f32[in / B, out / B]
    per block; ``jaxserve.models.quantization``), in ``dtype``."""
    if scale.ndim == weight.ndim - 1:  # per channel: scale f32[..., out]
        return (weight.astype(jnp.float32) * scale[..., None, :]).astype(dtype)  # dtype[..., in, out]
    bi, bo = -(-weight.shape[-2] // scale.shape[-2]), -(-weight.shape[-1] // scale.shape[-1])  # block edges
    # f32[..., in, out]: each block's scale repeated over its block
    full = jnp.repeat(jnp.repeat(scale, bi, axis=-2)[..., : weight.shape[-2], :], bo, axis=-1)[..., : weight.shape[-1]]
    return (weight.astype(jnp.float32) * full).astype(dtype)  # dtype[..., in, out]


_native_products = contextvars.ContextVar("jaxserve_native_products", default=False)


@contextlib.contextmanager
def native_products(on: bool):
    """While tracing inside it (``on``), ``matmul_f32``'s unquantized products run the native CPU kernel
    (``pallas_kernels.matmul``) in programs lowered for a CPU. The decoder turns it on for a step on one device:
    XLA's partitioner cannot split a custom call over a mesh."""
    token = _native_products.set(on)
    try:
        yield
    finally:
        _native_products.reset(token)


def matmul_f32(x: jax.Array, weight: jax.Array, scale: jax.Array | None = None, *,
               transposed: bool = False) -> jax.Array:
    """``x @ weight`` for 2-D ``x`` (dt[M, in] @ dt[in, out] or w8[in, out]), accumulated and returned in fp32:
    f32[M, out]; ``transposed``: the weight is dt[out, in] (a tied LM head's embedding) and the product
    ``x @ weight.T``.

    Within ``native_products(True)`` an unquantized product lowered for a CPU runs the native kernel, which
    takes a transposed bf16 weight as it is (a transposed f32 one stays with XLA, as fast there).

    With a ``scale`` the weight is 8-bit (``jaxserve.models.quantization``): a per-channel scale multiplies the
    product's columns (the 8-bit values are converted to x's dtype, exactly, inside the dot); a block scale
    dequantizes the weight first.

    Asking for the fp32 result is also what makes bf16 fast on a CPU with bf16 dot-product instructions
    (AVX-512 bf16): XLA:CPU runs a bf16 x bf16 -> fp32 matmul on them (~2x fp32's rate on such a host) but a
    bf16 -> bf16 one several times slower; and its one-row bf16 matmul is ~10x slower than a two-row one, so a
    single 16-bit row is padded to two. On an AVX2-only CPU no XLA option makes bf16 faster than fp32
    (docs/benchmarks/cpu-offline.md, "Quiet machine, weights as the engine holds them").
    """
    if transposed and (scale is not None or weight.dtype == jnp.float32 or not _native_products.get()):
        # XLA's product with a transposed f32 weight is level with the kernel's or faster; with a bf16 one
        # the kernel is 2.5x faster (docs/benchmarks/cpu-offline.md, "The products alone")
        with native_products(False):
            return matmul_f32(x, weight.T, scale)
    if scale is not None:
        if scale.ndim == weight.ndim:  # block scales f32[in / B, out / B]
            return matmul_f32(x, dequantize(weight, scale, x.dtype))  # f32[M, out]
        return quantized_matmul(x, weight, scale)  # f32[M, out]
    if _native_products.get() and native_dense.usable(x, weight):
        return native_dense.dense(x, weight, transposed=transposed)  # f32[M, out]
    if x.shape[0] == 1 and x.dtype.itemsize == 2 and jax.default_backend() == "cpu":
        # x padded to dt[2, in]; the product's first row: f32[1, out]
        return jnp.dot(jnp.pad(x, ((0, 1), (0, 0))), weight, preferred_element_type=jnp.float32)[:1]
    return jnp.dot(x, weight, preferred_element_type=jnp.float32)  # f32[M, out]


def quantized_matmul(x: jax.Array, weight: jax.Array, scale: jax.Array) -> jax.Array:
    """``x @ (weight * scale)`` for an 8-bit ``weight`` w8[in, out] with one scale f32[out] per output channel, in
    fp32: f32[M, out].

    On CPU an int8 weight meets int8 rows: XLA:CPU does not fuse a weight's int8 -> float conversion into the dot
    (it writes the whole converted matrix, then reads it: more bytes than the 16-bit weight alone), while an
    int8 x int8 -> int32 dot runs in one library call on the CPU's integer dot instructions. Each row of ``x``
    is quantized on the fly, in two int8 terms (``int8_rows_matmul``).
    """
    if weight.dtype == jnp.int8 and jax.default_backend() == "cpu":
        return int8_rows_matmul(x, weight) * scale  # f32[M, out] * f32[out]
    return matmul_f32(x, weight.astype(x.dtype)) * scale  # f32[M, out] * f32[out]


def int8_rows_matmul(x: jax.Array, weight: jax.Array) -> jax.Array:
    """``x @ weight`` (dt[M, in] @ i8[in, out]) as one int8 x int8 -> int32 dot; f32[M, out] result.

    Each row of ``x`` is written as two int8 rows: ``q1 = round(x / a1)`` with ``a1 = max |x| / 127``, and the
    rounding residual ``q2 = round((x - a1 q1) / a2)`` with its own ``a2``, so ``x`` is carried to about
    14 bits (finer than bf16's 8-bit mantissa) and the weight-only quantization error is all that remains.
    Both rows go through the same dot (``[2M, in] @ [in, out]``): the weight is read once, and a single row
    becomes the two rows XLA:CPU's int8 dot library needs (a one-row int8 dot is compiled to a generic loop over
    an int32 copy of the weight).
    """

    def split(v):  # v: f32[M, in]
        scale = jnp.max(jnp.abs(v), axis=-1, keepdims=True) / 127.0  # f32[M, 1]
        scale = jnp.where(scale > 0, scale, 1.0)  # f32[M, 1]
        q = jnp.clip(jnp.round(v / scale), -127, 127)  # f32[M, in], integer values in [-127, 127]
        return q, scale

    xf = x.astype(jnp.float32)  # f32[M, in]
    q1, a1 = split(xf)  # f32[M, in], f32[M, 1]
    q2, a2 = split(xf - q1 * a1)  # f32[M, in], f32[M, 1]: the rounding residual
    m = x.shape[0]
    # i8[2M, in] @ i8[in, out] -> i32[2M, out]
    acc = jax.lax.dot(jnp.concatenate([q1, q2]).astype(jnp.int8), weight, preferred_element_type=jnp.int32)
    acc = acc.astype(jnp.float32)  # f32[2M, out]
    return acc[:m] * a1 + acc[m:] * a2  # f32[M, out]


def linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None,
           scale: jax.Array | None = None) -> jax.Array:
    """``x @ weight (+ bias)``: dt[..., in] @ dt[in, out] (+ dt[out]), accumulated in fp32, returned in x's dtype:
    dt[..., out] (an 8-bit weight w8[in, out] with its ``scale``: see ``matmul_f32``)."""
    y = matmul_f32(x.reshape(-1, x.shape[-1]), weight, scale).reshape(*x.shape[:-1], weight.shape[-1])  # f32[..., out]
    return (y if bias is None else y + bias).astype(x.dtype)  # dt[..., out]


def rope_tables(positions: jax.Array, rope: RopeConfig, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """cos and sin of every row's rotation, times the rope's attention factor (yarn, longrope).

    Args:
      positions: i32[T]
    Returns:
      (cos, sin), each f32[T, D] in the rotate-half layout (the frequencies repeated twice).
    """
    pos = positions.astype(jnp.float32)  # f32[T]
    if rope.kind == "dynamic":  # the base grows with the sequence a row ends (see jaxserve.models.rope)
        mpe = float(rope.max_position_embeddings)
        seq = jnp.maximum(pos + 1.0, mpe)  # f32[T]
        base = rope.theta * ((rope.factor * seq / mpe) - (rope.factor - 1)) ** (head_dim / (head_dim - 2))  # f32[T]
        exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim  # f32[D/2]
        inv = 1.0 / base[:, None] ** exponents[None, :]  # f32[T, D/2]
    elif rope.kind == "longrope":  # long factors for rows past the original context
        short, long = jnp.asarray(rope.inv_freq(head_dim)), jnp.asarray(rope.long_inv_freq(head_dim))  # f32[D/2] each
        # f32[T, D/2]
        inv = jnp.where((pos + 1.0 > rope.original_max_position_embeddings)[:, None], long[None], short[None])
    else:
        inv = jnp.asarray(np.asarray(rope.inv_freq(head_dim), np.float32))[None, :]  # f32[1, D/2]
    angles = pos[:, None] * inv  # f32[T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # f32[T, D]
    return jnp.cos(angles) * rope.attention_factor, jnp.sin(angles) * rope.attention_factor  # f32[T, D] each


def rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding in the rotate-half layout Hugging Face checkpoints use.

    Args:
      x: dt[T, H or K, D]
      cos, sin: f32[T, D] from ``rope_tables`` (cast to x's dtype first, as transformers does)
    Returns:
      dt[T, H or K, D]
    """
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)  # dt[T, 1, D] each
    if cos.shape[-1] < x.shape[-1]:  # partial rotary (Qwen3-Next): only the first channels rotate
        d = cos.shape[-1]
        return jnp.concatenate([rope(x[..., :d], cos[:, 0], sin[:, 0]), x[..., d:]], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # dt[T, H or K, D]
    return x * cos + rotated * sin  # dt[T, H or K, D]
