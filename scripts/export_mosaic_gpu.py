"""Lower and export the Mosaic GPU attention kernel for a described Hopper GPU (no GPU needed), at the serving shapes.

  PYTHONPATH=. python scripts/export_mosaic_gpu.py                  # H100: every head size, pool and shape
  PYTHONPATH=. python scripts/export_mosaic_gpu.py --target h200 --head-dims 128 --pools int8
  PYTHONPATH=. python scripts/export_mosaic_gpu.py --head-dims 64 --sinks         # with attention sinks (gpt-oss)

Each case is ``jax.export``-ed for the ``cuda`` platform inside a mesh of described GPUs
(``jaxserve.tools.gpu_targets``; jax's CUDA plugin, from the test extra): Pallas lowers the kernel to a Mosaic GPU
module for compute capability 9.0 (sm_90a: wgmma, TMA), checks its layouts, tilings and swizzles, and embeds it in
the ``mosaic_gpu_v2`` custom call. What is left for a real GPU is Mosaic's compile of that module to machine code
(at load). Exits 1 if any case fails. ``tests/tools/test_mosaic_gpu_export.py`` runs a cover of these cases.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The head sizes of the supported families (16: the tiny test models'); 24 and other sizes that are not a multiple
# of 16 are refused by the kernel (wgmma rows of whole 32-byte swizzle blocks), and so are sizes past 256 such as
# DeepSeek's 576-wide latent entries (mosaic_gpu.MAX_HEAD_DIM).
HEAD_DIMS = (16, 64, 80, 96, 112, 128, 256)
# (tokens, sequence slots, sliding window, soft cap): the engine's buckets at its defaults (32 sequences, 512
# batched tokens), and a large-batch decode; page_size 16 (32 for an 8-bit pool, whose scale copies start on
# 128-byte boundaries: mosaic_gpu.check_supported), 64 pages per sequence.
SHAPES = {"decode": (8, 8, None, None), "large_decode": (256, 256, None, None), "prefill": (512, 32, None, None),
          "mixed": (256, 32, 64, 30.0)}
# pool -> (query dtype, 8-bit storage or None)
POOLS = {"bfloat16": ("bfloat16", None), "float16": ("float16", None), "int8": ("bfloat16", "int8"),
         "fp8": ("bfloat16", "fp8"), "fp8_e5m2": ("bfloat16", "fp8_e5m2")}
PAGE_SIZE, QUANTIZED_PAGE_SIZE, PAGES_PER_SEQ, NUM_PAGES = 16, 32, 64, 1024


def export_case(target: str, shape: str, head_dim: int, pool: str, *, kv_heads: int = 8, group: int = 4,
                sinks: bool = False):
    """The kernel at one serving shape (with one attention sink per query head if ``sinks``), exported for
    ``cuda`` on a described ``target`` GPU (a ``jax.export.Exported``)."""
    import jax
    import jax.numpy as jnp

    from jaxserve.tools import gpu_targets
    from pallas_kernels.quantized_pages import STORAGE, QuantizedPages
    from pallas_kernels.ragged_paged_attention import AttentionMetadata
    from pallas_kernels.ragged_paged_attention.mosaic_gpu import ragged_paged_attention_mosaic_gpu

    sds = jax.ShapeDtypeStruct
    tokens, slots, window, cap = SHAPES[shape]
    dtype, storage = POOLS[pool]
    md = AttentionMetadata.abstract(slots, PAGES_PER_SEQ)
    q = sds((tokens, kv_heads * group, head_dim), dtype)
    pool_shape = (kv_heads, NUM_PAGES, PAGE_SIZE if storage is None else QUANTIZED_PAGE_SIZE, head_dim)
    if storage is None:
        pages = sds(pool_shape, dtype)
    else:
        pages = QuantizedPages(sds(pool_shape, STORAGE[storage]), sds(pool_shape[:-1] + (1,), jnp.float32),
                               jnp.dtype(dtype))
    fn = jax.jit(lambda *a: ragged_paged_attention_mosaic_gpu(*a[:4], sm_scale=head_dim**-0.5, sliding_window=window,
                                                              soft_cap=cap, sinks=a[4] if sinks else None))
    with gpu_targets.described_mesh(target):
        return jax.export.export(fn, platforms=["cuda"])(q, pages, pages, md, sds((kv_heads * group,), jnp.float32))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="h100", help="a described GPU: h100 or h200")
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
    parser.add_argument("--pools", nargs="+", default=list(POOLS), choices=list(POOLS))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--sinks", action="store_true", help="with attention sinks (one logit per query head)")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    failures = total = 0
    for head_dim in args.head_dims:
        for pool in args.pools:
            for shape in args.shapes:
                start = time.perf_counter()
                total += 1
                try:
                    exported = export_case(args.target, shape, head_dim, pool, sinks=args.sinks)
                    ok = "mosaic_gpu" in exported.mlir_module()
                    status = "ok" if ok else "FAILED: no Mosaic GPU custom call in the exported module"
                except Exception as e:  # noqa: BLE001 - reported, then the sweep goes on
                    ok, status = False, f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}"
                failures += not ok
                print(f"{args.target} d={head_dim:<3} {pool:<8} {shape:<12}{' sinks' if args.sinks else ''} {status} "
                      f"[{time.perf_counter() - start:.1f}s]", flush=True)
    print(f"{total - failures}/{total} exported")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
