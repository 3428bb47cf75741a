"""Online serving benchmark: a seeded synthetic workload streamed against a running jaxserve server.

    python scripts/benchmark_serving.py --backend openai|grpc [--host 127.0.0.1 --port P] [--model NAME]
        [--api-key K] [--num-requests 100 --prompt-len 16:256 --output-len 32:64]
        [--request-rate R | --sweep-rates 1,2,4,inf] [--max-concurrency C | --sweep-concurrency 1,8,32]
        [--slo-ttft-ms 500 --slo-tpot-ms 50 --slo-e2e-ms 10000] [--out-dir DIR] [--json]

Requests arrive as a Poisson process at --request-rate (requests/s; ``inf`` sends them all at once), optionally
capped at --max-concurrency requests in flight (a request that arrives while the cap is reached waits for a
slot; its latencies count from when it is actually sent). Every request streams: OpenAI ``/v1/completions``
with ``stream: true`` and ``stream_options.include_usage`` over httpx, or gRPC ``JaxServe.Generate`` over
grpc.aio. Prompts are random token ids (or random words with ``--prompt-kind text``), outputs run to their
length with ``ignore_eos``, greedy unless --temperature is set.

Per run: TTFT (send to first token), TPOT ((end-to-end - TTFT) / (output tokens - 1), so the first token is
excluded; undefined for one-token outputs), ITL (the gap between consecutive token-carrying chunks, divided by
the tokens the later chunk carries), end-to-end latency, each as mean/p50/p90/p99; request, output-token and
total-token throughput; goodput (completed requests meeting every SLO given, per second); failed requests.
Token counts come from the server's usage (gRPC: also the token ids in the stream), never from re-tokenizing.

A sweep reuses one workload shape (the same prompt and output lengths and the same arrival pattern scaled to
each rate) with fresh token ids per run, so later runs get no prefix-cache hits from earlier ones. With
--out-dir it writes results.json, results.csv, results.md and, when matplotlib is installed (the ``bench``
extra), latency_vs_throughput.png. --json prints the results as JSON on stdout (the report goes to stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts import bench_results  # noqa: E402

STAT_KEYS = ("mean", "p50", "p90", "p99")
LATENCIES = ("ttft", "tpot", "itl", "e2e")
# Short common words for --prompt-kind text: about one token each with a word-level or BPE tokenizer.
WORDS = ("the of and to in is it that for on with as was at by be this from or have an not are but one all "
         "we can has more will new time about out up so what when which their there who two way some our "
         "each make like long look day get come made may part over number sound people water first").split()


# Workload ------------------------------------------------------------------------------------------------------
def parse_range(text: str) -> tuple[int, int]:
    """``"LO:HI"`` (inclusive) or ``"N"`` -> (lo, hi)."""
    lo, _, hi = text.partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if lo_i < 1 or hi_i < lo_i:
        raise ValueError(f"bad range {text!r}: need 1 <= LO <= HI")
    return lo_i, hi_i


def parse_rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise ValueError(f"a request rate must be > 0 (or inf), not {text!r}")
    return rate


@dataclass
class RequestSpec:
    index: int
    prompt: list[int] | str
    prompt_len: int  # planned: token ids, or words for text prompts
    output_len: int


def make_workload(num: int, prompt_len: tuple[int, int], output_len: tuple[int, int], *, seed: int,
                  run_index: int = 0, kind: str = "ids", token_range: tuple[int, int] = (3, 256)) -> list[RequestSpec]:
    """Lengths depend on ``seed`` only; the prompt contents also on ``run_index`` (fresh ids per run)."""
    shape = np.random.default_rng([seed, 0])
    p_lens = shape.integers(prompt_len[0], prompt_len[1] + 1, num)
    o_lens = shape.integers(output_len[0], output_len[1] + 1, num)
    content = np.random.default_rng([seed, 1, run_index + 1])
    specs = []
    for i, (p, o) in enumerate(zip(p_lens.tolist(), o_lens.tolist())):
        if kind == "ids":
            prompt: list[int] | str = content.integers(token_range[0], token_range[1], p).tolist()
        else:
            prompt = " ".join(WORDS[j] for j in content.integers(0, len(WORDS), p))
        specs.append(RequestSpec(i, prompt, p, o))
    return specs


def arrival_offsets(num: int, rate: float, seed: int) -> np.ndarray:
    """Seconds from the start at which each request arrives: a Poisson process at ``rate`` (the first at 0).
    Every rate scales the same seeded unit-rate gaps, so sweeps share one arrival pattern."""
    if math.isinf(rate):
        return np.zeros(num)
    gaps = np.random.default_rng([seed, 2]).exponential(1.0, num)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) / rate


# Results -------------------------------------------------------------------------------------------------------
@dataclass
class RequestResult:
    index: int
    prompt_len: int
    output_len: int
    ok: bool = False
    error: str | None = None
    finish_reason: str | None = None
    arrival_s: float = 0.0  # scheduled arrival, from the start of the run
    send_s: float = 0.0  # actually sent (later than arrival when waiting for a concurrency slot)
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first; NaN for fewer than two tokens."""
        if not self.ok or self.output_tokens < 2:
            return math.nan
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


