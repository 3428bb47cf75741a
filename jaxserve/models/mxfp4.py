"""MXFP4 expert weights, as gpt-oss checkpoints publish them (``quantization_config.quant_method == "mxfp4"``).
Host-only (NumPy, no jax).

OCP microscaling FP4: each run of 32 values along a weight's input axis shares one power-of-two scale. A weight
``W`` ck[E, out, in] is stored as two tensors beside its name: ``<name>_blocks`` u8[E, out, in / 32, 16], two
e2m1 codes per byte (the low nibble first), and ``<name>_scales`` u8[E, out, in / 32], e8m0 exponents biased by
127. The value of code ``c`` in a block with exponent byte ``s`` is ``FP4_VALUES[c] * 2 ** (s - 127)``.

jaxserve dequantizes them at load into the model's dtype (``models/loader.py``): exact (every MXFP4 value is a
bf16 value), and it serves them with the same grouped matmuls as every other MoE family. Keeping the experts in
4 bits on the accelerator (a quarter of bf16's HBM, what makes gpt-oss-120b fit one 80 GB card) needs a grouped
matmul that reads 4-bit operands; that is not built yet.
"""

from __future__ import annotations

import numpy as np

# e2m1: sign bit, 2 exponent bits, 1 mantissa bit
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
BLOCK = 32  # values per scale
SUFFIXES = ("_blocks", "_scales")


def is_mxfp4(quantization_config: dict | None) -> bool:
    """Whether a checkpoint's ``quantization_config`` declares MXFP4 (dequantized at load)."""
    return bool(quantization_config) and quantization_config.get("quant_method") == "mxfp4"


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``<name>_blocks`` u8[..., out, G, 16] and ``<name>_scales`` u8[..., out, G] -> f32[..., in, out] (in = 32 G):
    the weight in our [in, out] layout.

    Raises:
      ValueError: when the two shapes do not pair up.
    """
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not pair up (blocks must be "
                         f"[..., G, {BLOCK // 2}] over scales [..., G])")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*scales.shape, BLOCK)  # u8[..., out, G, 32]
    values = np.ldexp(FP4_VALUES[codes], scales.astype(np.int32)[..., None] - 127)  # f32[..., out, G, 32]
    return np.swapaxes(values.reshape(*scales.shape[:-1], -1), -1, -2)  # f32[..., in, out]
