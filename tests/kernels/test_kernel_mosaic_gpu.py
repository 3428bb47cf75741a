"""The Mosaic GPU (Hopper) ragged paged-attention kernel against the reference, in Pallas's Mosaic GPU interpreter
on CPU, compiled for the device on a GPU (``JAX_PLATFORMS=cuda``, as scripts/gpu_check.py runs them).

The interpreter (``plgpu.InterpretGPUParams`` passed as ``interpret``; jax 0.11's
``jax._src.pallas.mosaic_gpu.interpret``) runs the kernel body on the CPU once per block of the grid, each
warpgroup as a thread of its own, and simulates what the kernel relies on: global and shared memory (fresh shared
memory reads as NaN, out-of-bounds reads raise), TMA copies, barriers with their arrival counts and phases, and
wgmma. So these tests exercise the warp specialisation, the K/V ring and its barriers, the page gathers (with the
page table's garbage entries) and the masking, on NaN-poisoned pools (``attention_cases.build_batch``).

What the interpreter lacks, and how each gap is covered:

- wgmma with its A operand in registers (it takes both operands from shared memory only): the compiled kernel
  feeds ``P`` to the ``P V`` wgmma from registers; interpreted, the kernel stores ``P`` to a shared-memory tile
  first (``p_in_smem``, the one difference between the two). Everything else runs as compiled.
- ``pl.run_state`` over a wgmma accumulator (no interpreter rule): the kernel does not use it in either mode; each
  wgmma gets a fresh accumulator (``pl.run_scoped``) that is added to the rescaled one.
- register layouts, swizzles and tilings: the interpreter keeps values in their logical layout, so a layout that
  does not lower (or a swizzle Mosaic GPU lacks) only shows when lowering for sm_90a, which
  ``tests/tools/test_mosaic_gpu_export.py`` does at the serving shapes.

Each distinct call compiles the interpreter's program (~10 s on two cores), so there are two cases: a mixed batch
(decode rows and prompt chunks) with GQA 1 (MHA), head size 80 (rows that only take a 32-byte swizzle), a window
and a soft cap on bf16 pages, and a decode batch with GQA 8 and head size 128 on int8 pages with a window. fp8
pages take the same path as int8 (an 8-bit tile widened in shared memory, per-token scales on the score and
probability columns) with another element type; head size 16 and the engine's own batches run through the engine
in ``tests/executor/test_attention_backends.py``. Pages are 8 tokens (the kernel copies whole pages into 8-row
shared-memory tiles); sequences are long enough that keys span more 64-key blocks than the ring has slots.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantized_pages import STORAGE, QuantizedPages, quantize
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention.mosaic_gpu import ragged_paged_attention_mosaic_gpu

from attention_cases import DECODE, MIXED, assert_matches_reference, build_batch, device_args

PAGE_SIZE = 8
INTERPRET = jax.default_backend() != "gpu"
BLOCKS = dict(block_kv=64, num_stages=2)  # 8 pages per block; 2 slots, so long sequences wrap around the ring

# (lengths, group, head_dim, pool, page_size, sliding_window, soft_cap), one KV head. An 8-bit pool's pages are 32
# tokens: each page's f32 scales are one TMA copy, whose shared-memory destination starts on a 128-byte boundary.
CASES = [
    (MIXED, 1, 80, "bfloat16", PAGE_SIZE, 5, 3.0),
    (DECODE, 8, 128, "int8", 32, 6, None),
]


@pytest.mark.parametrize("lengths,group,head_dim,pool,page_size,window,soft_cap", CASES)
def test_matches_reference(lengths, group, head_dim, pool, page_size, window, soft_cap):
    rng = np.random.default_rng(group * 1000 + head_dim)
    # Long enough that a sequence's keys span several 64-key blocks (and more blocks than ring slots).
    lengths = (lengths[0], [kv * 4 for kv in lengths[1]])
    batch, _, _ = build_batch(rng, *lengths, num_kv_heads=1, group=group, head_dim=head_dim, dtype="bfloat16",
                              page_size=page_size)
    args = device_args(batch)
    if pool != "bfloat16":
        for name in ("k_pages", "v_pages"):
            values, scales = quantize(args[name], STORAGE[pool])
            args[name] = QuantizedPages(values, scales, jnp.dtype("bfloat16"))
    kw = dict(sm_scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)
    out = ragged_paged_attention_mosaic_gpu(**args, **kw, block_sizes=BLOCKS, interpret=INTERPRET)
    assert out.dtype == jnp.bfloat16
    # The reference reads the same (dequantized) pages.
    ref = ragged_paged_attention(**args, **kw)
    assert_matches_reference(out, batch, **kw, ref=ref)


def test_rejects_what_the_kernel_cannot_run():
    rng = np.random.default_rng(0)
    batch, _, _ = build_batch(rng, *DECODE, num_kv_heads=1, group=2, head_dim=64, dtype="bfloat16", page_size=4)
    with pytest.raises(ValueError, match="page_size a multiple of 8"):
        ragged_paged_attention_mosaic_gpu(**device_args(batch), sm_scale=0.1, interpret=True)
    batch, _, _ = build_batch(rng, *DECODE, num_kv_heads=1, group=2, head_dim=64, dtype="float32", page_size=8)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        ragged_paged_attention_mosaic_gpu(**device_args(batch), sm_scale=0.1, interpret=True)
    batch, _, _ = build_batch(rng, *DECODE, num_kv_heads=1, group=2, head_dim=24, dtype="bfloat16", page_size=8)
    with pytest.raises(ValueError, match="head_dim a multiple of 16"):
        ragged_paged_attention_mosaic_gpu(**device_args(batch), sm_scale=0.1, interpret=True)
    # DeepSeek's latent entries (512 + 64): past one wgmma's N and one warpgroup's accumulator registers.
    batch, _, _ = build_batch(rng, *DECODE, num_kv_heads=1, group=16, head_dim=576, dtype="bfloat16", page_size=8)
    with pytest.raises(ValueError, match="head_dim at most 256.*got 576"):
        ragged_paged_attention_mosaic_gpu(**device_args(batch), sm_scale=0.1, interpret=True)
    # An 8-bit pool at 16-token pages: every other page's scale copy would start 64 bytes into a 128-byte line.
    batch, _, _ = build_batch(rng, *DECODE, num_kv_heads=1, group=2, head_dim=64, dtype="bfloat16", page_size=16)
    args = device_args(batch)
    for name in ("k_pages", "v_pages"):
        args[name] = QuantizedPages(*quantize(args[name], STORAGE["int8"]), jnp.dtype("bfloat16"))
    with pytest.raises(ValueError, match="page_size a multiple of 32 with an 8-bit KV cache, got 16"):
        ragged_paged_attention_mosaic_gpu(**args, sm_scale=0.1, interpret=True)