class _Timer:
    """Token-carrying chunk times of one request: TTFT, ITL per token, end-to-end."""

    def __init__(self):
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[tuple[float, int]] = []  # (gap to the previous token chunk, tokens in this chunk)
        self.chunks = 0
        self.tokens = 0

    def tokens_arrived(self, count: int, now: float) -> None:
        if self.first is None:
            self.first = now
        else:
            self.gaps.append((now - self.last, count))
        self.last = now
        self.chunks += 1
        self.tokens += count

    def finish(self, r: RequestResult, output_tokens: int, exact_counts: bool) -> None:
        end = time.perf_counter()
        r.output_tokens = output_tokens
        if self.first is None:
            return
        r.ttft_s = self.first - self.start
        r.e2e_s = end - self.start
        if exact_counts or self.chunks == output_tokens or self.chunks < 2:
            r.itl_s = [g / k for g, k in self.gaps for _ in range(k)] if exact_counts else [g for g, _ in self.gaps]
        else:  # chunks and tokens disagree and per-chunk counts are unknown: spread the later tokens evenly
            per_chunk = max(output_tokens - 1, 1) / (self.chunks - 1)
            r.itl_s = [g / per_chunk for g, _ in self.gaps]


# Backends ------------------------------------------------------------------------------------------------------
class OpenAIBackend:
    """``POST /v1/completions`` with ``stream: true`` over one httpx.AsyncClient."""

    name = "openai"

    def __init__(self, host: str, port: int, model: str | None, api_key: str | None, timeout: float, params: dict):
        import httpx

        self.httpx = httpx
        self.base = f"http://{host}:{port}"
        self.model = model
        self.params = params
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=self.base, headers=headers, timeout=httpx.Timeout(timeout),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    @property
    def target(self) -> str:
        return self.base

    async def wait_ready(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            try:
                if (await self.client.get("/health", timeout=5)).status_code == 200:
                    return
            except self.httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.base}/health did not answer 200 within {seconds:.0f}s")
            await asyncio.sleep(0.5)

    async def info(self) -> dict:
        r = await self.client.get("/v1/models", timeout=30)
        if r.status_code != 200:
            raise RuntimeError(f"GET /v1/models: HTTP {r.status_code}: {r.text[:300]}")
        models = r.json()["data"]
        entry = next((m for m in models if m["id"] == self.model), models[0])
        return {"model": entry["id"], "max_model_len": entry.get("max_model_len")}

    async def send(self, spec: RequestSpec, r: RequestResult) -> None:
        body = {"prompt": spec.prompt, "max_tokens": spec.output_len, "stream": True,
                "stream_options": {"include_usage": True}, **self.params}
        if self.model:
            body["model"] = self.model
        timer = _Timer()
        usage = None
        async with self.client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                try:
                    text = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                r.error = f"HTTP {resp.status_code}: {text[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    r.error = f"in-stream error: {chunk['error'].get('message', chunk['error'])}"[:250]
                    return
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    if choice.get("finish_reason") is not None:
                        r.finish_reason = choice["finish_reason"]
                        if not choice.get("text") and r.finish_reason in ("abort", "error"):
                            continue  # a closing chunk without a token
                    # One chunk per engine step; a token whose text is still incomplete UTF-8 comes as "".
                    timer.tokens_arrived(1, now)
        if usage:
            r.prompt_tokens = usage.get("prompt_tokens", 0)
            r.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            output_tokens = usage.get("completion_tokens", timer.tokens)
        else:
            output_tokens = timer.tokens
        timer.finish(r, output_tokens, exact_counts=False)
        r.ok = r.finish_reason not in ("abort", "error") and output_tokens > 0 and timer.first is not None
        if not r.ok:
            r.error = f"finish_reason {r.finish_reason}, {output_tokens} output tokens"

    async def close(self) -> None:
        await self.client.aclose()


