"""One matrix product on XLA:CPU: the native dense kernel (``pallas_kernels.matmul``) against XLA's dot.

    PYTHONPATH=. python scripts/bench_dense.py [--shapes 48x576x1536,48x1536x576,512x576x1536] [--iters 40]
        [--rounds 2]

Each shape ``MxKxN`` is x f32[M, K] @ w f32[K, N]; ``--transposed`` also times the weight given as [N, K] (a tied
LM head's embedding), and bf16 weights are timed too. Prints the median microseconds of ``--iters`` calls and
GFLOP/s per variant, each round alternating the two products, and the largest difference from XLA's result.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.matmul import dense, native


def median_us(fn, args, iters: int) -> float:
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1x576x1536,8x576x1536,48x576x1536,48x1536x576,48x576x576,128x576x1536,"
                                       "512x576x1536,48x576x49152")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if not native.available():
        raise SystemExit("the native dense kernel could not be built here (see the log line above)")
    rng = np.random.default_rng(0)
    xla = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
    xla_t = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32))
    ours = jax.jit(lambda x, w: dense(x, w))
    ours_t = jax.jit(lambda x, w: dense(x, w, transposed=True))
    for shape in args.shapes.split(","):
        m, k, n = map(int, shape.split("x"))
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
        wt = jnp.asarray(np.asarray(w).T.copy())
        wb, wtb = w.astype(jnp.bfloat16), wt.astype(jnp.bfloat16)
        diff = float(jnp.max(jnp.abs(ours(x, w) - xla(x, w))))
        flops = 2 * m * k * n
        for r in range(args.rounds):
            cells = []
            for name, a, b in (("f32", (xla, (x, w)), (ours, (x, w))),
                               ("f32 [N,K]", (xla_t, (x, wt)), (ours_t, (x, wt))),
                               ("bf16 w", (xla, (x, wb)), (ours, (x, wb))),
                               ("bf16 w [N,K]", (xla_t, (x, wtb)), (ours_t, (x, wtb)))):
                t_xla, t_ours = median_us(*a, args.iters), median_us(*b, args.iters)
                cells.append(f"{name}: xla {t_xla:.0f} us ({flops / t_xla / 1e3:.0f} GF/s), native {t_ours:.0f} us "
                             f"({flops / t_ours / 1e3:.0f} GF/s)")
            print(f"{shape} round {r + 1}: " + " | ".join(cells) + f" | max diff {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
