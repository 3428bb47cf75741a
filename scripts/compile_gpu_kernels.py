"""Compile the GPU kernels for an NVIDIA target without a GPU: lower with JAX, compile with Triton.

Two steps, because the Triton compiler need not live in the serving environment:

  PYTHONPATH=. python scripts/compile_gpu_kernels.py dump /tmp/ttir      # any jax, CPU is enough
  /path/to/env-with-triton/bin/python scripts/compile_gpu_kernels.py compile /tmp/ttir [--arch 90]

``dump`` lowers the attention and KV-write kernels at serving shapes (head_dim 128, page_size 16, bf16 and
fp32, decode / prefill / large-batch decode) for CUDA and writes each Triton IR module as text with its launch
parameters. ``compile`` runs Triton's pipeline down to a cubin and reports shared memory, registers and spills
(via the ``ptxas`` that Triton ships). jaxlib compiles with its own Triton build, so this checks the kernels
against a public Triton release, not the exact one a jax GPU wheel uses.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dump(out_dir: str) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    from jax._src.lib import triton as triton_lib
    from jax._src.lib.mlir import ir

    from pallas_kernels.kv_cache_update import write_kv_gpu
    from pallas_kernels.ragged_paged_attention import AttentionMetadata, ragged_paged_attention_gpu

    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    os.makedirs(out_dir, exist_ok=True)
    cases = []
    for dtype in ("bfloat16", "float32"):
        for tokens, slots, window, cap in ((8, 8, None, None), (256, 8, 64, 30.0), (64, 64, None, None)):
            md = AttentionMetadata(sds((slots + 1,), i32), sds((slots,), i32), sds((slots, 64), i32), sds((1,), i32))
            shapes = (sds((tokens, 32, 128), dtype), sds((8, 512, 16, 128), dtype), sds((8, 512, 16, 128), dtype), md)
            fn = jax.jit(lambda *a, w=window, c=cap: ragged_paged_attention_gpu(*a, sm_scale=0.088, sliding_window=w,
                                                                                soft_cap=c))
            cases.append((f"attention_{dtype}_t{tokens}_s{slots}", fn, shapes))
        write_shapes = (shapes[1], shapes[2], sds((256, 8, 128), dtype), sds((256, 8, 128), dtype), shapes[3])
        cases.append((f"write_kv_{dtype}", jax.jit(write_kv_gpu), write_shapes))

    def triton_calls(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    attrs = inner.operation.attributes
                    if inner.operation.name == "stablehlo.custom_call" and "mhlo.backend_config" in attrs:
                        yield ir.DictAttr(attrs["mhlo.backend_config"])
                    yield from triton_calls(inner.operation)

    for name, fn, shapes in cases:
        module = fn.trace(*shapes).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
        for n, config in enumerate(triton_calls(module.operation)):
            launch = {k: ir.IntegerAttr(config[k]).value for k in ("num_warps", "num_stages", "grid_x", "grid_y",
                                                                   "grid_z") if k in config}
            context = ir.Context()
            triton_lib.dialect.register_dialect(context)
            with context:
                text = str(ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes))
            path = os.path.join(out_dir, f"{name}_{n}.ttir")
            with open(path, "w") as f:
                f.write(text)
            with open(path + ".json", "w") as f:
                json.dump(launch, f)
            print(path, launch)


def compile_all(in_dir: str, arch: int) -> int:
    import triton
    from triton.backends.compiler import GPUTarget

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    failures = 0
    for path in sorted(glob.glob(os.path.join(in_dir, "*.ttir"))):
        with open(path + ".json") as f:
            launch = json.load(f)
        name = os.path.basename(path)
        try:
            kernel = triton.compile(path, target=GPUTarget("cuda", arch, 32),
                                    options=dict(num_warps=launch["num_warps"], num_stages=launch["num_stages"]))
        except Exception as e:  # report every kernel, then fail
            failures += 1
            print(f"{name}: FAILED {type(e).__name__}: {e}")
            continue
        ptx = path + ".ptx"
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        usage = "ptxas not run"
        for ptxas in sorted(glob.glob(os.path.join(bin_dir, "ptxas*"))):
            result = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", ptx, "-o", os.devnull],
                                    capture_output=True, text=True)
            if result.returncode == 0:
                usage = " | ".join(line.split(":", 1)[-1].strip() for line in result.stderr.splitlines()
                                   if "registers" in line or "spill" in line)
                break
        print(f"{name}: ok, shared {kernel.metadata.shared} B, {usage}")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["dump", "compile"])
    parser.add_argument("dir")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100")
    args = parser.parse_args()
    if args.step == "dump":
        dump(args.dir)
    else:
        sys.exit(1 if compile_all(args.dir, args.arch) else 0)


if __name__ == "__main__":
    main()