class GrpcBackend:
    """``jaxserve.v1.JaxServe/Generate`` (server streaming) over one grpc.aio channel."""

    name = "grpc"

    def __init__(self, host: str, port: int, model: str | None, api_key: str | None, timeout: float, params: dict):
        import grpc

        from jaxserve.server.protos import jaxserve_pb2 as pb
        from jaxserve.server.protos import jaxserve_pb2_grpc as pb_grpc

        self.grpc, self.pb = grpc, pb
        self.addr = f"{host}:{port}"
        self.model = model
        self.timeout = timeout
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.channel = grpc.aio.insecure_channel(self.addr, options=[("grpc.max_send_message_length", 64 << 20),
                                                                     ("grpc.max_receive_message_length", 64 << 20)])
        self.stub = pb_grpc.JaxServeStub(self.channel)
        self.params = params
        self.finish_names = {v: k.removeprefix("FINISH_REASON_").lower() for k, v in pb.FinishReason.items()}

    @property
    def target(self) -> str:
        return self.addr

    async def wait_ready(self, seconds: float) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + seconds
        while True:
            try:
                reply = await health.Check(health_pb2.HealthCheckRequest(service="jaxserve.v1.JaxServe"), timeout=5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except self.grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"gRPC health at {self.addr} was not SERVING within {seconds:.0f}s")
            await asyncio.sleep(0.5)

    async def info(self) -> dict:
        i = await self.stub.GetModelInfo(self.pb.GetModelInfoRequest(), metadata=self.metadata, timeout=30)
        names = list(i.served_model_names)
        return {"model": self.model if self.model in names else names[0], "max_model_len": i.max_model_len,
                "vocab_size": i.vocab_size, "dtype": i.dtype, "max_num_seqs": i.max_num_seqs,
                "max_num_batched_tokens": i.max_num_batched_tokens}

    async def send(self, spec: RequestSpec, r: RequestResult) -> None:
        pb = self.pb
        sampling = pb.SamplingParams(max_tokens=spec.output_len, **self.params)
        if isinstance(spec.prompt, str):
            req = pb.GenerateRequest(text=spec.prompt, sampling_params=sampling)
        else:
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=spec.prompt), sampling_params=sampling)
        timer = _Timer()
        usage = None
        call = self.stub.Generate(req, metadata=self.metadata, timeout=self.timeout)
        try:
            async for msg in call:
                now = time.perf_counter()
                if msg.token_ids:
                    timer.tokens_arrived(len(msg.token_ids), now)
                if msg.finish_reason:
                    r.finish_reason = self.finish_names.get(msg.finish_reason, str(msg.finish_reason))
                if msg.HasField("usage"):
                    usage = msg.usage
        except self.grpc.aio.AioRpcError as e:
            r.error = f"gRPC {e.code().name}: {(e.details() or '')[:200]}"
            return
        if usage is not None:
            r.prompt_tokens, r.cached_tokens = usage.prompt_tokens, usage.cached_prompt_tokens
            output_tokens = usage.completion_tokens
        else:
            output_tokens = timer.tokens
        timer.finish(r, output_tokens, exact_counts=output_tokens == timer.tokens)
        r.ok = r.finish_reason not in ("abort", "error") and output_tokens > 0 and timer.first is not None
        if not r.ok:
            r.error = f"finish_reason {r.finish_reason}, {output_tokens} output tokens"

    async def close(self) -> None:
        await self.channel.close()


