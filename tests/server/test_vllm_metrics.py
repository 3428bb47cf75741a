"""The load signals routers scrape, under vLLM's metric names and labels beside jaxserve's own, read with the
Prometheus client's own parser from a server over the stand-in engine (tests/fake_server.py)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fake_server import MODEL, FakeServer

pytestmark = pytest.mark.quick

LABELS = {"model_name": MODEL, "engine": "0"}


def scrape(server) -> dict[str, dict]:
    """name -> {"type": ..., "samples": {(sample name, sorted labels): value}}"""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(server.http + "/metrics", timeout=10).text):
        out[fam.name] = {"type": fam.type, "samples": {
            (s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples}}
    return out


def value(m: dict, family: str, sample: str | None = None, **labels) -> float:
    key = (sample or family, tuple(sorted({**LABELS, **labels}.items())))
    return m[family]["samples"][key]


def test_vllm_names_and_labels_carry_the_same_numbers():
    with FakeServer(max_num_seqs=2) as server:
        fake = server.fake
        stats = fake.stats
        fake.stats = lambda: {**stats(), "prefix_cache_queries": 40, "prefix_cache_hits": 12, "prompt_tokens": 9,
                              "generation_tokens": 7, "num_preemptions": 1}
        fake.paused = True
        body = {"model": MODEL, "prompt": "ABC", "max_tokens": 3, "stream": True}
        done = []
        threads = [threading.Thread(target=lambda: done.append(httpx.post(
            server.http + "/v1/completions", json=body, timeout=30).status_code)) for _ in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while len(fake.requests) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # a loop iteration publishes the engine's stats
        m = scrape(server)
        for name, kind in (("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
                           ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:gpu_cache_usage_perc", "gauge"),
                           ("vllm:prefix_cache_queries", "counter"), ("vllm:prefix_cache_hits", "counter"),
                           ("vllm:time_to_first_token_seconds", "histogram"),
                           ("vllm:inter_token_latency_seconds", "histogram"),
                           ("vllm:e2e_request_latency_seconds", "histogram"), ("vllm:request_success", "counter"),
                           ("vllm:prompt_tokens", "counter"), ("vllm:generation_tokens", "counter")):
            assert m[name]["type"] == kind, name
        own = {k[0]: v for k, v in m["jaxserve_num_requests_running"]["samples"].items()}
        assert value(m, "vllm:num_requests_running") == own["jaxserve_num_requests_running"] == 2
        assert value(m, "vllm:num_requests_waiting") == 1
        usage = fake.pages_used / (1 << 20)
        assert value(m, "vllm:kv_cache_usage_perc") == value(m, "vllm:gpu_cache_usage_perc") == usage > 0
        assert value(m, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 40
        assert value(m, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 12
        assert value(m, "vllm:num_preemptions", "vllm:num_preemptions_total") == 1

        fake.paused = False
        for t in threads:
            t.join(30)
        assert done == [200] * 3
        server.wait_idle()
        m = scrape(server)
        assert value(m, "vllm:request_success", "vllm:request_success_total", finished_reason="length") == 3
        assert value(m, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 3
        assert value(m, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 6
        assert value(m, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 3
        assert value(m, "vllm:num_requests_running") == 0
        # Every vLLM-named sample carries exactly vLLM's labels.
        for name, fam in m.items():
            if name.startswith("vllm:"):
                for _, labels in fam["samples"]:
                    assert {k for k, _ in labels} - {"le", "finished_reason"} == set(LABELS), (name, labels)


def test_latency_objectives_count_misses_and_goodput():
    """--slo-ttft-ms / --slo-tpot-ms: each finished request is judged against the objectives given; misses are
    counted per objective, and those that met all of them (goodput) beside, for autoscaling on them. An aborted
    request, or one that finished on an error, is not judged; a one-token request has no TPOT to miss."""
    from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from jaxserve.server.metrics import ServerMetrics

    from server_harness import parse_metrics

    def finished(ttft: float, tpot: float, tokens: int = 5, reason: str = "stop") -> RequestOutput:
        times = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.0, first_token_time=10.0 + ttft,
                               finished_time=10.0 + ttft + tpot * (tokens - 1))
        return RequestOutput("r", None, [1, 2], [CompletionOutput(0, "", list(range(tokens)), reason)], metrics=times)

    metrics = ServerMetrics("m", slo_ttft_s=0.5, slo_tpot_s=0.05)
    assert parse_metrics(metrics.render().decode())["jaxserve_slo_goodput_ratio"] == 1.0  # none judged yet
    for out in (finished(0.1, 0.01), finished(0.9, 0.01), finished(0.1, 0.2), finished(0.9, 0.2),
                finished(0.1, 9.0, tokens=1, reason="length"), finished(3.0, 1.0, reason="abort"),
                finished(3.0, 1.0, reason="error")):
        metrics.observe_finished(out)
    got = parse_metrics(metrics.render().decode())
    assert got["jaxserve_slo_requests_total"] == 5
    assert got['jaxserve_slo_violations_total{slo="ttft"}'] == 2 and got['jaxserve_slo_violations_total{slo="tpot"}'] == 2
    assert got["jaxserve_slo_good_requests_total"] == 2 and got["jaxserve_slo_goodput_ratio"] == 2 / 5
    assert (got["jaxserve_slo_ttft_seconds"], got["jaxserve_slo_tpot_seconds"]) == (0.5, 0.05)
    # without objectives, nothing of this is exported
    assert not any("slo" in k for k in parse_metrics(ServerMetrics("m").render().decode()))


def test_a_latency_objective_must_be_positive(capsys):
    from jaxserve.server.args import parse_args

    assert parse_args(["--slo-ttft-ms", "250", "--slo-tpot-ms", "40"]).slo_tpot_ms == 40
    with pytest.raises(SystemExit):
        parse_args(["--slo-ttft-ms", "0"])
    assert "--slo-ttft-ms must be > 0 (got 0)" in capsys.readouterr().err
