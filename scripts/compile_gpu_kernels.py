"""Compile the Pallas GPU kernels for a described NVIDIA GPU (no GPU needed) and report, per kernel and serving
shape, whether XLA's GPU compiler (with its Triton) accepts it and how much shared memory it uses.

  PYTHONPATH=. python scripts/compile_gpu_kernels.py                       # H100, every head size, pool, shape
  PYTHONPATH=. python scripts/compile_gpu_kernels.py --target h200 --head-dims 96 256 --pools float32 int8

The GPU is described to jax's CUDA plugin (``jaxserve.tools.gpu_targets``; install the plugin from the test extra).
Shared memory is read off a second compile for the same GPU described with 1 byte of shared memory per block,
which XLA refuses naming what the kernel requested. Each attention line also shows the block sizes chosen for the
call and the estimate they were chosen by (``block_sizes.gpu_shared_memory_estimate``). Exits 1 if any kernel
fails to compile.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HEAD_DIMS = (16, 24, 64, 80, 96, 112, 128, 256)
# (tokens, sequence slots, sliding window, soft cap), page_size 16, 64 pages per sequence.
SHAPES = {"decode": (8, 8, None, None), "large_decode": (256, 256, None, None), "prefill": (512, 32, None, None),
          "mixed": (256, 32, 64, 30.0)}
POOLS = {"bfloat16": ("bfloat16", None), "float32": ("float32", None), "int8": ("bfloat16", "int8"),
         "fp8": ("bfloat16", "fp8")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="h100", help="a described GPU: h100 or h200")
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
    parser.add_argument("--pools", nargs="+", default=list(POOLS), choices=list(POOLS))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    args = parser.parse_args()

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    from jaxserve.tools import gpu_targets
    from pallas_kernels.kv_cache_update import write_kv_gpu
    from pallas_kernels.quantized_pages import STORAGE, QuantizedPages
    from pallas_kernels.ragged_paged_attention import AttentionMetadata, ragged_paged_attention_gpu
    from pallas_kernels.ragged_paged_attention.block_sizes import gpu_shared_memory_estimate
    from pallas_kernels.ragged_paged_attention.gpu import kernel_rows, padded_lanes, resolve_block_sizes

    sds = jax.ShapeDtypeStruct
    page_size, pages_per_seq, num_pages = 16, 64, 1024
    limit = gpu_targets.GPU_TARGETS[args.target].shared_memory_per_block_optin

    def metadata(slots):
        return AttentionMetadata.abstract(slots, pages_per_seq)

    def pool(head_dim, dtype, storage):
        shape = (args.kv_heads, num_pages, page_size, head_dim)
        if storage is None:
            return sds(shape, dtype)
        return QuantizedPages(sds(shape, STORAGE[storage]), sds(shape[:-1] + (1,), jnp.float32), jnp.dtype(dtype))

    def compile_case(fn, shapes):
        """(shared memory in bytes or None, error or None)."""
        try:
            with gpu_targets.described_mesh(args.target, shared_memory_limit=1):
                fn.lower(*shapes).compile()
            used = 0
        except Exception as e:  # noqa: BLE001 - reported below
            found = re.search(r"requested (\d+)", str(e))
            if not found:
                return None, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            used = int(found.group(1))
        try:
            with gpu_targets.described_mesh(args.target):
                fn.lower(*shapes).compile()
        except Exception as e:  # noqa: BLE001
            return used, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return used, None

    failures = 0
    print(f"target {args.target}: {limit} bytes of shared memory per block; {args.kv_heads} KV heads, group "
          f"{args.group}, page_size {page_size}")
    for head_dim in args.head_dims:
        for pool_name in args.pools:
            dtype, storage = POOLS[pool_name]
            pages = pool(head_dim, dtype, storage)
            for shape_name in args.shapes:
                tokens, slots, window, cap = SHAPES[shape_name]
                q = sds((tokens, args.kv_heads * args.group, head_dim), dtype)
                md = metadata(slots)
                sizes = resolve_block_sizes(q.shape, pages.shape, dtype, slots, pages_per_seq,
                                            storage_dtype=None if storage is None else STORAGE[storage])
                estimate = gpu_shared_memory_estimate(kernel_rows(sizes.block_q, args.group), sizes.block_kv,
                                                      padded_lanes(head_dim), sizes.num_stages, dtype,
                                                      None if storage is None else STORAGE[storage])
                fn = jax.jit(lambda *a, w=window, c=cap: ragged_paged_attention_gpu(*a, sm_scale=0.1,
                                                                                   sliding_window=w, soft_cap=c))
                start = time.perf_counter()
                used, error = compile_case(fn, (q, pages, pages, md))
                failures += error is not None
                print(f"attention d={head_dim:<3} {pool_name:<8} {shape_name:<12} block_q={sizes.block_q} "
                      f"block_kv={sizes.block_kv} stages={sizes.num_stages} splits={sizes.num_splits}: "
                      f"{'FAILED ' + error if error else 'ok'}, shared {used} B (estimate {estimate}, limit "
                      f"{limit}) [{time.perf_counter() - start:.1f}s]", flush=True)
            values = pages.values if storage else pages
            writes = [("values", values)] + ([("scales", pages.scales)] if storage else [])
            for what, target in writes:
                new = sds((512, args.kv_heads, target.shape[-1]), target.dtype)
                used, error = compile_case(jax.jit(write_kv_gpu, donate_argnums=(0, 1)),
                                           (target, target, new, new, metadata(32)))
                failures += error is not None
                print(f"write_kv  d={target.shape[-1]:<3} {pool_name:<8} {what:<12}: "
                      f"{'FAILED ' + error if error else 'ok'}, shared {used} B", flush=True)
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
