"""What compiling step shapes in the background costs and buys a server: ready time, serving while shapes compile,
serving once all are compiled, and how fast SIGTERM stops it.

    python scripts/bench_background_compile.py --out DIR [--preset llama-1b|tiny] [--modes off,on]
        [--num-requests 96 --prompt-len 128:512 --output-len 128 --max-concurrency 32] [-- serve flags...]

For each mode the server (``python -m jaxserve.serve``, dummy weights from a config.json alone, compilation cache
off, so every start is cold) is started with ``--no-compile-in-background`` (off) or ``--compile-in-background``
(on), then:

1. the time to ready (health 200);
2. ``scripts/benchmark_serving.py`` at once ("at ready": with "on", shapes are still compiling beside it);
3. the time until ``jaxserve_step_shapes_pending`` reads 0 (every shape compiled);
4. the same benchmark again ("all compiled");
5. SIGTERM: seconds to exit, and the exit code.

With "on" a third start is stopped right after ready, while shapes compile ("stop mid-compile"). Each server's
log (``--log-level debug`` for ``jaxserve.compile``) goes to ``DIR/server-MODE.log``; the figures to
``DIR/background_compile.json`` and a table to ``DIR/background_compile.md``. The presets are the GPU check kit's
serving shape (``llama-1b``: 16 layers, hidden 2048, bf16, 32 sequences, 512-token steps) and a tiny one for a
CPU. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_check import LLAMA_1B, TINY_LLAMA, free_port, shapes_pending  # noqa: E402

PRESETS = {  # config, server flags, benchmark defaults
    "llama-1b": (LLAMA_1B, ["--max-num-seqs", "32", "--max-num-batched-tokens", "512", "--max-model-len", "1024"],
                 {"num_requests": 96, "prompt_len": "128:512", "output_len": 128, "max_concurrency": 32}),
    "tiny": (TINY_LLAMA, ["--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--max-model-len", "256"],
             {"num_requests": 24, "prompt_len": "16:96", "output_len": 16, "max_concurrency": 8}),
}


def _get(url: str, timeout: float = 2.0):
    import httpx

    try:
        return httpx.get(url, timeout=timeout)
    except httpx.HTTPError:
        return None


class Server:
    def __init__(self, folder: Path, flags: list[str], log: Path):
        self.http = free_port()
        cmd = [sys.executable, "-m", "jaxserve.serve", "--model", str(folder), "--load-format", "dummy",
               "--dtype", "bfloat16", "--http-port", str(self.http), "--grpc-port", str(free_port()),
               "--served-model-name", "dummy", "--log-level", "info", "--compilation-cache-dir", "", *flags]
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONUNBUFFERED="1")
        self.log = open(log, "w")
        self.start = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> float:
        while time.monotonic() - self.start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was ready")
            r = _get(f"http://127.0.0.1:{self.http}/health")
            if r is not None and r.status_code == 200:
                return time.monotonic() - self.start
            time.sleep(0.25)
        raise RuntimeError(f"server not ready after {timeout:.0f}s")

    def pending(self) -> int | None:
        return shapes_pending(self.http)

    def wait_compiled(self, timeout: float) -> float | None:
        while time.monotonic() - self.start < timeout:
            if self.pending() == 0:
                return time.monotonic() - self.start
            time.sleep(0.25)
        return None

    def stop(self, grace: float = 60.0) -> dict:
        t = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
            out = {"stop_s": time.monotonic() - t, "exit": self.proc.returncode}
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            out = {"stop_s": None, "exit": "SIGKILL after %.0fs" % grace}
        self.log.close()
        return out


def bench(server: Server, args, out_dir: Path) -> dict:
    cmd = [sys.executable, "scripts/benchmark_serving.py", "--backend", "openai", "--port", str(server.http),
           "--num-requests", str(args.num_requests), "--prompt-len", args.prompt_len,
           "--output-len", str(args.output_len), "--max-concurrency", str(args.max_concurrency),
           "--request-timeout", "300", "--json", "--out-dir", str(out_dir)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    run = json.loads(proc.stdout.strip().splitlines()[-1])["runs"][0]
    return {"output_tok_s": run["output_throughput"], "completed": run["completed"], "failed": run["failed"],
            "ttft_p50_ms": run["ttft_ms"]["p50"], "itl_p50_ms": run["itl_ms"]["p50"],
            "duration_s": run.get("duration_s")}


def run_mode(mode: str, folder: Path, flags: list[str], args, out: Path) -> dict:
    flag = "--compile-in-background" if mode == "on" else "--no-compile-in-background"
    server = Server(folder, [flag, *flags], out / f"server-{mode}.log")
    row: dict = {"mode": mode}
    try:
        row["ready_s"] = server.wait_ready(args.timeout)
        row["pending_at_ready"] = server.pending()
        row["at_ready"] = bench(server, args, out / f"bench-{mode}-ready")
        row["all_compiled_s"] = server.wait_compiled(args.timeout)
        row["all_compiled"] = bench(server, args, out / f"bench-{mode}-compiled")
    finally:
        row.update(server.stop())
    return row


def stop_mid_compile(folder: Path, flags: list[str], args, out: Path) -> dict:
    server = Server(folder, ["--compile-in-background", *flags], out / "server-stop-mid-compile.log")
    row: dict = {"mode": "on, SIGTERM at ready"}
    try:
        row["ready_s"] = server.wait_ready(args.timeout)
        row["pending_at_ready"] = server.pending()
    finally:
        row.update(server.stop())
    return row


def _f(x, digits=1) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}" if isinstance(x, float) else str(x)


def table(rows: list[dict]) -> str:
    lines = ["| mode | ready s | shapes pending at ready | at ready: out tok/s, TTFT p50 ms | every shape compiled s "
             "| then: out tok/s, TTFT p50 ms | SIGTERM to exit s (code) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        def b(key):
            x = r.get(key)
            if not x:
                return ""
            return "failed: see JSON" if "error" in x else f"{_f(x['output_tok_s'], 0)}, {_f(x['ttft_p50_ms'])}"
        lines.append(f"| {r['mode']} | {_f(r.get('ready_s'))} | {_f(r.get('pending_at_ready'))} | {b('at_ready')} | "
                     f"{_f(r.get('all_compiled_s'))} | {b('all_compiled')} | {_f(r.get('stop_s'))} ({r.get('exit')}) |")
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama-1b")
    p.add_argument("--modes", default="off,on")
    p.add_argument("--stop-mid-compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--num-requests", type=int)
    p.add_argument("--prompt-len")
    p.add_argument("--output-len", type=int)
    p.add_argument("--max-concurrency", type=int)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a server may take to be ready")
    args = p.parse_args(argv)
    config, flags, defaults = PRESETS[args.preset]
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxserve-bg-") as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(config))
        for mode in args.modes.split(","):
            rows.append(run_mode(mode, folder, flags + extra, args, args.out))
            print(json.dumps(rows[-1]), flush=True)
        if args.stop_mid_compile and "on" in args.modes.split(","):
            rows.append(stop_mid_compile(folder, flags + extra, args, args.out))
            print(json.dumps(rows[-1]), flush=True)
    (args.out / "background_compile.json").write_text(json.dumps(rows, indent=1))
    text = table(rows)
    (args.out / "background_compile.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
