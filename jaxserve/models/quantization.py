"""Weight quantization: 8-bit weights with float32 scales, dequantized inside each matmul.

Two sources:

- **Quantized at load** (``quantization="int8"`` or ``"fp8"``): every linear layer's weight (q, k, v, o, gate,
  up, down, the experts' stacked weights, a shared expert's) is quantized on the host, tensor by tensor as the
  checkpoint is read, and only the 8-bit values and their scales are placed on the devices. One scale per output
  channel, symmetric: ``scale[o] = max_i |w[i, o]| / qmax`` (``qmax`` 127 for int8, 448 for float8_e4m3fn),
  ``q = round(w / scale)``. The LM head and the embeddings stay in the model's dtype unless ``quantize_lm_head``
  (then the embedding is quantized per vocabulary row, which is the tied head's output channel).
- **Pre-quantized checkpoints** (``config.json``'s ``quantization_config``): ``quant_method: "fp8"`` (float8
  weights with ``weight_scale_inv``, one per tensor or one per ``weight_block_size`` block) and
  ``"compressed-tensors"`` FP8 / INT8 weights (symmetric, ``weight_scale`` per channel or per tensor). The values
  are kept as published; a per-tensor scale becomes a per-channel one (repeated), a block scale stays a block
  scale. Which layers are quantized is read from the checkpoint itself (the layers that have a scale tensor);
  an 8-bit MoE router (a checkpoint whose scheme targets every linear module) is dequantized once at load.

Our layout: a quantized ``[in, out]`` weight (``[E, in, out]`` for experts) has a float32 sibling parameter
named ``<name>_scale``: ``[out]`` (``[E, out]``) per channel, or ``[ceil(in / B), ceil(out / B)]`` for ``B``-blocks.
A scale carries its weight's logical axes without the reduced ones, so it is sharded as its weight on every mesh.

Shapes are noted ``dtype[dims]``, as in ``pallas_kernels``: ``f32``, ``i8``, ``f8`` (float8_e4m3fn) are fixed
dtypes, ``w8`` is either 8-bit one, ``...`` any leading dims (an expert stack's E); B is the block edge.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

WEIGHT_DTYPES = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}
QMAX = {"int8": 127.0, "fp8": float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)}
SUPPORTED_METHODS = ("fp8", "compressed-tensors")
SUPPORTED = ("--quantization int8|fp8 on a bf16/fp16/fp32 checkpoint, or a pre-quantized checkpoint with "
             "quant_method 'fp8' (per-tensor or block-wise weight_scale_inv) or 'compressed-tensors' "
             "(symmetric FP8/INT8 weights, per-channel or per-tensor weight_scale)")
SCALE_SUFFIX = "_scale"


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """How one weight is stored: its 8-bit dtype and, for block scales, the block edge (None: per channel)."""

    dtype: np.dtype
    block: int | None = None


def quantize(w: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel quantization of ``w`` [..., in, out] (reduced over ``in``).

    Returns (q w8[..., in, out] (i8 or f8 by ``kind``), scale f32[..., out]) with ``w ~= q * scale``.
    """
    w32 = np.asarray(w, np.float32)  # f32[..., in, out]
    amax = np.max(np.abs(w32), axis=-2)  # f32[..., out]
    scale = np.where(amax > 0, amax / QMAX[kind], 1.0).astype(np.float32)  # f32[..., out]
    x = w32 / scale[..., None, :]  # f32[..., in, out], within [-qmax, qmax]
    if kind == "int8":
        q = np.clip(np.rint(x), -127, 127).astype(np.int8)  # i8[..., in, out]
    else:  # ml_dtypes rounds to nearest even; the clip keeps rounding from reaching NaN (e4m3fn has no inf)
        q = np.clip(x, -QMAX[kind], QMAX[kind]).astype(WEIGHT_DTYPES[kind])  # f8[..., in, out]
    return q, scale


