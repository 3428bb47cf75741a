"""A quantized KV page pool: 8-bit values with one float32 scale per token and KV head.

Layout (one per K and per V of a layer)::

    values: int8 | float8_e4m3fn | float8_e5m2 [num_kv_heads, num_pages, page_size, head_dim]
    scales: f32                                 [num_kv_heads, num_pages, page_size, 1]

A written row ``x`` [head_dim] of one head is stored as ``round(x / s)`` with ``s = max|x| / qmax`` (``qmax`` 127
for int8, the format's largest finite value for fp8), so each token's K and V keep their own range: no
calibration, and a token written once reads back the same after preemption, prefix-cache reuse or on another
shard. The scales are pages of their own with a trailing axis of 1, so the same writes and the same sharding
(heads over ``tensor``, pages over ``data``) apply to them unchanged.

``QuantizedPages`` is a pytree (it is donated and sharded like an array pair) and reads like the dequantized
pool: ``pages[:, ids]`` gathers the 8-bit values and their scales of the pages asked for and returns them
dequantized (``dtype``), so attention dequantizes exactly the pages it reads, never the pool.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes

STORAGE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}


def qmax(dtype) -> float:
    dtype = jnp.dtype(dtype)
    return 127.0 if dtype == jnp.int8 else float(ml_dtypes.finfo(dtype).max)


def is_quantized_dtype(dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 1


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., head_dim] -> (values in ``dtype``, scales f32[..., 1]), one scale per row."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / qmax(dtype), 1.0)
    y = xf / scale
    if jnp.dtype(dtype) == jnp.int8:
        return jnp.clip(jnp.round(y), -127, 127).astype(jnp.int8), scale
    return jnp.clip(y, -qmax(dtype), qmax(dtype)).astype(dtype), scale


def fake_quantize(x: jax.Array, dtype) -> jax.Array:
    """What ``x`` reads back as after being written to a pool of ``dtype`` (in x's dtype)."""
    values, scale = quantize(x, dtype)
    return (values.astype(jnp.float32) * scale).astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    values: jax.Array  # int8|f8[num_kv_heads, num_pages, page_size, head_dim], or u8 holding fp8 bit patterns
    scales: jax.Array  # f32[num_kv_heads, num_pages, page_size, 1]
    dtype: object = dataclasses.field(default=jnp.float32, metadata=dict(static=True))  # of what reads return
    # The fp8 format whose bit patterns ``values`` holds as uint8, or None (values in their own dtype). XLA:CPU
    # has no fp8 arithmetic: it widens an fp8 buffer that an update touches to f16 and back, the whole pool on
    # every step, where a byte buffer is updated in place; the CPU pool therefore keeps fp8 as bytes.
    fp8_format: object = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def shape(self):
        return self.values.shape

    @property
    def ndim(self):
        return self.values.ndim

    @property
    def storage_dtype(self):
        """The 8-bit format of the values (int8, float8_e4m3fn or float8_e5m2), however they are held."""
        return self.values.dtype if self.fp8_format is None else jnp.dtype(self.fp8_format)

    def __getitem__(self, index) -> jax.Array:
        """The dequantized pages at ``index`` (which must not index the last axis)."""
        values = self.values[index]
        if self.fp8_format is not None:
            values = jax.lax.bitcast_convert_type(values, self.fp8_format)
        return (values.astype(jnp.float32) * self.scales[index]).astype(self.dtype)

    def dequantize(self) -> jax.Array:
        return self[...]

    @classmethod
    def zeros(cls, shape, storage, dtype=jnp.float32, *, fp8_as_bytes: bool = False) -> "QuantizedPages":
        """A zeroed pool (zero values, scales of 1); ``fp8_as_bytes``: an fp8 pool held as uint8 (the CPU's)."""
        fmt = jnp.dtype(storage) if fp8_as_bytes and jnp.dtype(storage) != jnp.int8 else None
        return cls(jnp.zeros(shape, jnp.uint8 if fmt is not None else storage),
                   jnp.ones(shape[:-1] + (1,), jnp.float32), dtype, fmt)

    def typed_values(self) -> jax.Array:
        """The values in their 8-bit dtype (a bitcast where fp8 is held as bytes)."""
        if self.fp8_format is None:
            return self.values
        return jax.lax.bitcast_convert_type(self.values, self.fp8_format)

    def with_arrays(self, values: jax.Array, scales: jax.Array) -> "QuantizedPages":
        """The same pool kind (read dtype, fp8 held as bytes or not) over new arrays."""
        return dataclasses.replace(self, values=values, scales=scales)

    def stored(self, values: jax.Array) -> jax.Array:
        """8-bit ``values`` in this pool's storage format, as its ``values`` array holds them."""
        return values if self.fp8_format is None else jax.lax.bitcast_convert_type(values, jnp.uint8)


def write_quantized(write, k_pages: QuantizedPages, v_pages: QuantizedPages, k: jax.Array, v: jax.Array, md):
    """Quantize this step's K/V rows and write values and scales with ``write`` (any of the KV-write functions:
    ``write(k_pages, v_pages, k, v, md) -> (k_pages, v_pages)``)."""
    kq, ks = quantize(k, k_pages.storage_dtype)
    vq, vs = quantize(v, v_pages.storage_dtype)
    kv, vv = write(k_pages.values, v_pages.values, k_pages.stored(kq), v_pages.stored(vq), md)
    kss, vss = write(k_pages.scales, v_pages.scales, ks, vs, md)
    return k_pages.with_arrays(kv, kss), v_pages.with_arrays(vv, vss)
