"""Head-of-line blocking, measured: the largest gap between one stream's chunks while big prompts arrive.

    python scripts/hol_gap.py [--server-args "..."] [--big-bytes 3900000] [--repeats 3] [--json]

Starts ``python -m jaxserve.serve`` (the demo model unless --server-args names another) on free loopback ports,
opens one long streaming completion, and once it is flowing posts, one after another: a prompt of --big-bytes
(under the 4 MiB body limit, far beyond max_model_len: refused by its size alone), then a prompt just under the
size bound the server states (it is tokenized, then refused for its token count), then a prompt that is
served. It reports the stream's largest inter-chunk gap before the posts (the baseline: one engine step) and
while each post was in flight, and how long each post took. With tokenization on the engine thread, the gap
during a post is as long as the post's tokenization.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts import bench_results  # noqa: E402


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.serve", "--host", "127.0.0.1", "--http-port", "0",
                             "--grpc-port", "0", *extra], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        m = re.search(r"jaxserve ready: .*http=(\S+)", line)
        if m:
            return proc, m.group(1)
    raise RuntimeError("the server exited before it was ready")


class Stream(threading.Thread):
    """Streaming completions back to back (each as long as the model allows); records every chunk's arrival."""

    def __init__(self, url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url = url
        self.max_tokens = max_tokens
        self.times: list[float] = []
        self.stop = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        body = {"prompt": "Hello", "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0,
                "stream": True}
        with httpx.Client(timeout=600) as client:
            while not self.stop.is_set():
                with client.stream("POST", self.url + "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        self.error = f"{r.status_code}: {r.read()!r}"
                        return
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            self.times.append(time.monotonic())
                        if self.stop.is_set():
                            return


def max_gap(times: list[float], start: float, end: float) -> float:
    """Largest gap between consecutive chunks that overlaps [start, end]."""
    gaps = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]
    return max(gaps, default=float("nan"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server-args", default="", help="extra options for jaxserve.serve")
    p.add_argument("--big-bytes", type=int, default=3_900_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    bench_results.add_arguments(p)
    args = p.parse_args()

    proc, url = start_server(shlex.split(args.server_args))
    results = []
    try:
        client = httpx.Client(base_url=url, timeout=600)
        max_model_len = client.get("/v1/models").json()["data"][0]["max_model_len"]
        stream = Stream(url, max_model_len - 8)
        stream.start()
        deadline = time.monotonic() + 120
        while len(stream.times) < 20:
            if stream.error or time.monotonic() > deadline:
                raise RuntimeError(f"the stream did not start: {stream.error}")
            time.sleep(0.05)
        time.sleep(1.0)
        t0 = time.monotonic()
        baseline = max_gap(stream.times, t0 - 1.0, t0)
        big = client.post("/v1/completions", json={"prompt": "x" * args.big_bytes, "max_tokens": 1})
        stated = re.search(r"longest accepted: (\d+)", big.json()["error"]["message"]) if big.status_code == 400 else None
        near = int(stated.group(1)) if stated else args.big_bytes
        posts = [("big", "x" * args.big_bytes), ("near-limit", "x" * near), ("served", "Hello there")]
        for _ in range(args.repeats):
            for name, prompt in posts:
                start = time.monotonic()
                r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
                end = time.monotonic()
                time.sleep(0.3)  # let the chunk after the post arrive
                results.append({"post": name, "chars": len(prompt), "status": r.status_code,
                                "post_s": round(end - start, 3),
                                "max_gap_ms": round(1000 * max_gap(stream.times, start, end), 1)})
        stream.stop.set()
    finally:
        proc.terminate()
        proc.wait(60)
    report = {"baseline_max_gap_ms": round(1000 * baseline, 1), "posts": results}
    figures = bench_results.Results(args)
    for name in dict.fromkeys(r["post"] for r in results):
        chars = max(r["chars"] for r in results if r["post"] == name)
        gap = max(r["max_gap_ms"] for r in results if r["post"] == name)
        figures.add(f"{name} post ({chars:,} characters): largest stream gap during it", gap, "ms")
    figures.save()
    if args.json:
        print(json.dumps(report))
        return
    print(f"baseline: largest inter-chunk gap over 1s before the posts: {report['baseline_max_gap_ms']} ms")
    print("| post | characters | status | post took (s) | largest stream gap during it (ms) |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['post']} | {r['chars']} | {r['status']} | {r['post_s']} | {r['max_gap_ms']} |")


if __name__ == "__main__":
    main()
