"""Benchmark ragged paged attention: the reference and the Pallas kernels available on this device.

For each decode shape (batch x context) and prefill shape (batch x chunk x context) it prints time, the K/V
bandwidth achieved (bytes of K/V the batch actually needs / time) and the FLOP rate, each also as a fraction of
this device's peak as measured here (a large copy for bandwidth, a large matmul for FLOPs).

  PYTHONPATH=. python scripts/bench_attention.py --quick              # seconds, on CPU
  PYTHONPATH=. python scripts/bench_attention.py --tune               # sweep the block-size table candidates
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.ragged_paged_attention import (  # noqa: E402
    AttentionMetadata,
    ragged_paged_attention,
    ragged_paged_attention_gpu,
    ragged_paged_attention_tpu,
)
from pallas_kernels.ragged_paged_attention.mosaic_gpu import ragged_paged_attention_mosaic_gpu  # noqa: E402
from pallas_kernels.ragged_paged_attention.block_sizes import BlockSizes, candidates, mode_for  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    q_len: int  # 1 for decode
    context: int  # kv_len of every sequence after this step

    @property
    def label(self) -> str:
        kind = "decode" if self.q_len == 1 else f"prefill q={self.q_len}"
        return f"{kind} b={self.batch} ctx={self.context}"


def parse_shapes(text: str, decode: bool) -> list[Shape]:
    shapes = []
    for item in filter(None, text.split(",")):
        parts = [int(p) for p in item.lower().split("x")]
        if decode and len(parts) == 2:
            shapes.append(Shape(parts[0], 1, parts[1]))
        elif not decode and len(parts) == 3:
            shapes.append(Shape(*parts))
        else:
            raise SystemExit(f"bad shape {item!r}: decode is BATCHxCONTEXT, prefill is BATCHxCHUNKxCONTEXT")
    return shapes


def make_batch(shape: Shape, args, rng):
    """Every sequence on its own shuffled pages; the pool has 10% spare pages."""
    ps = args.page_size
    pages_per_seq = -(-shape.context // ps)
    num_pages = int(shape.batch * pages_per_seq * 1.1) + 1
    pages = rng.permutation(num_pages)[: shape.batch * pages_per_seq].reshape(shape.batch, pages_per_seq)
    dtype = jnp.dtype(args.dtype)
    key = jax.random.key(0)
    k1, k2, k3 = jax.random.split(key, 3)
    pool = (args.num_kv_heads, num_pages, ps, args.head_dim)
    tokens = shape.batch * shape.q_len
    return dict(
        q=jax.random.normal(k1, (tokens, args.num_q_heads, args.head_dim), dtype),
        k_pages=jax.random.normal(k2, pool, dtype),
        v_pages=jax.random.normal(k3, pool, dtype),
        md=AttentionMetadata(
            cu_q_lens=jnp.arange(shape.batch + 1, dtype=jnp.int32) * shape.q_len,
            kv_lens=jnp.full((shape.batch,), shape.context, jnp.int32),
            page_indices=jnp.asarray(pages, jnp.int32),
            num_seqs=jnp.array([shape.batch], jnp.int32),
        ),
    )


def work(shape: Shape, args) -> tuple[float, float]:
    """(K/V bytes needed, FLOPs) of the batch: keys visible to some row, and q.k plus p.v per visible pair."""
    window = args.sliding_window or shape.context
    positions = np.arange(shape.context - shape.q_len, shape.context)
    visible = np.minimum(positions + 1, window)
    first_needed = max(0, positions[0] - window + 1)
    keys_needed = shape.context - first_needed
    itemsize = jnp.dtype(args.dtype).itemsize
    kv_bytes = 2 * shape.batch * args.num_kv_heads * keys_needed * args.head_dim * itemsize
    flops = 4 * shape.batch * args.num_q_heads * args.head_dim * float(visible.sum())
    return kv_bytes, flops


def timeit(fn, *, warmup: int, iters: int, min_sample_s: float = 0.005) -> float:
    """Seconds per call: the median of ``iters`` samples, each as many back-to-back calls as fill
    ``min_sample_s`` (one wait at the end), so a short kernel is timed on the device rather than by the host's
    dispatch and wait of every call."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    start = time.perf_counter()
    jax.block_until_ready(fn())
    reps = max(1, min(200, math.ceil(min_sample_s / max(time.perf_counter() - start, 1e-9))))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready([fn() for _ in range(reps)])
        times.append((time.perf_counter() - start) / reps)
    return statistics.median(times)


def measure_peaks(args) -> tuple[float, float]:
    """(bytes/s, FLOP/s): a large elementwise copy (read + write) and a large matmul in the benchmark dtype."""
    n_bytes = args.peak_copy_mb * 2**20
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 2.0)
    bandwidth = 2 * n_bytes / timeit(lambda: copy(x), warmup=2, iters=5)
    n = args.peak_matmul_n
    a = jnp.ones((n, n), args.dtype)
    matmul = jax.jit(lambda u, v: u @ v)
    flops = 2 * n**3 / timeit(lambda: matmul(a, a), warmup=2, iters=5)
    return bandwidth, flops


def is_hopper() -> bool:
    """A CUDA device of compute capability 9.x (H100, H200): what the Mosaic GPU kernel (wgmma, TMA) runs on."""
    device = jax.devices()[0]
    return jax.default_backend() == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")


