"""The thin Flax NNX modules every attention and MLP kind is built from (the decoder, latent attention, the Gated
DeltaNet layers): parameters with their logical sharding axes, each call a thin call into ``layers``. Shapes as in
``jaxserve.models.decoder``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models import layers
from jaxserve.models.config import ModelConfig
from jaxserve.models.lora import lora_delta
from sharding.layout import StepLayout


def constrain(x: jax.Array, layout: StepLayout | None, *axes: str | None) -> jax.Array:
    """Pin an activation's sharding by logical axes (no-op without a mesh layout)."""
    return x if layout is None else layout.constrain(x, axes)  # x's dtype and shape


def param(shape, dtype, axes) -> nnx.Param:
    # Real values come from a checkpoint (or the demo initialiser); modules are built under nnx.eval_shape.
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)  # dtype[*shape]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, cfg: ModelConfig, dtype, axes=("norm",)):
        self.weight = param((dim,), dtype, axes)  # dt[dim]: C, or D for the q/k norms
        self.eps, self.offset = cfg.rms_norm_eps, cfg.norm_offset

    def __call__(self, x):  # dt[..., dim] -> dt[..., dim]
        return layers.rms_norm(x, self.weight[...], self.eps, self.offset)


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, dtype, scale: bool = False):
        self.embedding = param((vocab, dim), dtype, ("vocab", "embed"))  # dt[V, C] (w8[V, C] when quantized)
        self.embedding_scale = nnx.data(None)  # f32[V] when the embedding is quantized (jaxserve.models.quantization)
        self.scale, self.dtype = scale, dtype

    def __call__(self, token_ids):  # i32[R * T] -> dt[R * T, C]
        x = self.embedding[...][token_ids]  # dt[R * T, C] (w8 when quantized)
        if self.embedding_scale is not None:
            # f32[R * T, C] * f32[R * T, 1] -> dt[R * T, C]
            x = (x.astype(jnp.float32) * self.embedding_scale[...][token_ids][:, None]).astype(self.dtype)
        if self.scale:  # sqrt(hidden) rounded to the model's dtype first, as the checkpoints were trained
            x = x * jnp.asarray(x.shape[-1] ** 0.5, x.dtype)  # dt[R * T, C]
        return x


class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, *, bias: bool, dtype, axes: tuple[str, str]):
        self.weight = param((din, dout), dtype, axes)  # dt[in, out] (w8[in, out] when quantized)
        self.bias = param((dout,), dtype, axes[1:]) if bias else None  # dt[out]
        # Set when the weight is quantized (jaxserve.models.quantization): f32[out], or f32[in / B, out / B]
        self.weight_scale = nnx.data(None)

    def __call__(self, x, lora=None):  # dt[..., in] -> dt[..., out]
        """``lora``: (a dt[G, in, R], b dt[G, R, out], ``LoraRows``), each row's adapter added (models/lora.py)."""
        y = layers.linear(x, self.weight[...], None if self.bias is None else self.bias[...],
                          None if self.weight_scale is None else self.weight_scale[...])
        if lora is None:
            return y
        delta = lora_delta(x.reshape(-1, x.shape[-1]), *lora).reshape(y.shape)  # f32[..., out]
        return (y.astype(jnp.float32) + delta).astype(x.dtype)