def dequantize_host(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float32 weight of ``q`` [..., in, out] and its scale (per channel or block), on the host (tests)."""
    q = np.asarray(q, np.float32)  # f32[..., in, out]
    if scale.ndim == q.ndim - 1:  # per channel: scale f32[..., out]
        return q * scale[..., None, :]  # f32[..., in, out]
    return q * expand_blocks(scale, q.shape, np)  # f32[in, out]


def expand_blocks(scale, shape, xp=jnp):
    """A block scale [ceil(in / B), ceil(out / B)] repeated to ``shape`` [in, out]."""
    bi, bo = -(-shape[0] // scale.shape[0]), -(-shape[1] // scale.shape[1])  # the block edges along in and out
    return xp.repeat(xp.repeat(scale, bi, axis=0)[: shape[0]], bo, axis=1)[:, : shape[1]]  # f32[in, out]


# ----------------------------------------------------------------------------------------------------------------
# Which weights, in which layout


ROUTERS = ("gate", "shared_expert_gate")  # MoE: the router [hidden, experts] and Qwen2-MoE's shared-expert gate


def is_router(path: tuple) -> bool:
    """Whether ``path`` is an MoE router's weight. Routers stay in the model dtype: they are tiny, and their
    top-k choice flips on small changes. A published checkpoint's 8-bit router is dequantized at load."""
    return len(path) >= 2 and path[-1] == "weight" and path[-2] in ROUTERS


def quantizable_paths(state: nnx.State, lm_head: bool) -> list[tuple]:
    """The paths of the weights ``quantization=...`` quantizes: every 2-D linear ``weight`` and the stacked
    expert weights; the LM head and the embedding only with ``lm_head``. MoE routers stay in the model dtype
    (tiny, and their top-k choice is sensitive)."""
    out = []
    for path, var in nnx.to_flat_state(state):
        name = path[-1]
        if name == "embedding" or path[0] == "lm_head":
            if lm_head:
                out.append(path)
        elif name == "weight" and var.get_value().ndim == 2 and not is_router(path):
            out.append(path)
        elif len(path) >= 2 and path[-2] == "experts" and var.get_value().ndim == 3:  # not gpt-oss's biases
            out.append(path)
    return out


def apply_plan(model, plan: dict[tuple, QuantizedWeight]):
    """Replace each planned weight of ``model`` (built under ``nnx.eval_shape``) by its 8-bit parameter and add
    its float32 ``<name>_scale`` sibling. Returns the model."""
    for path, qw in plan.items():
        owner = model
        for part in path[:-1]:
            owner = owner[part] if isinstance(part, int) else getattr(owner, part)
        name = path[-1]
        param = getattr(owner, name)
        shape, axes = param.get_value().shape, param.logical_axes
        if name == "embedding":  # [vocab, embed]: one scale per vocabulary row
            scale_shape, scale_axes = shape[:1], axes[:1]  # f32[vocab]
        elif qw.block is None:
            scale_shape, scale_axes = shape[:-2] + shape[-1:], axes[:-2] + axes[-1:]  # f32[..., out]
        else:
            # f32[..., in / B, out / B]
            scale_shape = shape[:-2] + (-(-shape[-2] // qw.block), -(-shape[-1] // qw.block))
            scale_axes = axes
        setattr(owner, name, nnx.Param(jnp.zeros(shape, qw.dtype), logical_axes=axes))  # w8[*shape]
        setattr(owner, name + SCALE_SUFFIX, nnx.Param(jnp.zeros(scale_shape, jnp.float32), logical_axes=scale_axes))
    return model


# ----------------------------------------------------------------------------------------------------------------
# Pre-quantized checkpoints


@dataclasses.dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's ``quantization_config``: its method, weight dtype and block (None: per channel/tensor),
    and the suffix of its scale tensors (``weight_scale_inv`` or ``weight_scale``)."""

    method: str
    dtype: np.dtype
    block: int | None
    scale_name: str


def checkpoint_quant(hf: dict) -> CheckpointQuant | None:
    """The quantization a ``config.json`` dict declares, or None (``quantization_of`` its
    ``quantization_config``)."""
    return quantization_of(hf.get("quantization_config") or hf.get("compression_config"))


def quantization_of(qc: dict | None) -> CheckpointQuant | None:
    """The quantization a checkpoint's ``quantization_config`` (``ModelConfig.quantization_config``) declares, or
    None.

    Raises:
      ValueError: (one line) for a method or scheme jaxserve cannot load, naming it and what is supported.
    """
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
            raise ValueError(f"quantization_config activation_scheme={qc.get('activation_scheme')!r} is not "
                             f"supported; supported: {SUPPORTED}")
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or block[0] != block[1]):
            raise ValueError(f"quantization_config weight_block_size={block} is not supported (square blocks "
                             f"only); supported: {SUPPORTED}")
        return CheckpointQuant("fp8", WEIGHT_DTYPES["fp8"], None if block is None else int(block[0]),
                               "weight_scale_inv")
    if method == "compressed-tensors":
        groups = list((qc.get("config_groups") or {}).values())
        if len(groups) != 1 or not groups[0].get("weights"):
            raise ValueError(f"compressed-tensors checkpoint with {len(groups)} config groups is not supported "
                             f"(one weight scheme only); supported: {SUPPORTED}")
        w = groups[0]["weights"]
        kind = {("float", 8): "fp8", ("int", 8): "int8"}.get((w.get("type"), w.get("num_bits")))
        strategy = w.get("strategy")
        if kind is None or not w.get("symmetric", True) or strategy not in ("channel", "tensor"):
            raise ValueError(f"compressed-tensors weight scheme type={w.get('type')!r} num_bits={w.get('num_bits')} "
                             f"symmetric={w.get('symmetric')} strategy={strategy!r} is not supported; "
                             f"supported: {SUPPORTED}")
        if qc.get("format") not in (None, "float-quantized", "int-quantized", "naive-quantized"):
            raise ValueError(f"compressed-tensors format={qc.get('format')!r} is not supported (packed formats are "
                             f"not); supported: {SUPPORTED}")
        return CheckpointQuant("compressed-tensors", WEIGHT_DTYPES[kind], None, "weight_scale")
    raise ValueError(f"quant_method={method!r} is not supported; supported: {SUPPORTED}")


def tensor_names(files: list[Path]) -> list[str]:
    """Every tensor name in the safetensors ``files`` (headers only)."""
    names = []
    for path in files:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            names.extend(k for k in json.loads(f.read(n)) if k != "__metadata__")
    return names


def prequantized_scale(scale: np.ndarray, q_out_in_shape: tuple[int, int], block: int | None) -> np.ndarray:
    """A checkpoint's scale for an HF weight [out, in] -> ours: f32[out] per channel, or the block scale
    transposed to [in_blocks, out_blocks]."""
    out, inp = q_out_in_shape
    s = np.asarray(scale, np.float32)  # f32[out / B, in / B], f32[out] (or [out, 1]) or f32[] (or [1]), as published
    if block is not None and s.ndim == 2:
        want = (-(-out // block), -(-inp // block))
        if s.shape != want:
            raise ValueError(f"block scale shape {s.shape} does not match {want} for a [{out}, {inp}] weight")
        return np.ascontiguousarray(s.T)  # f32[in / B, out / B]
    if s.size == 1:
        return np.full((out,), float(s.reshape(())), np.float32)  # f32[out]
    if s.size == out:
        return s.reshape(out)  # f32[out]
    raise ValueError(f"scale shape {s.shape} fits neither per-tensor nor per-channel for a [{out}, {inp}] weight")