BACKENDS = {"openai": OpenAIBackend, "grpc": GrpcBackend}
DEFAULT_PORTS = {"openai": 8000, "grpc": 50051}


def sampling_fields(args) -> tuple[dict, dict]:
    """The request's sampling fields for (OpenAI JSON, gRPC SamplingParams)."""
    openai = {"temperature": args.temperature, "ignore_eos": args.ignore_eos}
    grpc = {"temperature": args.temperature, "ignore_eos": args.ignore_eos}
    if args.temperature > 0:
        openai["seed"] = grpc["seed"] = args.seed
    return openai, grpc


# One run -------------------------------------------------------------------------------------------------------
async def run_requests(backend, specs: list[RequestSpec], rate: float, max_concurrency: int | None, *, seed: int,
                       request_timeout: float) -> tuple[list[RequestResult], float, int]:
    """Send ``specs`` on a Poisson schedule, at most ``max_concurrency`` at a time. Returns the results, the
    run's duration (first arrival to last completion) and the most requests in flight at once."""
    arrivals = arrival_offsets(len(specs), rate, seed)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    in_flight = peak = 0

    async def one(spec: RequestSpec, arrival: float) -> RequestResult:
        nonlocal in_flight, peak
        r = RequestResult(spec.index, spec.prompt_len, spec.output_len, arrival_s=arrival)
        if slots is not None:
            await slots.acquire()
        try:
            in_flight += 1
            peak = max(peak, in_flight)
            r.send_s = time.perf_counter() - start
            try:
                async with asyncio.timeout(request_timeout):
                    await backend.send(spec, r)
            except TimeoutError:
                r.ok, r.error = False, f"timed out after {request_timeout:g}s"
            except Exception as e:  # noqa: BLE001 - any transport failure is a failed request
                r.ok, r.error = False, f"{type(e).__name__}: {e}"[:250]
            return r
        finally:
            in_flight -= 1
            if slots is not None:
                slots.release()

    start = time.perf_counter()
    tasks = []
    for spec, arrival in zip(specs, arrivals.tolist()):
        delay = start + arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(spec, arrival)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start, peak


def stats(values) -> dict[str, float]:
    """mean/p50/p90/p99 in milliseconds of values in seconds (NaN-free input; NaN when empty)."""
    a = np.asarray([v for v in values if not math.isnan(v)], dtype=np.float64) * 1e3
    if a.size == 0:
        return {k: math.nan for k in STAT_KEYS}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """Every SLO given (ms) holds; an undefined TPOT (one output token) does not violate its SLO."""
    if not r.ok:
        return False
    values = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2e": r.e2e_s}
    return all(math.isnan(values[k]) or values[k] * 1e3 <= limit for k, limit in slos.items())


def summarize(results: list[RequestResult], duration: float, *, rate: float, max_concurrency: int | None,
              slos: dict[str, float], peak: int = 0) -> dict:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    s = {
        "request_rate": rate, "max_concurrency": max_concurrency, "num_requests": len(results),
        "completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "cached_prompt_tokens": sum(r.cached_tokens for r in done),
        "request_throughput": per_s(len(done)), "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        "goodput": per_s(sum(meets_slos(r, slos) for r in done)) if slos else math.nan,
        "slos_ms": dict(slos),
        "ttft_ms": stats(r.ttft_s for r in done), "tpot_ms": stats(r.tpot_s for r in done),
        "itl_ms": stats(x for r in done for x in r.itl_s), "e2e_ms": stats(r.e2e_s for r in done),
        "peak_concurrency": peak,
        "client_wait_ms_mean": float(np.mean([r.send_s - r.arrival_s for r in results]) * 1e3) if results else 0.0,
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
    }
    return s


