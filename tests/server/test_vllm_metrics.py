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
