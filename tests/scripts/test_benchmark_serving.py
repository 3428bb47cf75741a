"""scripts/benchmark_serving.py: its workload and metrics (no server), then the script itself in a subprocess
against a real tiny server over both front ends, with a two-rate sweep."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from server_harness import API_KEY, REPO, server_env, shared_server

sys.path.insert(0, str(REPO / "scripts"))
import benchmark_serving as bs  # noqa: E402

SCRIPT = REPO / "scripts" / "benchmark_serving.py"
NUM_REQUESTS = 12
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


# Without a server ----------------------------------------------------------------------------------------------
def test_ranges_and_rates():
    assert bs.parse_range("16:256") == (16, 256) and bs.parse_range("7") == (7, 7)
    for bad in ("0:4", "5:4", "x"):
        with pytest.raises(ValueError):
            bs.parse_range(bad)
    assert math.isinf(bs.parse_rate("inf")) and bs.parse_rate("2.5") == 2.5
    with pytest.raises(ValueError):
        bs.parse_rate("0")


def test_poisson_arrivals_are_seeded_and_scale_with_rate():
    a = bs.arrival_offsets(2000, 4.0, seed=1)
    assert a[0] == 0 and np.all(np.diff(a) >= 0)
    assert np.allclose(a, bs.arrival_offsets(2000, 4.0, seed=1))
    assert abs(np.diff(a).mean() - 0.25) < 0.025  # mean gap 1/rate
    assert np.allclose(bs.arrival_offsets(2000, 8.0, seed=1), a / 2)  # one pattern, scaled
    assert not np.allclose(bs.arrival_offsets(2000, 4.0, seed=2), a)
    assert np.all(bs.arrival_offsets(5, math.inf, seed=1) == 0)


def test_workload_shape_is_shared_across_runs_but_not_the_ids():
    w0 = bs.make_workload(20, (4, 9), (1, 3), seed=3, run_index=0, token_range=(3, 50))
    w1 = bs.make_workload(20, (4, 9), (1, 3), seed=3, run_index=1, token_range=(3, 50))
    assert [(s.prompt_len, s.output_len) for s in w0] == [(s.prompt_len, s.output_len) for s in w1]
    assert all(len(s.prompt) == s.prompt_len and 4 <= s.prompt_len <= 9 and 1 <= s.output_len <= 3 for s in w0)
    assert all(3 <= t < 50 for s in w0 for t in s.prompt)
    assert [s.prompt for s in w0] != [s.prompt for s in w1]
    assert [s.prompt for s in w0] == [s.prompt for s in bs.make_workload(20, (4, 9), (1, 3), seed=3,
                                                                         token_range=(3, 50))]
    text = bs.make_workload(3, (5, 5), (2, 2), seed=0, kind="text")
    assert all(isinstance(s.prompt, str) and len(s.prompt.split()) == 5 for s in text)


def _result(i, ttft, e2e, tokens, ok=True, itl=()):
    return bs.RequestResult(i, 8, tokens, ok=ok, ttft_s=ttft, e2e_s=e2e, prompt_tokens=8, output_tokens=tokens,
                            itl_s=list(itl), error=None if ok else "HTTP 500: boom")


def test_summary_tpot_excludes_the_first_token_and_goodput_uses_slos():
    results = [_result(0, 0.1, 0.5, 5, itl=[0.1] * 4), _result(1, 0.2, 0.2, 1), _result(2, 0.9, 1.3, 3),
               _result(3, math.nan, math.nan, 0, ok=False)]
    assert results[0].tpot_s == pytest.approx(0.1)  # (0.5 - 0.1) / (5 - 1)
    assert math.isnan(results[1].tpot_s) and math.isnan(results[3].tpot_s)
    s = bs.summarize(results, 2.0, rate=math.inf, max_concurrency=None, slos={"ttft": 500, "tpot": 150})
    assert (s["completed"], s["failed"], s["num_requests"]) == (3, 1, 4)
    assert s["total_output_tokens"] == 9 and s["output_throughput"] == pytest.approx(4.5)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["tpot_ms"]["mean"] == pytest.approx(150.0)  # requests 0 and 2; the one-token request has none
    # Request 1's undefined TPOT is no violation; request 2 misses the TTFT SLO.
    assert s["goodput"] == pytest.approx(1.0)
    assert s["errors"] == {"HTTP 500: boom": 1}
    none = bs.summarize([_result(0, 0.1, 0.1, 1)], 1.0, rate=1.0, max_concurrency=2, slos={})
    assert math.isnan(none["goodput"]) and all(math.isnan(v) for v in none["tpot_ms"].values())
    assert bs.json_safe(none)["tpot_ms"]["p50"] is None and bs.json_safe({"r": math.inf}) == {"r": "inf"}
    table = bs.to_markdown([s, none])
    assert table.count("\n") == 4 and "n/a" in table
    rows = list(csv.DictReader(bs.to_csv([s, none]).splitlines()))
    assert rows[1]["tpot_ms_p50"] == "" and rows[0]["request_rate"] == "inf"


# Against a real server -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(request):
    return shared_server(request)


def run_benchmark(server, backend: str, *args: str) -> dict:
    port = (server.http.rsplit(":", 1) if backend == "openai" else server.grpc.rsplit(":", 1))[1]
    cmd = [sys.executable, str(SCRIPT), "--backend", backend, "--host", "127.0.0.1", "--port", port,
           "--api-key", API_KEY, "--num-requests", str(NUM_REQUESTS), "--request-timeout", "60", "--json",
           "--save-requests", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=server_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def check_run(run: dict, requests: list[dict], exact_itl: bool) -> None:
    assert run["completed"] + run["failed"] == run["num_requests"] == len(requests) == NUM_REQUESTS
    assert run["failed"] == 0, run["errors"]
    assert 1 <= run["peak_concurrency"] <= NUM_REQUESTS
    assert run["total_output_tokens"] == sum(r["output_tokens"] for r in requests)
    assert run["total_input_tokens"] == sum(r["prompt_tokens"] for r in requests)
    assert run["request_throughput"] == pytest.approx(NUM_REQUESTS / run["duration_s"])
    for r in requests:
        # ignore_eos: exactly the planned length; counts from the server's usage; token-id prompts as sent.
        assert r["ok"] and r["finish_reason"] == "length"
        assert r["output_tokens"] == r["output_len"] and r["prompt_tokens"] == r["prompt_len"]
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        if r["output_tokens"] == 1:
            assert r["tpot_s"] is None and r["itl_s"] == []
        else:
            assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1))
        if exact_itl:
            assert len(r["itl_s"]) == r["output_tokens"] - 1
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        st = run[name]
        assert st["p50"] <= st["p90"] <= st["p99"], (name, st)
    assert run["ttft_ms"]["p50"] <= run["e2e_ms"]["p99"]
    assert 0 <= run["goodput"] <= run["request_throughput"] + 1e-9


@pytest.mark.parametrize("backend,seed", [("openai", 11), ("grpc", 12)])
def test_rate_sweep(server, tmp_path, backend, seed):
    out = run_benchmark(server, backend, "--seed", str(seed), "--prompt-len", "4:24", "--output-len", "1:4",
                        "--sweep-rates", "25,inf", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000",
                        "--out-dir", str(tmp_path))
    assert out["backend"] == backend and out["model"] == "tiny-llama"
    assert [r["request_rate"] for r in out["runs"]] == [25.0, "inf"]
    for run, requests in zip(out["runs"], out["requests"]):
        check_run(run, requests, exact_itl=True)  # one token per chunk from this engine over both APIs
        assert run["goodput"] == pytest.approx(run["request_throughput"])  # generous SLOs: every request meets them
    assert out["runs"][1]["peak_concurrency"] == NUM_REQUESTS  # inf: all at once
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["runs"] == out["runs"]
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [r["request_rate"] for r in rows] == ["25.0", "inf"]
    assert [int(r["completed"]) + int(r["failed"]) for r in rows] == [NUM_REQUESTS] * 2
    assert (tmp_path / "results.md").read_text().count("\n") == 4
    if HAVE_MATPLOTLIB:
        assert (tmp_path / "latency_vs_throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_token_outputs_and_concurrency_cap(server):
    """With output length 1 TPOT and ITL are undefined (null), not an error; the cap holds."""
    out = run_benchmark(server, "grpc", "--seed", "13", "--prompt-len", "4:16", "--output-len", "1",
                        "--max-concurrency", "3", "--slo-tpot-ms", "0.001")
    run = out["runs"][0]
    assert run["max_concurrency"] == 3 and run["peak_concurrency"] <= 3
    assert run["completed"] + run["failed"] == NUM_REQUESTS and run["total_output_tokens"] == run["completed"]
    assert all(v is None for v in run["tpot_ms"].values()) and all(v is None for v in run["itl_ms"].values())
    assert run["goodput"] == pytest.approx(run["request_throughput"])  # no TPOT, so no TPOT violation


def test_text_prompts_over_http(server):
    out = run_benchmark(server, "openai", "--seed", "14", "--prompt-kind", "text", "--prompt-len", "3:8",
                        "--output-len", "2", "--request-rate", "50", "--max-concurrency", "4")
    run = out["runs"][0]
    assert run["failed"] == 0 and run["total_output_tokens"] == 2 * NUM_REQUESTS
    # The prompt token count is the server's tokenization of the words, not a client-side count.
    assert all(r["prompt_tokens"] >= 1 for r in out["requests"][0])


def test_a_burst_of_eight_times_the_batch_all_completes(server):
    """The docs' load example at rate inf: 64 requests at once on a server of 8 batch slots, started without
    --max-waiting-requests, all complete; none is refused as overloaded (vLLM queues whatever it can hold)."""
    out = run_benchmark(server, "grpc", "--seed", "15", "--num-requests", "64", "--prompt-len", "4:8",
                        "--output-len", "1:2", "--request-rate", "inf")
    run = out["runs"][0]
    assert (run["num_requests"], run["completed"], run["failed"]) == (64, 64, 0), run["errors"]
    assert run["peak_concurrency"] > 8 * 4  # more than the old default queue (4 x --max-num-seqs) held at once
