"""Prometheus metrics of the server, in the standard text exposition format (``GET /metrics``).

Latency histograms are observed by the engine thread as outputs leave the engine; engine-wide numbers (pages,
queue lengths, token counters) are read from the engine's latest ``stats()`` snapshot at scrape time, so a
scrape never waits for the engine. Every name starts with ``jaxserve_``.

The load signals routers and autoscalers scrape from vLLM (llm-d's inference scheduler, Dynamo, KEDA / HPA
rules written for vLLM) are exposed a second time under vLLM's names and labels (``model_name``, ``engine``):
``VLLM_GAUGES``, ``VLLM_COUNTERS`` and the ``vllm:`` histograms, fed by the same observations.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from jaxserve.outputs import RequestOutput


def kv_cache_usage(stats: dict) -> float:
    """The fraction of the pool's KV pages in use, from the engine's ``stats()`` snapshot (0 before the pool
    exists): the gauges here and the periodic stats line (``stats_log``) read it."""
    total = stats.get("pages_total") or 0
    return stats.get("pages_used", 0) / total if total else 0.0


CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                  5.0, 10.0)
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

FINISH_REASONS = ("stop", "length", "abort", "error")

# name suffix, stats key, help, kind
_ENGINE_STATS = (
    ("num_requests_running", "num_running", "Sequences in the running batch.", "gauge"),
    ("num_requests_waiting", "num_waiting", "Sequences accepted and waiting to be scheduled.", "gauge"),
    ("kv_pages_total", "pages_total", "KV cache pages in the pool.", "gauge"),
    ("kv_pages_used", "pages_used", "KV cache pages referenced by a live sequence.", "gauge"),
    ("kv_pages_free", "pages_free", "KV cache pages an allocation can take (free or cached and unreferenced).",
     "gauge"),
    ("kv_pages_cached", "pages_cached", "KV cache pages registered in the prefix cache.", "gauge"),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens of accepted requests.", "counter"),
    ("generation_tokens", "generation_tokens", "Tokens generated.", "counter"),
    ("num_preemptions", "num_preemptions", "Sequences preempted (pages released, recomputed later).", "counter"),
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "counter"),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache.", "counter"),
    ("prefix_cache_evictions", "cache_evictions", "Cached pages evicted to make room.", "counter"),
    ("engine_steps", "steps", "Engine steps run.", "counter"),
    # Prefill/decode disaggregation (jaxserve/disagg/staged.py, jaxserve/disagg/remote.py)
    ("kv_transfers", "kv_transfers", "KV hand-overs from the prefill to the decode side.", "counter"),
    ("kv_transfer_bytes", "kv_transfer_bytes", "Bytes of KV moved from the prefill to the decode side.", "counter"),
    ("kv_transfer_seconds", "kv_transfer_seconds", "Time KV copies took, dispatch (or send) to arrival.", "counter"),
    ("kv_transfer_queue_seconds", "kv_transfer_queue_seconds",
     "Time prefilled sequences waited between the stages (for a prefill server, or room on the decode side).",
     "counter"),
    ("kv_transfers_pending", "kv_transfers_pending", "Sequences between the prefill and the decode stage.", "gauge"),
    ("compilations_after_warmup", "compilations_after_warmup",
     "XLA compilations while serving, after warm-up compiled every shape (each one stalled a step).", "counter"),
    ("step_shapes_pending", "step_shapes_pending",
     "Step shapes still compiling in the background after start-up; their steps run in the next larger shape.",
     "gauge"),
    ("kv_cache_bytes_per_token", "kv_bytes_per_token",
     "KV cache bytes one token takes (all layers, K and V, 8-bit scales included).", "gauge"),
    ("spec_proposed_tokens", "spec_proposed_tokens", "Speculative decoding: draft tokens proposed and verified.",
     "counter"),
    ("spec_accepted_tokens", "spec_accepted_tokens", "Speculative decoding: draft tokens the target accepted.",
     "counter"),
    ("spec_emitted_tokens", "spec_emitted_tokens", "Speculative decoding: tokens emitted by verified sequences "
     "(accepted drafts plus the correction or bonus token).", "counter"),
    ("spec_verified_sequences", "spec_verified_sequences", "Speculative decoding: sequence-steps that verified "
     "drafts.", "counter"),
    ("spec_acceptance_rate", "spec_acceptance_rate", "Speculative decoding: accepted over proposed draft tokens, "
     "since start.", "gauge"),
    ("spec_mean_accepted_length", "spec_mean_accepted_length", "Speculative decoding: tokens emitted per verified "
     "sequence-step, since start.", "gauge"),
)


# vLLM's name, stats key, help: the same numbers as above under vLLM's names
VLLM_GAUGES = (
    ("vllm:num_requests_running", "num_running", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "num_waiting", "Number of requests waiting to be processed."),
)
VLLM_COUNTERS = (
    ("vllm:prefix_cache_queries", "prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
     "tokens."),
    ("vllm:prefix_cache_hits", "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    ("vllm:prompt_tokens", "prompt_tokens", "Number of prefill tokens processed."),
    ("vllm:generation_tokens", "generation_tokens", "Number of generation tokens processed."),
    ("vllm:num_preemptions", "num_preemptions", "Cumulative number of preemptions from the engine."),
)
VLLM_LABELS = ("model_name", "engine")


class EngineStatsCollector:
    """Turns the engine's latest ``stats()`` snapshot into metric families at scrape time."""

    def __init__(self, snapshot: Callable[[], dict | None], intake_length: Callable[[], int],
                 model_name: str = ""):
        self._snapshot = snapshot
        self._intake_length = intake_length
        self._labels = [model_name, "0"]

    def describe(self):
        return []

    def collect(self):
        stats = self._snapshot()
        yield GaugeMetricFamily("jaxserve_intake_queue_length",
                                "Requests and aborts handed to the engine thread and not yet taken.",
                                value=self._intake_length())
        if not stats:
            return
        for suffix, key, doc, kind in _ENGINE_STATS:
            if key not in stats:
                continue
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(f"jaxserve_{suffix}", doc, value=float(stats[key]))
        usage = kv_cache_usage(stats)
        yield GaugeMetricFamily("jaxserve_kv_cache_usage_ratio", "Fraction of KV cache pages in use (0..1).",
                                value=usage)
        queries = stats.get("prefix_cache_queries", 0)
        yield GaugeMetricFamily("jaxserve_prefix_cache_hit_rate",
                                "Prompt tokens found in the prefix cache over prompt tokens looked up, since start.",
                                value=stats.get("prefix_cache_hits", 0) / queries if queries else 0.0)
        yield from self._vllm(stats, usage)

    def _vllm(self, stats: dict, usage: float):
        gauges = [(name, doc, stats.get(key, 0)) for name, key, doc in VLLM_GAUGES]
        gauges += [("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
                   ("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage (vLLM's older name).",
                    usage)]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=VLLM_LABELS)
            g.add_metric(self._labels, float(value))
            yield g
        for name, key, doc in VLLM_COUNTERS:
            c = CounterMetricFamily(name, doc, labels=VLLM_LABELS)
            c.add_metric(self._labels, float(stats.get(key, 0)))
            yield c


