"""Prefix-aware against least-loaded routing on a shared-prefix workload: two colocated servers publishing
KV-cache events behind ``--role router``, once with ``--routing least-loaded`` and once with ``--routing
prefix``; several system prompts, multi-turn conversations whose every turn resends the history.

Reports, per routing: the servers' prefix-cache hit rate over the run (``vllm:prefix_cache_hits`` /
``vllm:prefix_cache_queries``, differences before and after) and the client-side time to first token (mean, p50,
p90). Each run uses its own token ids, so the second run finds nothing of the first in the caches.

    python scripts/bench_prefix_routing.py [--model PATH] [--conversations 16] [--turns 3] [--concurrency 4]

With no ``--model`` the built-in demo model (random weights) is served.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts import bench_results  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, args: list[str], log: Path):
        self.log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxserve.serve", *args], cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))

    def wait_ready(self, timeout: float = 900) -> tuple[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            m = re.search(r"jaxserve ready: .*http=(\S+) grpc=(\S+)", line)
            if m:
                return m.group(1), m.group(2)
        raise RuntimeError(f"not ready; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def scrape(http: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(http + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:prefix_cache_"):
            key, _, value = line.rpartition(" ")
            out[key.split("{")[0]] = float(value)
    return out


def workload(rng: random.Random, base: int, args) -> list[list[list[int]]]:
    """Per conversation, its user turns (token ids); its system prompt is one of ``args.systems``."""
    systems = [[base + rng.randrange(200) for _ in range(args.system_tokens)] for _ in range(args.systems)]
    convs = []
    for c in range(args.conversations):
        turns = [systems[c % args.systems] + [rng.randrange(200) for _ in range(args.user_tokens)]]
        turns += [[rng.randrange(200) for _ in range(args.user_tokens)] for _ in range(args.turns - 1)]
        convs.append(turns)
    return convs


def run_conversations(http: str, model: str, convs, args) -> list[float]:
    ttfts, lock, queue = [], threading.Lock(), list(range(len(convs)))

    def worker():
        with httpx.Client(timeout=600) as client:
            while True:
                with lock:
                    if not queue:
                        return
                    c = queue.pop(0)
                history: list[int] = []
                for turn in convs[c]:
                    prompt = history + turn
                    start, first, ids = time.perf_counter(), None, []
                    with client.stream("POST", http + "/v1/completions", json={
                            "model": model, "prompt": prompt, "max_tokens": args.output_tokens, "stream": True,
                            "ignore_eos": True, "temperature": 0, "return_token_ids": True}) as r:
                        r.raise_for_status()
                        for line in r.iter_lines():
                            if not line.startswith("data: {"):
                                continue
                            if first is None:
                                first = time.perf_counter() - start
                            choice = json.loads(line[6:])["choices"][0]
                            ids += choice.get("token_ids") or []
                    with lock:
                        ttfts.append(first)
                    history = prompt + (ids or [1] * args.output_tokens)

    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ttfts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--systems", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=96)
    p.add_argument("--user-tokens", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefix-caching-hash-algo", default="sha256_cbor",
                   help="the servers' and the router's block hash (default: what llm-d's scorer expects)")
    bench_results.add_arguments(p)
    args = p.parse_args()
    figures = bench_results.Results(args)
    tmp = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    servers, pubs = [], []
    model_args = ["--model", args.model] if args.model else []
    try:
        for i in range(2):
            pub = free_port()
            pubs.append((f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{free_port()}"))
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                   "replay_endpoint": pubs[-1][1].replace("127.0.0.1", "*")}
            servers.append(Proc([*model_args, "--http-port", "0", "--grpc-port", "0", "--page-size",
                                 str(args.page_size), "--kv-events-config", json.dumps(cfg),
                                 "--prefix-caching-hash-algo", args.prefix_caching_hash_algo,
                                 "--log-level", "warning"], tmp / f"server{i}.log"))
        addrs = [s.wait_ready() for s in servers]
        model = httpx.get(addrs[0][0] + "/v1/models", timeout=10).json()["data"][0]["id"]
        decode_url = ",".join(f"127.0.0.1:{h.rsplit(':', 1)[1]}:{g.rsplit(':', 1)[1]}" for h, g in addrs)
        rows = []
        for n, routing in enumerate(("least-loaded", "prefix")):
            extra = ["--kv-events-url", ",".join(u for u, _ in pubs), "--kv-events-replay-url",
                     ",".join(r for _, r in pubs)] if routing == "prefix" else []
            router = Proc(["--role", "router", "--decode-url", decode_url, "--routing", routing, "--http-port", "0",
                           "--grpc-port", "0", "--prefix-caching-hash-algo", args.prefix_caching_hash_algo,
                           *extra], tmp / f"router-{routing}.log")
            try:
                http, _ = router.wait_ready()
                time.sleep(1.0)  # the router's index catches up with the servers' events
                before = [scrape(h) for h, _ in addrs]
                convs = workload(random.Random(n), 50 * n, args)
                start = time.perf_counter()
                ttfts = run_conversations(http, model, convs, args)
                wall = time.perf_counter() - start
                after = [scrape(h) for h, _ in addrs]
            finally:
                router.stop()
            hits = sum(a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"]
                       for a, b in zip(after, before))
            queries = sum(a["vllm:prefix_cache_queries_total"] - b["vllm:prefix_cache_queries_total"]
                          for a, b in zip(after, before))
            q = statistics.quantiles(ttfts, n=10)
            rows.append((routing, hits / queries if queries else 0.0, statistics.mean(ttfts), statistics.median(ttfts),
                         q[8], len(ttfts), wall))
        print("| routing | prefix-cache hit rate | TTFT mean (s) | TTFT p50 (s) | TTFT p90 (s) | requests | wall (s) |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r[0]} | {r[1]:.1%} | {r[2]:.3f} | {r[3]:.3f} | {r[4]:.3f} | {r[5]} | {r[6]:.1f} |")
            run = f"{args.systems} system prompts, {args.conversations} conversations, {r[0]} routing"
            figures.add(f"{run}: prefix-cache hit rate", 100 * r[1], "%")
            figures.add(f"{run}: TTFT mean", r[2], "s")
        figures.save()
    finally:
        for s in servers:
            s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