# Reports -------------------------------------------------------------------------------------------------------
def _fmt(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isnan(x):
            return "n/a"
        if math.isinf(x):
            return "inf"
        return f"{x:.{digits}f}"
    return str(x)


def report(s: dict) -> str:
    lines = [f"rate {_fmt(s['request_rate'], 2)} req/s, max concurrency {_fmt(s['max_concurrency'])}: "
             f"{s['completed']} completed, {s['failed']} failed of {s['num_requests']} in {s['duration_s']:.2f}s "
             f"(peak {s['peak_concurrency']} in flight)",
             f"  throughput: {_fmt(s['request_throughput'], 2)} req/s, {_fmt(s['output_throughput'])} output tok/s, "
             f"{_fmt(s['total_token_throughput'])} total tok/s; tokens in {s['total_input_tokens']} "
             f"(cached {s['cached_prompt_tokens']}), out {s['total_output_tokens']}"]
    if s["slos_ms"]:
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in s["slos_ms"].items())
        lines.append(f"  goodput ({slo}): {_fmt(s['goodput'], 2)} req/s")
    lines.append(f"  {'ms':6s} " + " ".join(f"{k:>9s}" for k in STAT_KEYS))
    for name in LATENCIES:
        lines.append(f"  {name.upper():6s} " + " ".join(f"{_fmt(s[name + '_ms'][k], 2):>9s}" for k in STAT_KEYS))
    for err, n in s["errors"].items():
        lines.append(f"  failed x{n}: {err}")
    return "\n".join(lines)


def flat(s: dict) -> dict:
    """One CSV row: nested latency stats become ``ttft_ms_p50`` and so on."""
    row = {}
    for k, v in s.items():
        if k in ("errors", "slos_ms"):
            continue
        if isinstance(v, dict):
            row.update({f"{k}_{sub}": x for sub, x in v.items()})
        else:
            row[k] = v
    return row


def to_csv(runs: list[dict]) -> str:
    rows = [flat(s) for s in runs]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()})
    return buf.getvalue()


