"""Start-up with ``compile_in_background`` (the server's default off a GPU): the warm-up compiles the largest prefill and
decode shapes, the engine serves at once, each step runs in the smallest shape compiled so far, the other shapes
compile on a background thread (never in a step), are saved to the executable store, and ``close`` drops those
not started, waiting a bounded time for those being compiled (a stopping server does not wait for them)."""

from __future__ import annotations

import re
import threading
import time
from types import SimpleNamespace

import httpx
import jax
import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.executor import executor as executor_module
from jaxserve.executor.background_compile import still_compiling
from jaxserve.executor.batch import StepKind, StepShapes
from jaxserve.executor.runner import CompileCounter
from jaxserve.executor.warmup import Warmup
from jaxserve.server.args import build_parser
from server_harness import MODEL_NAME, ServerProcess, tiny_model
from tiny import build_tiny_model, hf_greedy, hf_model, train_tokenizer

PROMPT = list(range(3, 30))  # 27 tokens: two 16-token chunks, then decodes


def test_a_step_takes_the_smallest_compiled_bucket_that_holds_it():
    shapes = StepShapes(max_num_seqs=8, max_num_batched_tokens=128, pages_per_seq=4)
    assert shapes.token_buckets() == [16, 32, 64, 128] and shapes.decode_buckets() == [1, 2, 4, 8]
    first = shapes.with_compiled({(False, 128), (True, 8)})
    assert [first.token_bucket(n) for n in (1, 16, 17, 100)] == [128] * 4
    assert [first.seq_bucket(n) for n in (1, 3, 8)] == [8] * 3
    # the ladders and the shape list stay whole: they say what is to be compiled
    assert first.token_buckets() == shapes.token_buckets() and first.all_shapes() == shapes.all_shapes()
    more = first.with_compiled(first.compiled | {(False, 32), (True, 2)})
    assert [more.token_bucket(n) for n in (1, 32, 33)] == [32, 32, 128]
    assert [more.seq_bucket(n) for n in (1, 2, 3)] == [2, 2, 8]
    every = more.with_compiled({(s[0], s[1]) for s in shapes.all_shapes()})
    assert every.compiled is None and every == shapes


def test_the_compile_guard_counts_only_the_calling_threads_compilations():
    counter = CompileCounter()
    thread = threading.Thread(target=lambda: jax.jit(lambda x: x * 3 + 1).lower(np.ones(7, np.float32)).compile())
    thread.start()
    thread.join()
    assert counter.count() == 1 and counter.thread_count() == 0
    jax.jit(lambda x: x * 5 - 2).lower(np.ones(9, np.float32)).compile()
    assert counter.count() == 2 and counter.thread_count() == 1


def test_the_server_compiles_in_the_background_unless_told_not_to():
    assert build_parser().parse_args([]).compile_in_background is None  # auto: the engine decides
    assert build_parser().parse_args(["--compile-in-background"]).compile_in_background is True
    assert build_parser().parse_args(["--no-compile-in-background"]).compile_in_background is False
    assert EngineConfig().compile_in_background is False  # offline jobs (LLM) compile everything before the clock


@pytest.mark.parametrize("setting, platform, expected", [
    (None, "cpu", True), (None, "tpu", True), (None, "gpu", False),
    (True, "gpu", True), (False, "cpu", False)])
def test_auto_compiles_in_the_background_except_on_a_gpu(setting, platform, expected):
    # On a GPU, XLA's compiler times candidate kernels on the device that serves.
    executor = SimpleNamespace(config=SimpleNamespace(compile_in_background=setting),
                               runner=SimpleNamespace(sample_device=SimpleNamespace(platform=platform)))
    assert Warmup(executor, None, None).compiles_in_background is expected


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), tokenizer=train_tokenizer())


def _config(model_dir, cache_dir) -> EngineConfig:
    # Prefill buckets of 16 and 32 tokens, decode buckets of 1, 2 and 4 rows: 3 shapes left for the background.
    return EngineConfig(model=str(model_dir), page_size=4, num_pages=48, max_model_len=64, max_num_seqs=4,
                        max_num_batched_tokens=32, seed=0, compilation_cache_dir=cache_dir,
                        compile_in_background=True)


