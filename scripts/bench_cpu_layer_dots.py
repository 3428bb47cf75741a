"""One decoder layer's matrix products on XLA:CPU, fp32 against bf16, under XLA:CPU options, and separate
against fused (QKV, gate/up) weights.

    python scripts/bench_cpu_layer_dots.py [--preset smollm-135m] [--rows 48,512] \
        [--settings="default;--xla_cpu_use_onednn=true"]

Each XLA_FLAGS setting runs in its own process (XLA reads its options once); the settings alternate over
``--rounds`` so a shared machine's slow spells fall on all of them. Each line: setting, rows, dtype, layout,
median microseconds of one layer's products (q, k, v, o, gate, up, down; bf16 as bf16 x bf16 -> fp32, as
``jaxserve.models.layers.matmul_f32``) over ``--iters`` calls of a jitted loop over 8 layers' weights.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def child(preset: str, rows: list[int], iters: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from benchmark_offline import PRESETS

    cfg = PRESETS[preset]
    c, m = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim", c // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    layers = 8
    rng = np.random.default_rng(0)
    w = lambda *s: rng.standard_normal((layers, *s), np.float32) * 0.02  # noqa: E731
    sep = {"q": w(c, q), "k": w(c, kv), "v": w(c, kv), "o": w(q, c), "g": w(c, m), "u": w(c, m), "d": w(m, c)}
    fused = {"qkv": np.concatenate([sep["q"], sep["k"], sep["v"]], -1), "o": sep["o"],
             "gu": np.concatenate([sep["g"], sep["u"]], -1), "d": sep["d"]}

    def dot(x, wt):
        return jnp.dot(x, wt, preferred_element_type=jnp.float32).astype(x.dtype)

    def run_sep(x, ws):
        def body(x, wl):
            a = dot(x, wl["q"]) + jnp.pad(dot(x, wl["k"]) + dot(x, wl["v"]), ((0, 0), (0, q - kv)))
            x = x + dot(a, wl["o"])
            return x + dot(jax.nn.silu(dot(x, wl["g"])) * dot(x, wl["u"]), wl["d"]), None
        return jax.lax.scan(body, x, ws, unroll=True)[0]

    def run_fused(x, ws):
        def body(x, wl):
            y = dot(x, wl["qkv"])
            a = y[:, :q] + jnp.pad(y[:, q:q + kv] + y[:, q + kv:], ((0, 0), (0, q - kv)))
            x = x + dot(a, wl["o"])
            gu = dot(x, wl["gu"])
            return x + dot(jax.nn.silu(gu[:, :m]) * gu[:, m:], wl["d"]), None
        return jax.lax.scan(body, x, ws, unroll=True)[0]

    for r in rows:
        for dtype in (jnp.float32, jnp.bfloat16):
            for name, fn, ws in (("separate", run_sep, sep), ("fused", run_fused, fused)):
                wd = jax.tree.map(lambda a: jnp.asarray(a, dtype), ws)
                x = jnp.asarray(rng.standard_normal((r, c), np.float32), dtype)
                f = jax.jit(fn)
                f(x, wd).block_until_ready()
                times = []
                for _ in range(iters):
                    t = time.perf_counter()
                    f(x, wd).block_until_ready()
                    times.append(time.perf_counter() - t)
                print(json.dumps({"rows": r, "dtype": jnp.dtype(dtype).name, "layout": name,
                                  "us_per_layer": 1e6 * float(np.median(times)) / layers}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="smollm-135m")
    p.add_argument("--rows", default="48,512")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--settings", default="default", help="';'-separated XLA_FLAGS values ('default': none)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    rows = [int(x) for x in args.rows.split(",")]
    if args.child:
        child(args.preset, rows, args.iters)
        return
    results: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for flags in ["" if f == "default" else f for f in args.settings.split(";")]:
            env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
            proc = subprocess.run([sys.executable, __file__, "--child", "--preset", args.preset, "--rows", args.rows,
                                   "--iters", str(args.iters)], env=env, capture_output=True, text=True)
            if proc.returncode:
                print(f"[{flags}] failed: {proc.stderr[-1500:]}", file=sys.stderr)
                continue
            for line in proc.stdout.splitlines():
                if line.startswith("{"):
                    r = json.loads(line)
                    results.setdefault((flags, r["rows"], r["dtype"], r["layout"]), []).append(r["us_per_layer"])
    for (flags, r, dtype, layout), us in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
        runs = ", ".join(f"{u:.0f}" for u in us)
        print(f"[{flags or 'default'}] rows {r} {dtype} {layout}: {min(us):.0f} us/layer (runs {runs})")


if __name__ == "__main__":
    main()