# ServerMetrics' histogram, vLLM's name, help: the same buckets and observations under vLLM's names
_VLLM_HISTOGRAMS = (
    ("ttft", "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."),
    ("itl", "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
    ("tpot", "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds."),
    ("e2e", "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
    ("queue_time", "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
)


class _VllmHistograms:
    """vLLM's latency histograms, read at scrape time from jaxserve's own: the engine thread observes each token
    once, in one histogram."""

    def __init__(self, metrics: "ServerMetrics", labels: list[str]):
        self._metrics = metrics
        self._labels = labels

    def describe(self):
        return []

    def collect(self):
        for attr, name, doc in _VLLM_HISTOGRAMS:
            (ours,) = getattr(self._metrics, attr).collect()
            buckets = [(s.labels["le"], s.value) for s in ours.samples if s.name.endswith("_bucket")]
            total = next(s.value for s in ours.samples if s.name.endswith("_sum"))
            family = HistogramMetricFamily(name, doc, labels=VLLM_LABELS)
            family.add_metric(self._labels, buckets, total)
            yield family


class ServerMetrics:
    """All metrics of one server process, in a registry of their own."""

    def __init__(self, model_name: str = "", *, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None):
        """``slo_ttft_s`` / ``slo_tpot_s`` (``--slo-ttft-ms`` / ``--slo-tpot-ms``): every finished request is judged
        against the latency objectives given, and the misses counted (``jaxserve_slo_*``), for autoscaling on
        them (deploy/autoscaling.yaml)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("jaxserve_time_to_first_token_seconds",
                              "Arrival to first generated token.", buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("jaxserve_inter_token_latency_seconds",
                             "Time between consecutive outputs of a request, per token.", buckets=_TOKEN_BUCKETS,
                             registry=r)
        self.tpot = Histogram("jaxserve_time_per_output_token_seconds",
                              "Per finished request: (finish - first token) / (output tokens - 1).",
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("jaxserve_e2e_request_latency_seconds", "Arrival to finish, per request.",
                             buckets=_REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram("jaxserve_request_queue_time_seconds", "Arrival to first scheduled step.",
                                    buckets=_TTFT_BUCKETS, registry=r)
        self.prompt_len = Histogram("jaxserve_request_prompt_tokens", "Prompt length of finished requests.",
                                    buckets=(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
                                    registry=r)
        self.finished = Counter("jaxserve_requests_finished", "Finished requests by finish reason.",
                                ["finish_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.finished.labels(reason)
        self.rejected = Counter("jaxserve_requests_rejected",
                                "Requests refused before reaching the engine, by API and reason.",
                                ["api", "reason"], registry=r)
        self.step_errors = Counter("jaxserve_engine_step_errors", "Engine steps that raised an exception.",
                                   registry=r)
        self.ready = Gauge("jaxserve_ready", "1 while the server accepts requests, 0 while warming up or draining.",
                           registry=r)
        info = Gauge("jaxserve_model_info", "The served model (value is always 1).", ["model"], registry=r)
        info.labels(model_name).set(1)
        self.model_name = model_name
        # vLLM's names for the same observations (module doc): its histograms read ours at scrape time
        labels = (model_name, "0")
        r.register(_VllmHistograms(self, list(labels)))
        self.vllm_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                    [*VLLM_LABELS, "finished_reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self.vllm_success.labels(*labels, reason)
        self.slos = {name: limit for name, limit in (("ttft", slo_ttft_s), ("tpot", slo_tpot_s)) if limit is not None}
        self._judged = self._good = 0  # (the engine thread writes them; a scrape reads two ints)
        if self.slos:
            self.slo_requests = Counter("jaxserve_slo_requests", "Finished requests judged against the latency "
                                        "objectives (--slo-ttft-ms, --slo-tpot-ms).", registry=r)
            self.slo_violations = Counter("jaxserve_slo_violations", "Finished requests that missed a latency "
                                          "objective, by objective.", ["slo"], registry=r)
            for name in self.slos:
                self.slo_violations.labels(name)
            self.slo_good = Counter("jaxserve_slo_good_requests", "Finished requests that met every latency "
                                    "objective (goodput).", registry=r)
            Gauge("jaxserve_slo_goodput_ratio", "Of the requests judged so far, the fraction that met every "
                  "objective (1 before any).", registry=r).set_function(self._goodput)
            for name, limit in self.slos.items():
                Gauge(f"jaxserve_slo_{name}_seconds", f"The {name.upper()} objective.", registry=r).set(limit)

    def attach_engine(self, snapshot: Callable[[], dict | None], intake_length: Callable[[], int]) -> None:
        self.registry.register(EngineStatsCollector(snapshot, intake_length, self.model_name))

    def observe_tokens(self, out: RequestOutput, now: float, last_time: float | None) -> None:
        """An output with new tokens left the engine at ``now``; ``last_time`` is the request's previous one."""
        new = max((len(c.delta_token_ids) for c in out.outputs), default=0)
        if not new:
            return
        m = out.metrics
        if last_time is None:
            if m is not None and m.first_token_time is not None:
                self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        else:
            gap = max(0.0, now - last_time) / new
            for _ in range(new):
                self.itl.observe(gap)

    def observe_finished(self, out: RequestOutput) -> None:
        reasons = [c.finish_reason for c in out.outputs]
        reason = ("error" if "error" in reasons else "abort" if "abort" in reasons
                  else (reasons[0] if reasons and reasons[0] else "stop"))
        self.finished.labels(reason).inc()
        if reason != "error":  # vLLM counts the requests that finished, by how (an error is not a success)
            self.vllm_success.labels(self.model_name, "0", reason).inc()
        self.prompt_len.observe(len(out.prompt_token_ids))
        m = out.metrics
        if m is None or m.finished_time is None:
            return
        self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        tokens = len(out.outputs[0].token_ids) if out.outputs else 0
        tpot = None
        if m.first_token_time is not None and tokens > 1:
            tpot = max(0.0, m.finished_time - m.first_token_time) / (tokens - 1)
            self.tpot.observe(tpot)
        if self.slos and reason in ("stop", "length") and m.first_token_time is not None:
            self._judge({"ttft": max(0.0, m.first_token_time - m.arrival_time), "tpot": tpot})

    def _judge(self, seen: dict[str, float | None]) -> None:
        """Count one finished request against the objectives (a one-token request has no TPOT to miss)."""
        self.slo_requests.inc()
        self._judged += 1
        missed = [name for name, limit in self.slos.items() if seen.get(name) is not None and seen[name] > limit]
        for name in missed:
            self.slo_violations.labels(name).inc()
        if not missed:
            self.slo_good.inc()
            self._good += 1

    def _goodput(self) -> float:
        return self._good / self._judged if self._judged else 1.0

    def render(self) -> bytes:
        return generate_latest(self.registry)