def _serve(engine: Engine) -> dict:
    engine.add_request("greedy", PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.add_request("sampled", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.9, seed=4, logprobs=2,
                                                            repetition_penalty=1.2, ignore_eos=True))
    tokens = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return tokens


@pytest.fixture
def gated(monkeypatch):
    """Hold every shape the background compile takes until the test sets the event; count them."""
    gate, taken = threading.Event(), []
    prepare = Warmup._prepare_shape

    def held(self, shape, store, state=None):
        if self.done:  # the background's shapes (the warm-up's run before it is set)
            taken.append(shape)
            assert gate.wait(300)
        return prepare(self, shape, store, state)

    monkeypatch.setattr(Warmup, "_prepare_shape", held)
    return gate, taken


def test_serving_starts_on_the_largest_shapes_and_moves_to_each_shape_once_compiled(model_dir, tmp_path, gated):
    gate, taken = gated
    engine = Engine(_config(model_dir, str(tmp_path / "cache")))
    executor = engine.executor
    every = executor.shapes.all_shapes()
    assert [s[1] for s in every if not s[0]] == [16, 32] and [s[1] for s in every if s[0]] == [1, 2, 4]
    assert executor.startup.summary["shapes_later"] == 3 == executor.startup.pending
    assert executor.shapes.compiled == {(False, 32), (True, 4)}
    assert engine.stats()["step_shapes_pending"] == 3

    tokens = _serve(engine)  # while the background holds its first shape
    hf = hf_model(model_dir)
    assert tokens["greedy"] == hf_greedy(hf, PROMPT, 8)
    assert executor.startup.late_compilations == 0  # no step compiled: each ran in a compiled shape
    assert executor.shapes.token_bucket(3) == 32 and executor.shapes.seq_bucket(1) == 4

    gate.set()
    assert executor.startup.wait(timeout=600)
    assert executor.startup.pending == 0 and executor.shapes.compiled is None
    assert executor.shapes.token_bucket(3) == 16 and executor.shapes.seq_bucket(1) == 1
    # smaller shapes first, a decode and a prefill shape in turn (the order the background threads take them)
    assert [(s[0], s[1]) for s in executor.startup.shapes_for_later(every, [])] == [(True, 1), (False, 16), (True, 2)]
    assert sorted(taken) == sorted(s for s in every if (s[0], s[1]) in {(True, 1), (False, 16), (True, 2)})
    assert sorted(executor.runner.executables) == sorted(executor.runner.step_key(
        StepKind.DECODE if s[0] else StepKind.PREFILL, executor.padding_batch(*s)) for s in every)
    again = _serve(engine)
    assert again["greedy"] == tokens["greedy"]
    assert executor.startup.late_compilations == 0
    engine.close()

    # The background's shapes were saved: the next start loads every shape before it is ready.
    warm = Engine(_config(model_dir, str(tmp_path / "cache")))
    assert warm.executor.startup.pending == 0 and warm.executor.shapes.compiled is None
    assert warm.executor.startup.summary["shapes_later"] == 0 and warm.executor.startup.summary["compilations"] == 0
    assert _serve(warm)["greedy"] == tokens["greedy"]
    warm.close()


def test_close_drops_the_shapes_not_started_and_waits_a_bounded_time(model_dir, gated, monkeypatch):
    gate, taken = gated
    monkeypatch.setattr(executor_module, "CLOSE_WAIT_S", 1.0)
    engine = Engine(_config(model_dir, None))  # no store: the background compiles through jit's path alike
    executor = engine.executor
    assert executor.startup.pending == 3
    closing = threading.Thread(target=engine.close)
    closing.start()
    closing.join(0.5)
    assert closing.is_alive()  # waiting for the shape being compiled...
    closing.join(30)
    assert not closing.is_alive()  # ...for CLOSE_WAIT_S only
    assert still_compiling() == 1 and executor.startup.pending == 1
    gate.set()
    assert executor.startup.wait(timeout=300) is False  # the shape finished; the two not started were dropped
    assert still_compiling() == 0
    assert len(taken) == 1 and executor.startup.pending == 0
    assert executor.shapes.compiled is not None and len(executor.runner.executables) == 3


