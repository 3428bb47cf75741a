"""Run one seeded workload on several meshes and compare throughput, TTFT and TPOT.

    python scripts/mesh_sweep.py --model PATH --meshes "tensor=8;data=2,tensor=4;data=2,tensor=2,sequence=2"

Each mesh runs in its own process (a fresh compiler and device set; on CPU ``--cpu-devices`` emulated devices)
after a full warm-up, on the same requests: ``--num-prompts`` random-token prompts with lengths uniform in
``input_len * [1 - spread, 1 + spread]``, ``--output-len`` greedy tokens each (EOS ignored), arriving all at
once or as a Poisson stream of ``--request-rate`` per second. A mesh smaller than the machine uses its first
devices (``num_devices``). Writes ``sweep.md``, ``sweep.csv`` and ``sweep.png`` (matplotlib, the ``bench``
extra) to ``--out``; the ``same tokens`` column checks that every mesh generated what the first one did.

A mesh that fails (one the model or the machine refuses, e.g. ``tensor=3`` over 4 heads) keeps its row in the
table, the CSV (``error``) and the plot, saying why in one line; the other meshes still run, and the script
then exits with code 1.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import bench_results  # noqa: E402

COLUMNS = ["mesh", "devices", "requests", "output_tokens", "wall_s", "output_tok_s", "total_tok_s", "ttft_mean_ms",
           "ttft_p50_ms", "ttft_p99_ms", "tpot_mean_ms", "tpot_p50_ms", "warmup_s", "tokens_sha", "error"]
FAILED = "FAILED "  # a child's one line for a mesh it could not run, before its reason


def workload(args) -> tuple[list[list[int]], list[float]]:
    """Seeded prompts (token ids) and arrival offsets in seconds."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    lo = max(1, int(args.input_len * (1 - args.spread)))
    hi = max(lo, int(args.input_len * (1 + args.spread)))
    lens = rng.integers(lo, hi + 1, args.num_prompts)
    prompts = [rng.integers(args.min_token_id, args.vocab_limit, n).tolist() for n in lens]
    if args.request_rate > 0:
        arrivals = np.cumsum(rng.exponential(1.0 / args.request_rate, args.num_prompts)).tolist()
    else:
        arrivals = [0.0] * args.num_prompts
    return prompts, arrivals


def run_one(args, mesh: str) -> dict:
    import numpy as np

    from jaxserve import LLM, SamplingParams
    from sharding.config import MeshConfig

    devices = MeshConfig.parse(mesh).num_devices
    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, page_size=args.page_size, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
              num_pages=args.num_pages, mesh=mesh, num_devices=devices, warmup=True, compilation_cache_dir=None)
    warmup = time.perf_counter() - start
    engine = llm.engine
    args.vocab_limit = min(args.vocab_limit or engine.model_config.vocab_size, engine.model_config.vocab_size)
    prompts, arrivals = workload(args)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    done, pending = {}, list(range(len(prompts)))
    t0 = time.monotonic()
    while pending or engine.has_unfinished():
        now = time.monotonic() - t0
        while pending and arrivals[pending[0]] <= now:
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], params, arrival_time=t0 + arrivals[i])
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[pending[0]] - (time.monotonic() - t0)))
            continue
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
    wall = time.monotonic() - t0
    outs = [done[i] for i in range(len(prompts))]
    ttft = np.array([o.metrics.first_token_time - o.metrics.arrival_time for o in outs]) * 1e3
    tpot = np.array([(o.metrics.finished_time - o.metrics.first_token_time) / max(1, len(o.outputs[0].token_ids) - 1)
                     for o in outs]) * 1e3
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(p) for p in prompts)
    sha = hashlib.sha256(json.dumps([o.outputs[0].token_ids for o in outs]).encode()).hexdigest()[:12]
    return {
        "mesh": mesh, "devices": devices, "requests": len(outs), "output_tokens": out_tokens,
        "wall_s": round(wall, 3), "output_tok_s": round(out_tokens / wall, 1),
        "total_tok_s": round((out_tokens + in_tokens) / wall, 1),
        "ttft_mean_ms": round(float(ttft.mean()), 1), "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1),
        "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 1), "tpot_mean_ms": round(float(tpot.mean()), 2),
        "tpot_p50_ms": round(float(np.percentile(tpot, 50)), 2), "warmup_s": round(warmup, 1), "tokens_sha": sha,
    }


def failed_row(mesh: str, reason: str) -> dict:
    """The row of a mesh that did not run: its name and why, in one line."""
    from sharding.config import MeshConfig

    try:
        devices = MeshConfig.parse(mesh).num_devices
    except ValueError:
        devices = "?"
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    return {"mesh": mesh, "devices": devices, "error": lines[-1] if lines else "failed with no message"}


def child_row(mesh: str, returncode: int, stdout: str, stderr: str) -> dict:
    """A child's result row, or its failed row: the reason it printed (``FAILED ...``), else the last line of
    its stderr (an unexpected failure's exception) and its exit code."""
    for line in stdout.splitlines():
        if line.startswith("RESULT ") and returncode == 0:
            return json.loads(line[len("RESULT "):])
        if line.startswith(FAILED):
            return failed_row(mesh, line[len(FAILED):])
    last = [line for line in stderr.splitlines() if line.strip()]
    return failed_row(mesh, f"exit code {returncode}: {last[-1].strip() if last else 'no output'}")