def to_markdown(runs: list[dict]) -> str:
    head = ["rate (req/s)", "max conc.", "done/failed", "req/s", "out tok/s", "total tok/s", "TTFT p50 / p99 ms",
            "TPOT p50 / p99 ms", "ITL p50 / p99 ms", "E2E p50 / p99 ms"]
    with_goodput = any(s["slos_ms"] for s in runs)
    if with_goodput:
        head.append("goodput (req/s)")
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for s in runs:
        cells = [_fmt(s["request_rate"], 2), _fmt(s["max_concurrency"]), f"{s['completed']}/{s['failed']}",
                 _fmt(s["request_throughput"], 2), _fmt(s["output_throughput"]), _fmt(s["total_token_throughput"])]
        cells += [f"{_fmt(s[k + '_ms']['p50'])} / {_fmt(s[k + '_ms']['p99'])}" for k in LATENCIES]
        if with_goodput:
            cells.append(_fmt(s["goodput"], 2))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path, title: str) -> bool:
    """TTFT p50/p99 and TPOT p50 against achieved output throughput; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = sorted(runs, key=lambda s: s["output_throughput"])
    x = [s["output_throughput"] for s in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(x, [s["ttft_ms"]["p50"] for s in runs], "o-", label="TTFT p50")
    ax1.plot(x, [s["ttft_ms"]["p99"] for s in runs], "s--", label="TTFT p99")
    ax2.plot(x, [s["tpot_ms"]["p50"] for s in runs], "o-", color="tab:green", label="TPOT p50")
    for s, xi in zip(runs, x):
        label = f"{s['request_rate']:g} req/s" + (f", C={s['max_concurrency']}" if s["max_concurrency"] else "")
        ax1.annotate(label, (xi, s["ttft_ms"]["p50"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax2.annotate(label, (xi, s["tpot_ms"]["p50"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    for ax, name in ((ax1, "time to first token (ms)"), (ax2, "time per output token (ms)")):
        ax.set_xlabel("achieved output throughput (tokens/s)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def json_safe(x):
    """NaN -> null and inf -> "inf", recursively, so the output is strict JSON."""
    if isinstance(x, float):
        return None if math.isnan(x) else ("inf" if math.isinf(x) else x)
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


# Main ----------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=sorted(BACKENDS), default="openai")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default: 8000 (openai), 50051 (grpc)")
    p.add_argument("--model", default=None, help="served model name (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("JAXSERVE_API_KEY"), help="default: $JAXSERVE_API_KEY")
    p.add_argument("--num-requests", type=int, default=100, help="requests per run")
    p.add_argument("--prompt-len", default="16:256", help="LO:HI (uniform, inclusive) or N: prompt tokens "
                   "(words with --prompt-kind text)")
    p.add_argument("--output-len", default="32:64", help="LO:HI or N: output tokens per request (max_tokens)")
    p.add_argument("--prompt-kind", choices=("ids", "text"), default="ids",
                   help="random token ids (default) or random common words")
    p.add_argument("--token-id-range", default="3:256", help="LO:HI (HI exclusive) for random prompt ids; the "
                   "default is valid for any vocabulary of 256 or more")
    p.add_argument("--request-rate", type=parse_rate, default=math.inf, help="Poisson arrivals, requests/s "
                   "(default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    p.add_argument("--sweep-rates", default=None, help="comma list of rates, one run each (e.g. 1,2,4,inf)")
    p.add_argument("--sweep-concurrency", default=None, help="comma list of concurrency caps, one run each")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the output length (default on)")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2e-ms", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-requests", type=int, default=1, help="untimed requests first (they also check "
                   "that the server answers; the benchmark stops if all fail)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request counts as failed")
    p.add_argument("--wait-ready", type=float, default=0.0, help="wait up to this many seconds for the server's "
                   "health to report ready")
    p.add_argument("--out-dir", type=Path, default=None, help="write results.json/.csv/.md and a PNG plot here")
    p.add_argument("--save-requests", action="store_true", help="include every request's timings in the JSON")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout (report to stderr)")
    bench_results.add_arguments(p)
    return p


def save_results(args, summaries: list[dict]) -> None:
    """``--results-json``: each rate's throughput, goodput and TTFT p50 as result records (scripts/bench_results.py)."""
    out = bench_results.Results(args)
    for s in summaries:
        rate = "inf" if math.isinf(s["request_rate"]) else f"{s['request_rate']:g}"
        run = f"{args.backend}, rate {rate}" + (f", concurrency {s['max_concurrency']}" if s["max_concurrency"] else "")
        out.add(f"{run}: output tok/s", s["output_throughput"], "tok/s")
        out.add(f"{run}: requests/s", s["request_throughput"], "req/s")
        if not math.isnan(s["goodput"]):
            out.add(f"{run}: goodput", s["goodput"], "req/s")
        if not math.isnan(s["ttft_ms"]["p50"]):
            out.add(f"{run}: TTFT p50", s["ttft_ms"]["p50"], "ms")
    out.save()


def plan_runs(args, p: argparse.ArgumentParser) -> list[tuple[float, int | None]]:
    if args.sweep_rates and args.sweep_concurrency:
        p.error("give --sweep-rates or --sweep-concurrency, not both")
    try:
        if args.sweep_rates:
            return [(parse_rate(x), args.max_concurrency) for x in args.sweep_rates.split(",") if x.strip()]
        if args.sweep_concurrency:
            return [(args.request_rate, int(x)) for x in args.sweep_concurrency.split(",") if x.strip()]
    except ValueError as e:
        p.error(str(e))
    return [(args.request_rate, args.max_concurrency)]