HELD_SERVER = """
import itertools, sys, time
from jaxserve.executor.warmup import Warmup

prepare = Warmup._prepare_shape
taken = itertools.count()

def held(self, shape, store, state=None):  # the background's third shape takes an hour to compile
    if self.done and next(taken) >= 2:
        time.sleep(3600)
    return prepare(self, shape, store, state)

Warmup._prepare_shape = held
from jaxserve.serve import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_gauge_follows_an_idle_server_and_sigterm_stops_it_while_shapes_compile(request, tmp_path):
    script = tmp_path / "held_server.py"
    script.write_text(HELD_SERVER)
    server = ServerProcess(tiny_model(request), cache_dir=str(tmp_path / "cache"), log_path=tmp_path / "server.log",
                           extra=["--compile-in-background"], entry=(str(script),))
    try:
        later = int(re.search(r"\((\d+) more compiling in the background\)", server.log()).group(1))
        assert later >= 3
        # no request comes, yet the gauge follows the background: two shapes compile, the third is held
        m = server.wait_metrics(lambda m: m["jaxserve_step_shapes_pending"] == later - 2, timeout=120)
        assert m["jaxserve_step_shapes_pending"] == later - 2
        r = httpx.post(server.http + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hello",
                                                              "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        server.signal()
        started = time.monotonic()
        assert server.wait(60) == 0, server.log()
        assert time.monotonic() - started < 30  # close waits CLOSE_WAIT_S; the process does not wait for the rest
        assert "still compiling in the background; not waiting for them" in server.log()
    finally:
        server.terminate()


def test_shapes_compiled_while_the_engine_sleeps_serve_once_it_wakes(model_dir, tmp_path, gated):
    gate, taken = gated
    engine = Engine(_config(model_dir, str(tmp_path / "cache")))
    executor = engine.executor
    tokens = _serve(engine)
    engine.sleep(2)  # the pool and the weights deleted while the background holds its first shape
    gate.set()
    assert executor.startup.wait(timeout=600)
    engine.wake_up()
    assert executor.shapes.compiled is None
    assert _serve(engine)["greedy"] == tokens["greedy"]
    assert executor.startup.late_compilations == 0
    engine.close()
    # what the background saved serves the next start alike
    warm = Engine(_config(model_dir, str(tmp_path / "cache")))
    assert warm.executor.startup.summary["compilations"] == 0 and _serve(warm)["greedy"] == tokens["greedy"]
    warm.close()


def test_a_prefill_process_exits_at_once_on_sigterm_while_a_shape_compiles(request, tmp_path):
    """The prefill role ends its process as the server does when step shapes are still compiling in the
    background: it used to return through the interpreter's exit, which waits for every compile in flight (one
    held here for an hour; 30.7 s was seen on a cold start)."""
    import signal
    import subprocess
    import sys

    from server_harness import REPO, SMALL_ENGINE, free_port, server_env

    script = tmp_path / "held_prefill.py"
    script.write_text(HELD_SERVER)
    proc = subprocess.Popen([sys.executable, str(script), "--model", str(tiny_model(request)), "--role", "prefill",
                             "--kv-port", str(free_port()), "--http-port", "0", "--compile-in-background",
                             *SMALL_ENGINE, "--compilation-cache-dir", str(tmp_path / "cache")],
                            cwd=REPO, env=server_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "jaxserve prefill ready" in line:
                break
        assert "jaxserve prefill ready" in lines[-1], "".join(lines[-30:])
        time.sleep(3)  # two shapes compile; the third is held
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert proc.wait(60) == 0
        assert time.monotonic() - started < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
