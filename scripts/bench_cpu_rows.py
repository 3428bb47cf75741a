"""Time the CPU decode attention alone: the native kernel against the pure-JAX walk, on one decode batch.

Both programs are compiled in one process and timed in alternation (``--rounds`` rounds of ``--calls`` calls
each), so a shared machine's load falls on both alike; the medians of the per-round medians are printed.

  PYTHONPATH=. python scripts/bench_cpu_rows.py                           # the host benchmark's tiny model
  PYTHONPATH=. python scripts/bench_cpu_rows.py --rows 48 --kv-len 300 --kv-heads 8 --group 2 --head-dim 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.ragged_paged_attention import AttentionMetadata, native, ragged_paged_attention_rows  # noqa: E402


def decode_batch(rows: int, kv_len: int, kv_heads: int, group: int, head_dim: int, page_size: int, dtype):
    """``rows`` sequences of ``kv_len`` keys (+-15%), pages shuffled over a pool with room to spare."""
    rng = np.random.default_rng(0)
    lens = np.clip(rng.integers(int(kv_len * 0.85), int(kv_len * 1.15) + 1, rows), 1, None).astype(np.int32)
    width = -(-int(lens.max()) // page_size) + 1
    num_pages = rows * width + 8
    pages = rng.permutation(num_pages)[: rows * width].reshape(rows, width).astype(np.int32)
    shape = (kv_heads, num_pages, page_size, head_dim)
    k, v = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((rows, kv_heads * group, head_dim)), jnp.float32)
    md = AttentionMetadata(jnp.arange(rows + 1, dtype=jnp.int32), jnp.asarray(lens), jnp.asarray(pages),
                           jnp.array([rows], jnp.int32))
    return q, k, v, md


def compiled(use_native: bool, args):
    os.environ[native.SWITCH] = "1" if use_native else "0"
    fn = jax.jit(lambda q, k, v, md: ragged_paged_attention_rows(q, k, v, md, sm_scale=0.125))
    program = fn.lower(*args).compile()
    assert (native.TARGET in program.as_text()) == use_native, "the switch did not pick the path asked for"
    return program


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--kv-len", type=int, default=85)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--group", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    batch = decode_batch(args.rows, args.kv_len, args.kv_heads, args.group, args.head_dim, args.page_size,
                         jnp.dtype(args.dtype))
    programs = {"walk": compiled(False, batch), "native": compiled(True, batch)}
    np.testing.assert_allclose(np.asarray(programs["native"](*batch)), np.asarray(programs["walk"](*batch)),
                               rtol=1e-4, atol=1e-4)
    medians = {name: [] for name in programs}
    for _ in range(args.rounds):
        for name, program in programs.items():
            jax.block_until_ready(program(*batch))
            times = []
            for _ in range(args.calls):
                start = time.perf_counter()
                jax.block_until_ready(program(*batch))
                times.append(time.perf_counter() - start)
            medians[name].append(statistics.median(times))
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"rows={args.rows} kv_len~{args.kv_len} kv_heads={args.kv_heads} group={args.group} "
          f"head_dim={args.head_dim} page_size={args.page_size} {args.dtype}  load {load}")
    for name, values in medians.items():
        print(f"  {name:>6}: median {statistics.median(values) * 1e3:.3f} ms, best round {min(values) * 1e3:.3f} ms "
              f"({args.rounds} rounds x {args.calls} calls)")


if __name__ == "__main__":
    main()
