"""Where a decode step's time goes: time one decode shape of a dummy-weight model, then list its device kernels.

    python scripts/profile_decode.py --out DIR [--batch 1] [--context 1024] [--steps 64] [--trace]
        [--attention-backend auto] [--fuse-projections auto|on|off] [--tiny]

The model is the GPU kit's Llama-3.1-8B shape in bf16 (``--tiny``: its 2-layer, 128-wide stand-in, for a check on
CPU), weights drawn on the device (``load_format="dummy"``). The script times ``--steps`` back-to-back decode steps
of ``--batch`` sequences with ``--context`` cached tokens each (each step waits for the last one's cache writes,
not for the host), and with ``--trace`` profiles a few more (jax.profiler, perfetto trace) and reads the device's
kernels from it: how many run per step, their summed time per step, and the costliest by name. It prints one JSON
line and writes it to ``DIR/profile_decode.json``.

``XLA_FLAGS`` from the environment apply and are recorded, so flag settings are compared by running the script once
per setting. While a profile is active XLA runs op by op (no command buffers), so the trace's kernel times are
the kernels' own and its gaps are not the timed run's: the timed figure comes from the untraced steps.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import LLAMA_8B, TINY_LLAMA  # noqa: E402  (the kit's model shapes)


def device_kernels(trace_path: Path) -> tuple[list[tuple[str, float]], list[str]]:
    """(name, microseconds) of every kernel the perfetto trace puts on a GPU, in trace order; the trace's
    process names."""
    with gzip.open(trace_path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid for pid, name in names.items() if "GPU" in name or "/device:" in name}
    return [(e["name"], float(e.get("dur", 0.0))) for e in events
            if e.get("ph") == "X" and e.get("pid") in devices], sorted(names.values())


def summarize(kernels: list[tuple[str, float]], steps: int, wall_s: float, top: int = 25) -> dict:
    """Kernels per step, their time per step against the step's wall time, and the ``top`` costliest names."""
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for name, us in kernels:
        by_name[name].append(us)
    busy_us = sum(us for _, us in kernels) / steps
    costliest = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "kernels_per_step": len(kernels) / steps,
        "kernel_us_per_step": busy_us,
        "kernel_share_of_wall": busy_us * 1e-6 / wall_s if wall_s else None,
        "top": [{"name": name[:160], "calls_per_step": len(us) / steps, "us_per_step": sum(us) / steps,
                 "share": sum(us) / steps / busy_us if busy_us else None} for name, us in costliest],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--trace-steps", type=int, default=8)
    p.add_argument("--trace", action="store_true")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--fuse-projections", default="auto", choices=("auto", "on", "off"),
                   help="one weight for Q/K/V and one for gate/up (EngineConfig.fuse_projections)")
    p.add_argument("--tiny", action="store_true", help="the kit's 2-layer stand-in (a check on CPU)")
    args = p.parse_args(argv)
    for name in ("batch", "context", "steps", "trace_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")

    import jax

    from jaxserve.config.engine import EngineConfig
    from jaxserve.engine.engine import Engine
    from jaxserve.executor.batch import StepKind

    hf = TINY_LLAMA if args.tiny else LLAMA_8B
    args.out.mkdir(parents=True, exist_ok=True)
    page = 16
    per_seq = -(-(args.context + 8) // page)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(hf))
        engine = Engine(EngineConfig(
            model=tmp, load_format="dummy", dtype="bfloat16", page_size=page, num_pages=args.batch * per_seq + 8,
            # At least 2 slots, as a serving engine has: a GPU decodes one sequence in its two-row bucket
            # (shapes.decode_floor), which an engine of one slot caps at one row.
            max_num_seqs=max(args.batch, 2), max_num_batched_tokens=max(args.batch, 16),
            max_model_len=args.context + 8,
            warmup=False, compilation_cache_dir=None, enable_prefix_caching=False,
            attention_backend=args.attention_backend, fuse_projections=args.fuse_projections))
    executor = engine.executor
    runner = executor.runner
    pool = engine.scheduler.block_manager.pool
    tables = [pool.allocate(-(-(args.context + 1) // page)) for _ in range(args.batch)]
    batch = executor.make_batch([[5]] * args.batch, [args.context + 1] * args.batch, tables, kind=StepKind.DECODE)

    def steps(n: int) -> float:
        start = time.perf_counter()
        jax.block_until_ready([runner.run(StepKind.DECODE, batch).greedy_ids for _ in range(n)])
        return (time.perf_counter() - start) / n

    steps(2)  # compile and warm
    wall = min(steps(args.steps) for _ in range(3))
    result = {"device": jax.devices()[0].device_kind, "backend": runner.backend.name,
              "fused_projections": executor.weights.fused, "batch": args.batch,
              "rows": batch.shape_fields()[1],  # the decode bucket the batch ran in
              "context": args.context, "xla_flags": os.environ.get("XLA_FLAGS", ""), "step_ms": wall * 1e3,
              "tok_s": args.batch / wall}
    if args.trace:
        trace_dir = Path(tempfile.mkdtemp())
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            traced = steps(args.trace_steps)
        found = sorted(trace_dir.rglob("perfetto_trace.json.gz"))
        if not found:
            raise SystemExit(f"no perfetto trace under {trace_dir}")
        result["traced_step_ms"] = traced * 1e3
        kernels, processes = device_kernels(found[-1])
        result["trace_processes"] = processes
        result.update(summarize(kernels, args.trace_steps, wall))
    line = json.dumps(result)
    (args.out / "profile_decode.json").write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