async def benchmark(args, runs: list[tuple[float, int | None]], log) -> dict:
    prompt_len, output_len = parse_range(args.prompt_len), parse_range(args.output_len)
    lo, _, hi = args.token_id_range.partition(":")
    token_range = (int(lo), int(hi))
    slos = {k: v for k, v in (("ttft", args.slo_ttft_ms), ("tpot", args.slo_tpot_ms), ("e2e", args.slo_e2e_ms))
            if v is not None}
    port = args.port or DEFAULT_PORTS[args.backend]
    openai_params, grpc_params = sampling_fields(args)
    backend = BACKENDS[args.backend](args.host, port, args.model, args.api_key, args.request_timeout,
                                     openai_params if args.backend == "openai" else grpc_params)
    try:
        try:
            if args.wait_ready > 0:
                await backend.wait_ready(args.wait_ready)
            info = await backend.info()
        except Exception as e:  # noqa: BLE001 - a one-line reason instead of a traceback
            reason = e.details() if hasattr(e, "details") else str(e) or type(e).__name__
            raise SystemExit(f"cannot query the server at {backend.target}: {reason}") from None
        limit = info.get("max_model_len")
        if args.prompt_kind == "ids" and limit and prompt_len[1] + output_len[1] > limit:
            raise SystemExit(f"prompt-len HI + output-len HI = {prompt_len[1] + output_len[1]} is over the server's "
                             f"max_model_len {limit}")
        if info.get("vocab_size") and token_range[1] > info["vocab_size"]:
            raise SystemExit(f"--token-id-range ends at {token_range[1]}, past the vocabulary ({info['vocab_size']})")
        log(f"{args.backend} backend at {backend.target}, model {info['model']}, max_model_len {limit}")
        if args.warmup_requests > 0:
            warm = make_workload(args.warmup_requests, prompt_len, (min(output_len[0], 4),) * 2, seed=args.seed,
                                 run_index=-1, kind=args.prompt_kind, token_range=token_range)
            res, secs, _ = await run_requests(backend, warm, math.inf, None, seed=args.seed,
                                              request_timeout=args.request_timeout)
            if not any(r.ok for r in res):
                raise SystemExit(f"every warm-up request failed: {res[0].error}")
            log(f"warm-up: {sum(r.ok for r in res)}/{len(res)} ok in {secs:.2f}s")
        summaries, per_request = [], []
        for i, (rate, conc) in enumerate(runs):
            specs = make_workload(args.num_requests, prompt_len, output_len, seed=args.seed, run_index=i,
                                  kind=args.prompt_kind, token_range=token_range)
            results, duration, peak = await run_requests(backend, specs, rate, conc, seed=args.seed,
                                                         request_timeout=args.request_timeout)
            s = summarize(results, duration, rate=rate, max_concurrency=conc, slos=slos, peak=peak)
            summaries.append(s)
            log(report(s))
            if s["cached_prompt_tokens"]:
                log("  note: some prompt tokens came from the server's prefix cache; a run with the same --seed "
                    "(and run position) already went to this server")
            if args.save_requests:
                per_request.append([dict(asdict(r), tpot_s=r.tpot_s) for r in results])
    finally:
        await backend.close()
    out = {"backend": args.backend, "target": backend.target, "model": info["model"], "server": info,
           "workload": {"num_requests": args.num_requests, "prompt_len": list(prompt_len),
                        "output_len": list(output_len), "prompt_kind": args.prompt_kind,
                        "token_id_range": list(token_range), "temperature": args.temperature,
                        "ignore_eos": args.ignore_eos, "seed": args.seed},
           "runs": summaries}
    if args.save_requests:
        out["requests"] = per_request
    return out


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        parse_range(args.prompt_len), parse_range(args.output_len)
    except ValueError as e:
        p.error(str(e))
    if args.num_requests < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        p.error("--num-requests and --max-concurrency must be >= 1")
    runs = plan_runs(args, p)
    stream = sys.stderr if args.json else sys.stdout

    def log(msg: str) -> None:
        print(msg, file=stream, flush=True)

    result = asyncio.run(benchmark(args, runs, log))
    summaries = result["runs"]
    log("\n" + to_markdown(summaries))
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "results.json").write_text(json.dumps(json_safe(result), indent=1) + "\n")
        (args.out_dir / "results.csv").write_text(to_csv(summaries))
        (args.out_dir / "results.md").write_text(to_markdown(summaries))
        model = Path(result["model"]).name or result["model"]
        title = (f"jaxserve {result['backend']} - {model} - prompts {args.prompt_len}, outputs {args.output_len}, "
                 f"{args.num_requests} requests per point")
        png = args.out_dir / "latency_vs_throughput.png"
        if plot(summaries, png, title):
            log(f"wrote {args.out_dir}/results.{{json,csv,md}} and {png.name}")
        else:
            log(f"wrote {args.out_dir}/results.{{json,csv,md}}; no plot (pip install matplotlib, or the bench extra)")
    if args.json:
        print(json.dumps(json_safe(result)))
    save_results(args, summaries)
    return 0 if any(s["completed"] for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