def markdown(rows: list[dict], header: str) -> str:
    ran = [r for r in rows if not r.get("error")]
    first = ran[0]["tokens_sha"] if ran else None
    lines = [header, "", "| mesh | devices | output tok/s | total tok/s | TTFT mean / p50 / p99 (ms) | "
             "TPOT mean / p50 (ms) | wall (s) | warm-up (s) | same tokens |", "| --- " * 9 + "|"]
    for r in rows:
        if r.get("error"):
            reason = r["error"].replace("|", "\\|")
            lines.append(f"| `{r['mesh']}` | {r['devices']} | failed: {reason} |" + " — |" * 6)
            continue
        lines.append(f"| `{r['mesh']}` | {r['devices']} | {r['output_tok_s']} | {r['total_tok_s']} | "
                     f"{r['ttft_mean_ms']} / {r['ttft_p50_ms']} / {r['ttft_p99_ms']} | "
                     f"{r['tpot_mean_ms']} / {r['tpot_p50_ms']} | {r['wall_s']} | {r['warmup_s']} | "
                     f"{'yes' if r['tokens_sha'] == first else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["mesh"].replace(",", "\n") for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(4 + 1.6 * len(rows), 4.2))
    for ax, key, label in zip(axes, ("output_tok_s", "ttft_mean_ms", "tpot_mean_ms"),
                              ("throughput (output tok/s)", "TTFT mean (ms)", "TPOT mean (ms)")):
        ax.bar(names, [0 if r.get("error") else r[key] for r in rows], color="tab:blue")
        for i, r in enumerate(rows):  # a failed mesh keeps its place, marked, with its reason below the plot
            if r.get("error"):
                ax.text(i, 0, "failed", rotation=90, ha="center", va="bottom", color="tab:red", fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    failures = [f"{r['mesh']} failed: {r['error']}" for r in rows if r.get("error")]
    if failures:
        text = "\n".join(f if len(f) <= 150 else f[:147] + "..." for f in failures)
        fig.text(0.01, 0.01, text, fontsize=7, color="tab:red", va="bottom")
        fig.subplots_adjust(bottom=0.2 + 0.04 * len(failures))
    fig.suptitle(title, fontsize=10)
    if not failures:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_child(args, mesh: str) -> None:
    """``--one MESH``: run it and print its ``RESULT`` line; a mesh the model or the machine refuses (a
    ``ValueError``, e.g. heads that do not divide over ``tensor``) prints ``FAILED`` and its reason instead, with
    no traceback, and exits 1."""
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        row = run_one(args, mesh)
    except ValueError as e:
        print(FAILED + (" ".join(str(e).split()) or type(e).__name__), flush=True)
        sys.exit(1)
    print("RESULT " + json.dumps(row), flush=True)


def write_outputs(rows: list[dict], args, header: str) -> int:
    """sweep.md, sweep.csv and sweep.png (failed meshes included, each saying why), the results' figures; returns
    the exit code: 1 when any mesh failed."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.md").write_text(markdown(rows, header))
    with open(out / "sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    try:
        plot(rows, out / "sweep.png", header if len(header) < 120 else header[:117] + "...")
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
    print(markdown(rows, header))
    figures = bench_results.Results(args)
    for row in rows:
        if not row.get("error"):
            figures.add(f"{row['mesh']}: output tok/s", row["output_tok_s"], "tok/s")
    figures.save()
    print(f"wrote {out / 'sweep.md'}, {out / 'sweep.csv'}, {out / 'sweep.png'}", file=sys.stderr)
    failed = [r["mesh"] for r in rows if r.get("error")]
    if failed:
        print(f"{len(failed)} of {len(rows)} meshes failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint folder or hub id (default: the demo model)")
    parser.add_argument("--meshes", required=True, help='";"-separated mesh specs, e.g. "tensor=8;data=2,tensor=4"')
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--spread", type=float, default=0.5, help="prompt lengths vary by +- this fraction")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=0.0, help="requests per second (0: all at once)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-token-id", type=int, default=3, help="random prompt ids start here (skip specials)")
    parser.add_argument("--vocab-limit", type=int, default=None, help="random prompt ids stay below this")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--cpu-devices", type=int, default=8, help="emulated devices per run when on CPU")
    parser.add_argument("--out", default="mesh_sweep_results", help="folder for sweep.md / .csv / .png")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: run one mesh, print JSON
    bench_results.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.model is None:
        from jaxserve.models.demo import demo_model_path

        args.model = str(demo_model_path())
    if args.max_model_len is None:
        args.max_model_len = int(args.input_len * (1 + args.spread)) + args.output_len + 1

    if args.one is not None:
        run_child(args, args.one)
        return 0

    meshes = [m.strip() for m in args.meshes.split(";") if m.strip()]
    rows = []
    for mesh in meshes:
        env = dict(os.environ)
        if env.get("JAX_PLATFORMS", "cpu") == "cpu":
            env["JAX_PLATFORMS"] = "cpu"
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.cpu_devices}"
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--one", mesh]
        print(f"running {mesh} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        rows.append(child_row(mesh, proc.returncode, proc.stdout, proc.stderr))
        if rows[-1].get("error"):
            print(f"  failed: {rows[-1]['error']}", file=sys.stderr, flush=True)
        else:
            print(f"  {rows[-1]['output_tok_s']} output tok/s, TTFT {rows[-1]['ttft_mean_ms']} ms, "
                  f"TPOT {rows[-1]['tpot_mean_ms']} ms", file=sys.stderr, flush=True)
    rate = f"{args.request_rate}/s" if args.request_rate > 0 else "all at once"
    header = (f"{args.model}: {args.num_prompts} prompts of ~{args.input_len} tokens (+-{args.spread:.0%}), "
              f"{args.output_len} output tokens, arrivals {rate}, seed {args.seed}, max_num_seqs {args.max_num_seqs}, "
              f"max_num_batched_tokens {args.max_num_batched_tokens}")
    return write_outputs(rows, args, header)


if __name__ == "__main__":
    sys.exit(main())
