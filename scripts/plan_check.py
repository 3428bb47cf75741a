"""Hold the capacity planner against the real server: calibrate, serve, measure, simulate, compare.

    python scripts/plan_check.py --model /path/to/model --rates 1,2 [--num-requests 48] [--prompt-len 16:256]
        [--output-len 32:64] [--port 18500] [--out-dir DIR] -- [engine flags, as serve's]

1. ``python -m jaxserve.plan calibrate`` times the engine's steps with the engine flags;
2. ``python -m jaxserve.serve`` starts with the same flags, and ``scripts/benchmark_serving.py`` measures it at
   each rate (OpenAI API, streaming, greedy, ``ignore_eos``);
3. ``python -m jaxserve.plan simulate`` predicts the same seeded workload at the same rates from the
   calibration;
4. a table of predicted and measured TTFT and TPOT p50 (and p99), with the relative error, goes to stdout and
   DIR/check.md.

Calibration and measurement run one after the other on the same machine: a machine whose load changes between
them moves both, so run this on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import bench_results  # noqa: E402


def run_json(cmd: list[str], env: dict) -> dict:
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}")
    text = done.stdout.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:  # a log line before the JSON
        return json.loads(text.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine_flags: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, engine_flags = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--rates", default="1,2")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--prompt-len", default="16:256")
    p.add_argument("--output-len", default="32:64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=18500)
    p.add_argument("--out-dir", type=Path, default=None)
    bench_results.add_arguments(p)
    args = p.parse_args(argv)
    figures = bench_results.Results(args)
    out = args.out_dir or Path(tempfile.mkdtemp(prefix="plan-check-"))
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    py = sys.executable
    chunk = "512"
    if "--max-num-batched-tokens" in engine_flags:
        chunk = engine_flags[engine_flags.index("--max-num-batched-tokens") + 1]

    steps = out / "steps.json"
    cmd = [py, "-m", "jaxserve.plan", "calibrate", "--model", args.model, "--out", str(steps), *engine_flags]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, env=env, check=True, cwd=ROOT)

    server = subprocess.Popen([py, "-m", "jaxserve.serve", "--model", args.model, "--host", "127.0.0.1",
                               "--http-port", str(args.port), "--grpc-port", str(args.port + 1), *engine_flags],
                              env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(out / "server.log", "w"))
    try:
        measured = run_json([py, "scripts/benchmark_serving.py", "--backend", "openai", "--port", str(args.port),
                             "--wait-ready", "900", "--num-requests", str(args.num_requests), "--prompt-len",
                             args.prompt_len, "--output-len", args.output_len, "--sweep-rates", args.rates,
                             "--seed", str(args.seed), "--json"], env)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    predicted = run_json([py, "-m", "jaxserve.plan", "simulate", "--steps", str(steps), "--rates", args.rates,
                          "--num-requests", str(args.num_requests), "--prompt-len", args.prompt_len, "--output-len",
                          args.output_len, "--seed", str(args.seed), "--chunks", chunk, "--no-search",
                          "--json"], env)
    (out / "measured.json").write_text(json.dumps(measured, indent=1))
    (out / "predicted.json").write_text(json.dumps(predicted, indent=1))

    lines = ["| rate (req/s) | TTFT p50 ms: predicted / measured (error) | TPOT p50 ms: predicted / measured (error) "
             "| TTFT p99 ms: predicted / measured | TPOT p99 ms: predicted / measured |",
             "| --- | --- | --- | --- | --- |"]
    worst = 0.0
    for m, s in zip(measured["runs"], predicted["results"]):
        cells = []
        for key in ("ttft", "tpot"):
            pred, real = s[f"{key}_p50_ms"], m[f"{key}_ms"]["p50"]
            err = (pred - real) / real
            worst = max(worst, abs(err))
            figures.add(f"rate {s['rate']:g}: {key.upper()} p50 error, predicted against measured", 100 * err, "%")
            cells.append(f"{pred:.0f} / {real:.0f} ({err:+.0%})" if key == "ttft" else
                         f"{pred:.1f} / {real:.1f} ({err:+.0%})")
        cells += [f"{s['ttft_p99_ms']:.0f} / {m['ttft_ms']['p99']:.0f}",
                  f"{s['tpot_p99_ms']:.1f} / {m['tpot_ms']['p99']:.1f}"]
        lines.append(f"| {s['rate']:g} | " + " | ".join(cells) + " |")
    calib = json.loads(steps.read_text())
    lines += ["", f"step model: decode {calib['decode']}, prompt {calib['prompt']} (features "
              f"{', '.join(calib['features'])}); fit's median relative error "
              f"{calib['fit_relative_error_median']:.1%} over {len(calib['samples'])} timed steps",
              f"largest p50 error: {worst:.0%}"]
    text = "\n".join(lines)
    (out / "check.md").write_text(text + "\n")
    print(text)
    figures.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