def backends(args) -> dict[str, callable]:
    platform = jax.default_backend()
    found = {"reference": ragged_paged_attention}
    if platform == "tpu" or args.interpret:
        found["pallas_tpu" + ("" if platform == "tpu" else "[interpret]")] = ragged_paged_attention_tpu
    if platform == "gpu" or args.interpret:
        found["pallas_gpu" + ("" if platform == "gpu" else "[interpret]")] = ragged_paged_attention_gpu
    if is_hopper() or args.interpret:
        found["pallas_mosaic_gpu" + ("" if platform == "gpu" else "[interpret]")] = ragged_paged_attention_mosaic_gpu
    wanted = set(filter(None, args.backends.split(","))) if args.backends else None
    return {k: v for k, v in found.items() if wanted is None or k.split("[")[0] in wanted}


def override(args) -> dict:
    fields = {f.name for f in dataclasses.fields(BlockSizes)}
    return {f: getattr(args, f) for f in fields if getattr(args, f, None) is not None}


def call(fn, name, batch, args, blocks):
    kwargs = dict(sm_scale=args.head_dim**-0.5, sliding_window=args.sliding_window, soft_cap=args.soft_cap)
    if name != "reference":
        kwargs.update(block_sizes=blocks or None, interpret="[interpret]" in name)
    return jax.jit(lambda b: fn(**b, **kwargs)), kwargs


def fractions(seconds, kv_bytes, flops, peaks) -> dict:
    """A timing as the figures the GPU kit records: time, K/V bandwidth and FLOP rate, each as a fraction of the
    measured peak."""
    bw, fl = kv_bytes / seconds, flops / seconds
    return dict(us=seconds * 1e6, gb_s=bw / 1e9, bw_frac=bw / peaks[0], tflop_s=fl / 1e12, flop_frac=fl / peaks[1])


def report(label, name, seconds, kv_bytes, flops, peaks, extra=""):
    bw, fl = kv_bytes / seconds, flops / seconds
    print(f"{label:26s} {name:27s} {seconds * 1e6:11.1f} us  {bw / 1e9:9.1f} GB/s ({100 * bw / peaks[0]:5.1f}%)"
          f"  {fl / 1e12:8.3f} TFLOP/s ({100 * fl / peaks[1]:5.1f}%) {extra}")


def parse_args(argv=None):
    """The options, with each shape list's default filled in."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode", help="BATCHxCONTEXT,... (default 8x1024,64x4096,256x2048; '' for none)")
    p.add_argument("--prefill", help="BATCHxCHUNKxCONTEXT,... (default 1x2048x2048,4x512x4096; '' for none)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--sliding-window", type=int)
    p.add_argument("--soft-cap", type=float)
    p.add_argument("--backends", help="comma list of reference,pallas_tpu,pallas_gpu,pallas_mosaic_gpu (default: all "
                                      "available; pallas_mosaic_gpu on Hopper only)")
    p.add_argument("--interpret", action="store_true", help="also run the kernels in interpret mode (slow)")
    for name in ("block_q", "block_kv", "kv_heads_per_block", "num_splits", "num_warps", "num_stages"):
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=int, help="block-size override")
    p.add_argument("--tune", action="store_true", help="sweep the block-size candidates, print the best per shape")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--peak-copy-mb", type=int, default=1024)
    p.add_argument("--peak-matmul-n", type=int, default=8192)
    p.add_argument("--quick", action="store_true", help="tiny shapes and few iterations (CPU smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        defaults = dict(decode="2x64,4x128", prefill="1x32x64")
        args.num_q_heads, args.num_kv_heads, args.head_dim = 4, 2, 64
        args.warmup, args.iters, args.peak_copy_mb, args.peak_matmul_n = 1, 3, 64, 512
    else:
        defaults = dict(decode="8x1024,64x4096,256x2048", prefill="1x2048x2048,4x512x4096")
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv=None):
    args = parse_args(argv)
    shapes = parse_shapes(args.decode, True) + parse_shapes(args.prefill, False)
    peaks = measure_peaks(args)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}); measured peak "
          f"{peaks[0] / 1e9:.1f} GB/s, {peaks[1] / 1e12:.2f} TFLOP/s ({args.dtype})")
    print(f"heads q/kv {args.num_q_heads}/{args.num_kv_heads}, head_dim {args.head_dim}, page_size {args.page_size},"
          f" window {args.sliding_window}, soft_cap {args.soft_cap}")
    rng = np.random.default_rng(0)
    for shape in shapes:
        batch = make_batch(shape, args, rng)
        kv_bytes, flops = work(shape, args)
        for name, fn in backends(args).items():
            sweep = [override(args)]
            if args.tune and name != "reference":
                backend = "tpu" if "tpu" in name else "mosaic_gpu" if "mosaic" in name else "gpu"
                mode = mode_for(batch["q"].shape[0], shape.batch)
                sweep = [dataclasses.asdict(c) for c in
                         candidates(backend, args.head_dim, args.page_size, args.dtype, mode)]
            best = None
            for blocks in sweep:
                try:
                    jitted, _ = call(fn, name, batch, args, blocks)
                    seconds = timeit(lambda: jitted(batch), warmup=args.warmup, iters=args.iters)
                except Exception as e:  # a candidate the compiler rejects (e.g. VMEM) is skipped, not fatal
                    print(f"{shape.label:26s} {name:27s} failed for {blocks}: {type(e).__name__}: {e}"[:300])
                    continue
                if args.tune and name != "reference":
                    report(shape.label, name, seconds, kv_bytes, flops, peaks, extra=str(blocks))
                if best is None or seconds < best[0]:
                    best = (seconds, blocks)
            if best is not None:
                report(shape.label, name + (" best" if args.tune and name != "reference" else ""), best[0],
                       kv_bytes, flops, peaks, extra=str(best[1]) if args.tune else "")


if __name__ == "__main__":
    main()
