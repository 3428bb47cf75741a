"""The capacity planner: its simulated clock against hand-computed step sums, its workload against the serving
benchmark's, the largest-rate search, calibration on a real engine, and the command line."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxserve.tools.plan import calibration, cli, simulator, step_model, workload
from jaxserve.tools.plan.simulator import Deployment, EngineShape, max_rate, simulate, summarize
from jaxserve.tools.plan.step_model import LinearStepModel, StepFeatures
from jaxserve.tools.plan.workload import PlannedRequest, poisson_workload

ROOT = Path(__file__).resolve().parents[2]

# Decode steps: 10 ms flat. Prompt steps: 1 ms per padded token (the token bucket).
FLAT = LinearStepModel(decode=(0.01, 0.0, 0.0, 0.0), prompt=(0.0, 0.001, 0.0, 0.0))
ENGINE = EngineShape(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=2048, num_pages=1024, page_size=16)


def _bench_serving():
    spec = importlib.util.spec_from_file_location("benchmark_serving", ROOT / "scripts" / "benchmark_serving.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.quick
def test_workload_is_the_serving_benchmarks_for_the_same_seed():
    bench = _bench_serving()
    specs = bench.make_workload(40, (16, 256), (32, 64), seed=7)
    arrivals = bench.arrival_offsets(40, 3.0, seed=7)
    mine = poisson_workload(40, 3.0, (16, 256), (32, 64), seed=7)
    assert [r.prompt_len for r in mine] == [s.prompt_len for s in specs]
    assert [r.output_len for r in mine] == [s.output_len for s in specs]
    np.testing.assert_allclose([r.arrival_s for r in mine], arrivals)


@pytest.mark.quick
def test_a_lone_request_costs_exactly_its_steps():
    [t] = simulate([PlannedRequest(0.0, 100, 5)], Deployment("c", 512), FLAT, ENGINE)
    # One prompt step of 100 tokens padded to the 128-token bucket, then four 10 ms decode steps.
    np.testing.assert_allclose(t.token_times, [0.128, 0.138, 0.148, 0.158, 0.168])
    r = summarize([t], "c", 1.0, 1, slo_ttft_s=0.2, slo_tpot_s=0.011)
    assert r.ttft_p50_ms == pytest.approx(128) and r.tpot_p50_ms == pytest.approx(10) and r.attainment == 1.0
    assert summarize([t], "c", 1.0, 1, slo_ttft_s=0.1, slo_tpot_s=0.011).attainment == 0.0


def test_a_long_prompt_is_chunked_as_the_engine_chunks_it():
    [t] = simulate([PlannedRequest(0.0, 1000, 2)], Deployment("c", 256), FLAT, ENGINE)
    # 256 + 256 + 256 + 232 tokens, each step padded to 256: four 0.256 s steps, then one decode.
    np.testing.assert_allclose(t.token_times, [1.024, 1.034])


@pytest.mark.quick
def test_decodes_ride_in_prompt_steps_and_share_them():
    a, b = simulate([PlannedRequest(0.0, 16, 3), PlannedRequest(0.1, 100, 2)], Deployment("c", 512), FLAT, ENGINE)
    # a: prompt step 16 tokens (16 ms), decode at 26 ms ... b arrives at 0.1 while a's last decode runs? a finishes
    # at 0.036 (three tokens: 0.016, 0.026, 0.036) before b arrives; b alone: 128 ms prompt step from 0.1.
    np.testing.assert_allclose(a.token_times, [0.016, 0.026, 0.036])
    np.testing.assert_allclose(b.token_times, [0.228, 0.238])
    # Now b arrives while a decodes: b's prompt (100 tokens) and a's decode (1) share one 128-token step.
    a, b = simulate([PlannedRequest(0.0, 16, 4), PlannedRequest(0.02, 100, 2)], Deployment("c", 512), FLAT, ENGINE)
    np.testing.assert_allclose(a.token_times, [0.016, 0.026, 0.154, 0.164])
    np.testing.assert_allclose(b.token_times, [0.154, 0.164])


@pytest.mark.quick
def test_disaggregated_first_token_comes_from_prefill_and_the_transfer_delays_the_second():
    dep = Deployment("d", 512, prefill=1, decode=1)
    [t] = simulate([PlannedRequest(0.0, 100, 3)], dep, FLAT, ENGINE, kv_bytes_per_token=1000.0,
                   transfer_bytes_per_s=1e6)
    # Prefill step 0.128; 100 tokens x 1000 bytes at 1 MB/s = 0.1 s; then the decode side's steps (10 ms each;
    # the arriving prompt's KV is not recomputed: its first step there is a decode).
    np.testing.assert_allclose(t.token_times, [0.128, 0.238, 0.248])


@pytest.mark.quick
def test_disaggregation_keeps_decodes_out_of_prompt_steps():
    """A long prompt arriving mid-decode stalls the colocated decode (its token waits for the prompt step) but
    not the disaggregated one."""
    reqs = [PlannedRequest(0.0, 16, 6), PlannedRequest(0.03, 500, 2)]
    colocated = simulate(reqs, Deployment("c", 512, 0, 2), FLAT, ENGINE)  # two engines, least loaded first
    split = simulate(reqs, Deployment("d", 512, 1, 1), FLAT, ENGINE)
    gap = lambda t: max(np.diff(t.token_times))  # noqa: E731
    single = simulate(reqs, Deployment("c1", 512, 0, 1), FLAT, ENGINE)
    assert gap(single[0]) == pytest.approx(0.512)  # the decode waited for the 512-token step it rode in
    assert gap(split[0]) == pytest.approx(0.010)
    assert gap(colocated[0]) == pytest.approx(0.010)  # the second engine took the prompt


def test_largest_rate_search_brackets_where_attainment_drops():
    reqs = poisson_workload(300, 1.0, (100, 100), (10, 10), seed=0)

    def run(rate):
        tracks = simulate(workload.scale_arrivals(reqs, rate), Deployment("c", 512), FLAT, ENGINE)
        return summarize(tracks, "c", rate, 1, slo_ttft_s=0.5, slo_tpot_s=0.05)

    best = max_rate(run, 0.01, 100.0, attainment=0.9, tolerance=0.05)
    # Each request needs at least 0.128 s of prompt step and 9 decode steps: fewer than ~7 req/s can be served.
    assert 0.5 < best < 7.8
    assert run(best).attainment >= 0.9
    assert run(best * 1.3).attainment < 0.9


@pytest.mark.quick
def test_early_stop_agrees_with_the_full_run_on_an_overloaded_deployment():
    reqs = poisson_workload(400, 30.0, (100, 100), (10, 10), seed=1)
    full = summarize(simulate(reqs, Deployment("c", 512), FLAT, ENGINE), "c", 30, 1, 0.5, 0.05)
    early = simulate(reqs, Deployment("c", 512), FLAT, ENGINE, slo_ttft_s=0.5, max_ttft_misses=40)
    assert full.attainment < 0.9
    assert summarize(early, "c", 30, 1, 0.5, 0.05).attainment < 0.9
    assert sum(bool(t.token_times) for t in early) < len(reqs)  # it did stop early


@pytest.mark.quick
def test_roofline_model_is_weight_bound_at_batch_one_and_compute_bound_in_prefill():
    from jaxserve.tools.aot import model_config

    m = step_model.roofline_from_config(model_config("llama-3.1-8b"), chip="h100", chips=1, efficiency=1.0)
    one = m.seconds(StepFeatures(True, 1, 1, 1, 0.0))
    assert one == pytest.approx(m.weight_bytes / 3350e9, rel=1e-3)  # ~16 GB of weights at 3.35 TB/s
    prefill = m.seconds(StepFeatures(False, 2048, 2048, 2048, 2048 * 2049 / 2))
    assert prefill > 2048 * m.flops_per_token / 989e12 * 0.999
    assert prefill > 5 * one


@pytest.mark.quick
def test_linear_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    truth = LinearStepModel(decode=(0.002, 1e-4, 2e-6, 0.0), prompt=(0.003, 2e-4, 1e-6, 1e-8))
    samples = []
    for _ in range(40):
        for decode in (True, False):
            padded = int(rng.choice([16, 32, 64, 128, 256]))
            f = StepFeatures(decode, padded, padded, 0, 0.0 if decode else float(rng.integers(1000, 50000)),
                             int(rng.integers(100, 5000)))
            samples.append((f, truth.seconds(f)))
    fit = LinearStepModel.fit(samples)
    np.testing.assert_allclose(fit.decode, truth.decode, rtol=1e-4, atol=1e-12)
    np.testing.assert_allclose(fit.prompt, truth.prompt, rtol=1e-4, atol=1e-12)


@pytest.mark.quick
def test_bad_input_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match="--prompt-len"):
        workload.parse_range("0:4", "--prompt-len")
    with pytest.raises(ValueError, match="--splits"):
        simulator.parse_split("2-2")
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_len": 4}\n')
    with pytest.raises(ValueError, match="output_len"):
        workload.read_trace(trace)
    with pytest.raises(ValueError, match="chip"):
        step_model.roofline_from_config(None, chip="a100", chips=1)
    with pytest.raises(SystemExit):
        cli.main(["simulate", "--chip", "v6e", "--model", "llama-3.1-8b", "--chips", "4", "--splits", "1:2"])


def test_simulate_command_writes_every_report(tmp_path, capsys):
    out = tmp_path / "plan"
    code = cli.main(["simulate", "--model", "llama-3.1-8b", "--chip", "v6e", "--chips", "4", "--num-requests",
                      "30", "--prompt-len", "512", "--output-len", "16", "--rates", "2", "--chunks", "256,512",
                      "--splits", "1:3", "--chip-hour-usd", "2.7", "--search-duration-s", "2", "--out-dir",
                      str(out)])
    assert code == 0
    report = json.loads((out / "results.json").read_text())
    assert [b["deployment"] for b in report["best"]] == [
        "colocated x4, chunk 256", "colocated x4, chunk 512", "disaggregated 1:3, chunk 512"]
    for b in report["best"]:
        assert b["max_rate"] > 0 and b["max_rate_per_chip"] == pytest.approx(b["max_rate"] / 4)
        assert math.isfinite(b["usd_per_million_output_tokens"])
    assert len(report["results"]) == 3 and (out / "results.csv").is_file() and (out / "results.md").is_file()
    assert "largest rate meeting the SLOs" in capsys.readouterr().out


def test_calibrate_times_the_engines_own_steps(tmp_path):
    from jaxserve.config.engine import EngineConfig
    from jaxserve.engine.engine import Engine

    from tiny import build_tiny_model

    folder = build_tiny_model("llama", tmp_path / "m")
    engine = Engine(EngineConfig(model=str(folder), page_size=4, num_pages=64, max_model_len=64, max_num_seqs=4,
                                 max_num_batched_tokens=32, warmup=False, compilation_cache_dir=None))
    model, samples = calibration.calibrate(engine, contexts=[8, 40], decode_steps=3, log=lambda m: None)
    kinds = {f.decode for f, _ in samples}
    assert kinds == {True, False}
    # Per context: 3 decode slot buckets (1, 2, 4), each with its prompt steps and 3 decode steps.
    assert sum(f.decode for f, _ in samples) >= 2 * 3 * 3
    assert sum(not f.decode for f, _ in samples) >= 2 * 3
    assert all(s > 0 for _, s in samples)
    assert all(c >= 0 for c in model.decode + model.prompt)
    assert engine.scheduler.__class__.__name__ == "ReplicatedScheduler"  # the engine's own scheduler is back


@pytest.mark.quick
def test_step_features_follow_the_compiled_shape():
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.scheduler.sequence import Sequence

    eng = EngineShape(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_pages=256, page_size=4)
    sched, shapes = eng.scheduler(), eng.shapes()
    for i, n in enumerate((19, 39, 7)):
        sched.add(Sequence(str(i), [1] * n, SamplingParams(max_tokens=4, ignore_eos=True)))
    prompt = sched.schedule()
    f = step_model.step_features(prompt, shapes, eng.page_size)
    assert not f.decode and f.new_tokens == 19 + 39 + 6  # the budget of 64 cuts the third prompt at 6 tokens
    assert f.padded_tokens == 64 and f.keys_read == 64
    assert f.prompt_pairs == 19 * 20 / 2 + 39 * 40 / 2 + 6 * 7 / 2
    sched.update(prompt, [0, 0, 0])
    sched.update(sched.schedule(), [0, 0, 0])  # the third prompt's last token beside two decodes
    decode = sched.schedule()
    f = step_model.step_features(decode, shapes, eng.page_size)
    # Three decodes (KV 21, 41, 8 tokens): 4 slots (bucket) x the page table of decode steps, always the full
    # 64 pages (max_model_len 256 / 4), x 4 tokens.
    assert f.decode and f.padded_tokens == 4 and f.keys_read == 21 + 41 + 8
    assert f.padded_keys == 4 * 64 * 4


@pytest.mark.quick
def test_sliding_window_caps_keys_pairs_and_pages():
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.scheduler.sequence import Sequence

    assert step_model._causal_pairs(0, 10, None) == 55 and step_model._causal_pairs(0, 10, 4) == 1 + 2 + 3 + 4 * 7
    assert step_model._causal_pairs(2, 6, 4) == 3 + 4 + 4 + 4 and step_model._causal_pairs(6, 10, 4) == 16
    eng = EngineShape(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_pages=256, page_size=4,
                      attention_window=8)
    sched, shapes = eng.scheduler(), eng.shapes()
    sched.add(Sequence("w", [1] * 40, SamplingParams(max_tokens=4, ignore_eos=True)))
    prompt = sched.schedule()
    f = step_model.step_features(prompt, shapes, eng.page_size, window=8)
    assert f.keys_read == 8 and f.prompt_pairs == step_model._causal_pairs(0, 40, 8) < 40 * 41 / 2
    sched.update(prompt, [0])
    sched.schedule()  # the decode releases the pages its window has passed, as the engine's scheduler does
    assert sched.block_manager.stats()["pages_released_behind_window"] > 0


@pytest.mark.quick
def test_mixed_window_model_is_planned_per_layer(tmp_path):
    """Gemma-style interleaved windowed and global layers: keys, pairs and transfer bytes are averaged over the
    layers, the global pool holds only the global layers' KV beside the windowed layers' own pool, sized as the
    engine sizes it, and the simulated scheduler recycles the windowed pool as the engine's does."""
    from jaxserve.config.engine import EngineConfig
    from jaxserve.engine.engine import Engine
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.scheduler.sequence import Sequence
    from jaxserve.scheduler.window_pool import window_pages_needed

    from tiny import build_tiny_model

    windows = (8, 8, None)  # two windowed layers for each global one
    assert step_model.kv_tokens(40, windows) == pytest.approx(2 / 3 * 8 + 1 / 3 * 40)
    assert step_model.kv_tokens(40, None) == 40 and step_model.kv_tokens(40, 8) == 8
    fields = simulator.window_fields(windows, page_size=4, max_num_seqs=8, max_num_batched_tokens=64, num_pages=256)
    local = window_pages_needed(8, 4, 8, 64)
    assert fields == {"local_window": 8, "local_pages": local, "layer_windows": windows}
    assert simulator.window_fields((None, None), page_size=4, max_num_seqs=8, max_num_batched_tokens=64) == {}
    assert simulator.window_fields((8, 8), page_size=4, max_num_seqs=8, max_num_batched_tokens=64) == \
        {"attention_window": 8}
    # Capacity: the global pool's pages carry a third of the KV bytes, after the windowed pool's share.
    budget, per_token = 1e6, 96.0
    as_global = simulator.pool_pages(budget, per_token, 4, {})
    mixed = simulator.pool_pages(budget, per_token, 4, fields)
    assert mixed == int((budget - local * 4 * per_token * 2 / 3) // (per_token / 3 * 4)) and mixed > 2 * as_global

    eng = EngineShape(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_pages=256, page_size=4,
                      **fields)
    sched, shapes = eng.scheduler(), eng.shapes()
    sched.add(Sequence("g", [1] * 40, SamplingParams(max_tokens=4, ignore_eos=True)))
    prompt = sched.schedule()
    f = step_model.step_features(prompt, shapes, eng.page_size, window=eng.windows)
    assert f.keys_read == pytest.approx(step_model.kv_tokens(40, windows))
    assert f.prompt_pairs == pytest.approx(2 / 3 * step_model._causal_pairs(0, 40, 8) + 1 / 3 * 40 * 41 / 2)
    sched.update(prompt, [0])
    sched.schedule()
    stats = sched.block_manager.stats()
    assert stats["window_pages_total"] == local and stats["pages_released_behind_window"] > 0

    # The engine sets up the same pools for a Gemma checkpoint (its scheduler config is what the planner builds).
    path = build_tiny_model("gemma2", tmp_path / "gemma2")
    engine = Engine(EngineConfig(model=str(path), page_size=4, max_model_len=64, max_num_seqs=4,
                                 max_num_batched_tokens=16, num_pages=64, warmup=False, compilation_cache_dir=None))
    cfg, sc = engine.model_config, engine.executor.info.scheduler_config
    planned = simulator.window_fields(cfg.sliding_windows, page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                 num_pages=64)
    assert (sc.local_window, sc.local_pages) == (planned["local_window"], planned["local_pages"])
    assert None in cfg.sliding_windows and planned["layer_windows"] == cfg.sliding_windows

    # Sized from a memory budget, the engine's global pool gets the pages the planner counts, more than pricing
    # every page at every layer's bytes would give, and both pools together fit the budget.
    import jax
    import jax.numpy as jnp

    from jaxserve.executor.kv_cache import bytes_per_token

    per_token = bytes_per_token(cfg, jnp.float32)
    budget = 24 * 4 * per_token  # 24 pages of every layer
    sized = Engine(EngineConfig(model=str(path), page_size=4, max_model_len=64, max_num_seqs=4,
                                max_num_batched_tokens=16, cpu_kv_cache_gib=budget / 2**30, warmup=False,
                                compilation_cache_dir=None, dtype="float32"))
    fields = simulator.window_fields(cfg.sliding_windows, page_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    pages = sized.executor.cache_config.num_pages
    assert pages == simulator.pool_pages(budget, per_token, 4, fields) > 24
    assert sum(a.nbytes for a in jax.tree.leaves(sized.executor.runner.kv_cache)) <= budget


def _readme_plan_command() -> list[str]:
    """The README's ``plan simulate`` example, as written there (its arguments after ``simulate``)."""
    import shlex

    text = (ROOT / "README.md").read_text()
    start = text.index("python -m jaxserve.plan simulate")
    lines = []
    for line in text[start:].splitlines():
        lines.append(line.split("#")[0].rstrip().removesuffix("\\"))
        if not line.split("#")[0].rstrip().endswith("\\"):
            break
    words = shlex.split(" ".join(lines))
    return words[words.index("simulate") + 1:]


def test_readme_example_runs_shrunk_and_shows_progress_on_stderr(capsys):
    """The README's example, shrunk by the flags the README names for a quick look: it exits 0, prints one
    progress line per simulated run and per finished deployment on stderr, and the report (only) on stdout."""
    argv = _readme_plan_command()
    assert argv[:2] == ["--model", "llama-3.1-8b"] and "--splits" in argv
    code = cli.main(["simulate", *argv, "--search-duration-s", "0.5", "--num-requests", "10"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "largest rate meeting the SLOs" in out and "plan:" not in out
    lines = err.splitlines()
    assert lines and all(line.startswith("plan: ") for line in lines)
    finished = [line for line in lines if " done (" in line]
    assert [line.split(" done")[0] for line in finished] == [f"plan: {i}/4" for i in range(1, 5)]
    assert all("s left" in line for line in finished)
    assert sum("within the SLOs, " in line for line in lines) >= 4 * 3  # each search ran at least three rates


@pytest.mark.quick
def test_largest_rate_search_comes_down_from_the_top_and_bisects():
    """Against a known threshold: the answer is within the tolerance below it, no rate under half of it is run
    (a nearly idle deployment costs a step per token), and the ends of the range are answered as such."""
    import types

    def search(threshold, lo=0.01, hi=1000.0):
        ran = []

        def run(rate):
            ran.append(rate)
            return types.SimpleNamespace(attainment=1.0 if rate <= threshold else 0.5)

        return max_rate(run, lo, hi, attainment=0.9, tolerance=0.02), ran

    best, ran = search(37.0)
    assert 37.0 / 1.02 <= best <= 37.0 and min(ran) >= 37.0 / 2 and len(ran) < 20
    assert search(2000.0)[0] == 1000.0 and search(0.001)[0] == 0.0
    best, ran = search(0.015)
    assert 0.015 / 1.02 <= best <= 0.015


@pytest.mark.quick
def test_a_run_stops_once_waiting_requests_are_sure_to_miss_the_ttft_slo():
    """A burst of 100 prompts of 500 tokens on one engine (512-token steps of 0.512 s): after the first step every
    request has waited past the 0.5 s SLO, so more than 10 misses are certain before 10 late first tokens exist."""
    reqs = [PlannedRequest(0.0, 500, 4) for _ in range(100)]
    early = simulate(reqs, Deployment("c", 512), FLAT, ENGINE, slo_ttft_s=0.5, max_ttft_misses=10)
    assert sum(bool(t.token_times) for t in early) <= 2
    assert summarize(early, "c", math.inf, 1, 0.5, 0.05).attainment < 0.9
    full = summarize(simulate(reqs, Deployment("c", 512), FLAT, ENGINE), "c", math.inf, 1, 0.5, 0.05)
    assert full.attainment < 0.9  # the verdict the early stop gave
