"""Compile the TPU kernels with the real Mosaic compiler, without a TPU.

libtpu can compile for a described topology with no chips attached (JAX's "compile-only" devices), which runs
Mosaic's full pipeline: layout inference, tiling and DMA alignment checks, VMEM allocation. Interpret mode and
plain lowering check none of those.

  pip install "jax[tpu]==$(python -c 'import jax; print(jax.__version__)')"   # or the matching libtpu alone
  PYTHONPATH=. python scripts/compile_tpu_kernels.py                          # v4, v5e, v5p, v6e
  PYTHONPATH=. python scripts/compile_tpu_kernels.py --topologies v5e:2x2 --page-sizes 16,32
  PYTHONPATH=. python scripts/compile_tpu_kernels.py --kv-cache-dtypes int8,fp8,fp8_e5m2   # 8-bit pages only

``--kv-cache-dtypes`` (default ``auto,int8,fp8,fp8_e5m2``): ``auto`` compiles attention and the KV write over
pages in each query dtype; each 8-bit format compiles attention over ``QuantizedPages`` of that format (values
plus per-token f32 scales) for each query dtype (8-bit rows are written by the reference scatter, plain XLA).
Each line that compiles reports the temporary HBM XLA allocates around the kernel (``memory_analysis``): the
pool has 8 KV heads and ``--num-pages`` pages (512), so a copy of the pool shows there.
Exits non-zero if any kernel fails to compile.

``--max-page-table`` instead finds, per topology, the most page-table entries (slots x pages per sequence, int32
in SMEM) the attention kernel compiles with, by bisection at 8 and 32 slots, and exits non-zero if any is below
``MAX_PAGE_TABLE_ENTRIES``, the bound the engine and ``aot`` size ``max_model_len`` by.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu (nothing runs on chips)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from pallas_kernels.kv_cache_update import write_kv_tpu  # noqa: E402
from pallas_kernels.quantized_pages import STORAGE, QuantizedPages  # noqa: E402
from pallas_kernels.ragged_paged_attention import AttentionMetadata, ragged_paged_attention_tpu  # noqa: E402
from pallas_kernels.ragged_paged_attention.tpu import MAX_PAGE_TABLE_ENTRIES  # noqa: E402


def max_page_table(device, slots: int) -> int:
    """The most ``slots * pages_per_seq`` the attention kernel compiles with on ``device`` (bf16, page 16)."""
    sharding = SingleDeviceSharding(device)

    def compiles(pages: int) -> bool:
        def sds(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        pool = sds((8, 512, 16, 128), jnp.bfloat16)
        try:
            jax.jit(lambda *a: ragged_paged_attention_tpu(*a, sm_scale=0.1)).trace(
                sds((8, 32, 128), jnp.bfloat16), pool, pool, AttentionMetadata.abstract(slots, pages)).lower().compile()
            return True
        except Exception:  # noqa: BLE001 - a compile that fails is the answer sought
            return False

    lo, hi = 1, 1 << 20
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if compiles(mid) else (lo, mid)
    return lo * slots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topologies", default="v4:2x2x1,v5e:2x2,v5p:2x2x1,v6e:2x2")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--page-sizes", default="16,32")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--kv-cache-dtypes", default="auto,int8,fp8,fp8_e5m2")
    parser.add_argument("--num-pages", type=int, default=512, help="pages of the pool (8 KV heads)")
    parser.add_argument("--pages-per-seq", type=int, default=32, help="page-table width of every batch")
    parser.add_argument("--max-page-table", action="store_true",
                        help="find the most page-table entries the kernel compiles with (SMEM), per topology")
    args = parser.parse_args()
    failures = 0
    if args.max_page_table:
        for topology in args.topologies.split(","):
            device = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[0]
            for slots in (8, 32):
                most = max_page_table(device, slots)
                ok = most >= MAX_PAGE_TABLE_ENTRIES
                failures += not ok
                print(f"{device.device_kind:12s} {slots:2d} slots: at most {most} page-table entries compile "
                      f"({'>=' if ok else 'BELOW'} the bound {MAX_PAGE_TABLE_ENTRIES})", flush=True)
        sys.exit(1 if failures else 0)
    for topology in args.topologies.split(","):
        device = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[0]
        sharding = SingleDeviceSharding(device)

        def sds(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        for kv_dtype, dtype, page_size, head_dim in itertools.product(
                args.kv_cache_dtypes.split(","), args.dtypes.split(","), map(int, args.page_sizes.split(",")),
                map(int, args.head_dims.split(","))):
            pool = sds((8, args.num_pages, page_size, head_dim), dtype)
            if kv_dtype != "auto":
                scales = sds((8, args.num_pages, page_size, 1), jnp.float32)
                pool = QuantizedPages(sds(pool.shape, STORAGE[kv_dtype]), scales, jnp.dtype(dtype))
            # (tokens, slots, group, window, soft cap): decode, a prefill chunk, a large mixed batch.
            for tokens, slots, group, window, cap in ((8, 8, 4, None, None), (512, 8, 8, 256, 30.0),
                                                      (128, 64, 1, None, None)):
                md = AttentionMetadata.abstract(slots, args.pages_per_seq)
                q = sds((tokens, 8 * group, head_dim), dtype)
                attend = jax.jit(lambda *a, w=window, c=cap: ragged_paged_attention_tpu(
                    *a, sm_scale=head_dim**-0.5, sliding_window=w, soft_cap=c))
                new = sds((tokens, 8, head_dim), dtype)
                kernels = [("attention", attend, (q, pool, pool, md))]
                if kv_dtype == "auto":
                    kernels.append(("write_kv", jax.jit(write_kv_tpu), (pool, pool, new, new, md)))
                for name, fn, operands in kernels:
                    pages = "pages " + (str(pool.dtype) if kv_dtype == "auto" else str(STORAGE[kv_dtype].dtype))
                    label = (f"{device.device_kind:12s} {name:9s} q {dtype:8s} {pages:21s} page {page_size:3d} "
                             f"head_dim {head_dim:3d} T={tokens} S={slots} group={group}")
                    try:
                        temp = fn.trace(*operands).lower().compile().memory_analysis().temp_size_in_bytes
                        print(f"{label}: ok (XLA temp {temp / 2**20:.2f} MiB)", flush=True)
                    except Exception as e:  # report every configuration, then fail
                        failures += 1
                        print(f"{label}: FAILED {str(e).strip().splitlines()[0][:300]}", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
