"""One decoder layer's matrix products, fp32 against bf16, under XLA options, and separate against fused (QKV,
gate/up) weights; on XLA:CPU by default, on a GPU with ``--platform cuda``.

    python scripts/bench_layer_dots.py [--preset smollm-135m] [--rows 48,512] \
        [--settings="default;--xla_cpu_use_onednn=true"]
    python scripts/bench_layer_dots.py --platform cuda --preset llama-3.1-8b --rows 1,64 --dtypes bfloat16

Each XLA_FLAGS setting runs in its own process (XLA reads its options once); the settings alternate over
``--rounds`` so a shared machine's slow spells fall on all of them. Each line: setting, rows, dtype, layout,
median microseconds of one layer's products (q, k, v, o, gate, up, down; bf16 as bf16 x bf16 -> fp32, as
``jaxserve.models.layers.matmul_f32``) over ``--iters`` calls of a jitted loop over 8 layers' weights, and
the weights' bytes read per second (the bound of a small-row step). Weights are drawn on the device.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def child(preset: str, rows: list[int], iters: int, dtypes: list[str]) -> None:
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
    shapes = {"q": (c, q), "k": (c, kv), "v": (c, kv), "o": (q, c), "g": (c, m), "u": (c, m), "d": (m, c)}

    def dot(x, wt):
        return jnp.dot(x, wt, preferred_element_type=jnp.float32).astype(x.dtype)

    def layer_sep(x, wl):
        a = dot(x, wl["q"]) + jnp.pad(dot(x, wl["k"]) + dot(x, wl["v"]), ((0, 0), (0, q - kv)))
        x = x + dot(a, wl["o"])
        return x + dot(jax.nn.silu(dot(x, wl["g"])) * dot(x, wl["u"]), wl["d"])

    def layer_fused(x, wl):
        y = dot(x, wl["qkv"])
        a = y[:, :q] + jnp.pad(y[:, q:q + kv] + y[:, q + kv:], ((0, 0), (0, q - kv)))
        x = x + dot(a, wl["o"])
        gu = dot(x, wl["gu"])
        return x + dot(jax.nn.silu(gu[:, :m]) * gu[:, m:], wl["d"])

    def stack(layer):  # each layer's weights are arrays of their own, as the engine holds them (no slicing)
        def run(x, ws):
            for wl in ws:
                x = layer(x, wl)
            return x
        return run

    run_sep, run_fused = stack(layer_sep), stack(layer_fused)

    def draw(dtype):  # per layer, dt[*shape] each, separate and fused (the fused ones are concatenations)
        sep, fused = [], []
        for i in range(layers):
            keys = jax.random.split(jax.random.key(i), len(shapes))
            w = {n: (0.02 * jax.random.normal(k, s, jnp.float32)).astype(dtype)
                 for k, (n, s) in zip(keys, shapes.items())}
            sep.append(w)
            fused.append({"qkv": jnp.concatenate([w["q"], w["k"], w["v"]], -1), "o": w["o"],
                          "gu": jnp.concatenate([w["g"], w["u"]], -1), "d": w["d"]})
        return sep, fused

    rng = np.random.default_rng(0)
    for dtype in [jnp.dtype(d) for d in dtypes]:
        sep, fused = draw(dtype)
        layer_bytes = sum(a.nbytes for a in sep[0].values())
        for r in rows:
            for name, fn, wd in (("separate", run_sep, sep), ("fused", run_fused, fused)):
                x = jnp.asarray(rng.standard_normal((r, c), np.float32), dtype)
                f = jax.jit(fn)
                f(x, wd).block_until_ready()
                times = []
                for _ in range(iters):
                    t = time.perf_counter()
                    f(x, wd).block_until_ready()
                    times.append(time.perf_counter() - t)
                us = 1e6 * float(np.median(times)) / layers
                print(json.dumps({"rows": r, "dtype": dtype.name, "layout": name, "us_per_layer": us,
                                  "weight_gb_s": layer_bytes / us / 1e3}), flush=True)
        del sep, fused


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="smollm-135m")
    p.add_argument("--rows", default="48,512")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--settings", default="default", help="';'-separated XLA_FLAGS values ('default': none)")
    p.add_argument("--platform", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    rows = [int(x) for x in args.rows.split(",")]
    if args.child:
        child(args.preset, rows, args.iters, args.dtypes.split(","))
        return
    results: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for flags in ["" if f == "default" else f for f in args.settings.split(";")]:
            env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS=args.platform)
            proc = subprocess.run([sys.executable, __file__, "--child", "--preset", args.preset, "--rows", args.rows,
                                   "--iters", str(args.iters), "--dtypes", args.dtypes],
                                  env=env, capture_output=True, text=True)
            if proc.returncode:
                print(f"[{flags}] failed: {proc.stderr[-1500:]}", file=sys.stderr)
                continue
            for line in proc.stdout.splitlines():
                if line.startswith("{"):
                    r = json.loads(line)
                    key = (flags, r["rows"], r["dtype"], r["layout"])
                    results.setdefault(key, []).append((r["us_per_layer"], r["weight_gb_s"]))
    for (flags, r, dtype, layout), runs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
        us, gbs = min(runs)
        listed = ", ".join(f"{u:.1f}" for u, _ in runs)
        print(f"[{flags or 'default'}] rows {r} {dtype} {layout}: {us:.1f} us/layer, weights at {gbs:.0f} GB/s "
              f"(runs {listed})")


if __name__ == "__main__":
    main()
