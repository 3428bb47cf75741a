"""The executable store: a warm start loads every step shape's executable (and the sampler's) instead of
compiling it, serves the same tokens with no compilation, and any mismatch or damaged file falls back to
compiling."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import jax

import pytest

from jaxserve import SamplingParams

from jaxserve.executor import executable_store
from jaxserve.engine.engine import Engine
from jaxserve.config.engine import EngineConfig
from jaxserve.executor.runner import CompileCounter
from pallas_kernels.ragged_paged_attention import native
from tiny import build_tiny_model, hf_greedy, hf_model, train_tokenizer

# Compilations in this process from here on (the tests read differences).
compile_counter = CompileCounter()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), tokenizer=train_tokenizer())


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("xla"))


def _engine(model_dir, cache_dir) -> Engine:
    # Two sequences in 16-token steps: three step shapes (a prefill bucket, decode buckets of one and two rows),
    # each compiled, stored, loaded or damaged alike; the two requests of _serve need no more.
    return Engine(EngineConfig(model=str(model_dir), page_size=4, num_pages=32, max_model_len=48, max_num_seqs=2,
                               max_num_batched_tokens=16, seed=0, compilation_cache_dir=cache_dir))


def _serve(engine: Engine) -> tuple[dict, int]:
    """A greedy prompt longer than one chunk and a sampled one with penalties and logprobs: tokens per request,
    and the compilations while serving them."""
    compiled = compile_counter.count()
    engine.add_request("greedy", list(range(3, 43)), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    engine.add_request("sampled", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0.9, seed=4, logprobs=2,
                                                            repetition_penalty=1.2, ignore_eos=True))
    tokens = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return tokens, compile_counter.count() - compiled


def _programs(engine: Engine) -> int:
    """The executables an engine's warm-up made ready: its step shapes', its sampler variants' and scoring's."""
    executor = engine.executor
    return len(executor.runner.executables) + len(executor._sample.executables) + len(executor._score.executables)


@pytest.fixture(scope="module")
def first(model_dir, cache_dir):
    """The cold start (every shape compiled and saved) and what it served."""
    engine = _engine(model_dir, cache_dir)
    summary = engine.executor.startup.summary
    return engine, summary, _serve(engine)


def test_warm_start_loads_every_step_and_serves_the_same_tokens(model_dir, cache_dir, first):
    cold, cold_summary, (cold_tokens, cold_compiles) = first
    shapes = len(cold.executor.shapes.all_shapes())
    programs = _programs(cold)
    assert programs == shapes + 4 + 1  # the sampler's four variants, prompt-logprob scoring
    assert (cold_summary["executables_loaded"], cold_summary["executables_compiled"]) == (0, programs)
    assert cold_compiles == 0
    assert cold_tokens["greedy"] == hf_greedy(hf_model(model_dir), list(range(3, 43)), 6)

    compiled = compile_counter.count()
    warm = _engine(model_dir, cache_dir)
    summary = warm.executor.startup.summary
    assert (summary["executables_loaded"], summary["executables_compiled"]) == (programs, 0)
    # the penalty rows' reset (its row count varies, so it stays jitted) is the one program left to the XLA cache
    assert compile_counter.count() - compiled <= 1
    assert len(warm.executor.runner.executables) == shapes and _programs(warm) == programs
    assert _serve(warm) == (cold_tokens, 0)


_FRESH_PROCESS = """
import json, sys
import jax
jax.config.update("jax_default_matmul_precision", "highest")
from jaxserve import SamplingParams
from jaxserve.engine.engine import Engine
from jaxserve.config.engine import EngineConfig
model_dir, cache_dir = sys.argv[1:]
engine = Engine(EngineConfig(model=model_dir, page_size=4, num_pages=32, max_model_len=48, max_num_seqs=2,
                             max_num_batched_tokens=16, seed=0, compilation_cache_dir=cache_dir))
engine.add_request("greedy", list(range(3, 43)), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
while engine.has_unfinished():
    tokens = [o.outputs[0].token_ids for o in engine.step() if o.finished] or None
print(json.dumps(dict(tokens=tokens[0], **engine.executor.startup.summary)))
"""


def test_warm_start_in_a_fresh_process_finds_the_native_attention(model_dir, cache_dir, first):
    """A new process loads the stored steps, whose decode step calls the native CPU attention kernel, without
    tracing them: the kernel must be registered before they run."""
    assert native.available()
    cold = first[0]
    result = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, str(model_dir), cache_dir], capture_output=True,
                            text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert result.returncode == 0, result.stderr[-2000:]
    warm = json.loads(result.stdout.strip().splitlines()[-1])
    assert warm["executables_loaded"] == _programs(cold)
    assert warm["tokens"] == first[2][0]["greedy"]


class _RunsCode:
    """Unpickling it makes a file: the proof that a forged store file ran."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def test_mismatch_or_damaged_file_compiles_instead(model_dir, cache_dir, first, monkeypatch, caplog, tmp_path):
    engine = first[0]
    programs = _programs(engine)
    # Damage one stored file and put a pickle that runs code in another's place (what anyone who can write the
    # cache folder could do): neither is unpickled; each is reported once, compiled again and saved over.
    store = executable_store.ExecutableStore.for_runner(engine.executor.config, engine.executor.runner)
    files = sorted(store.directory.glob("*.exe"))
    assert len(files) == programs
    assert all(path.read_bytes().startswith(b"jaxserve-signed-1\n") for path in files)
    files[0].write_bytes(b"not an executable")
    ran = tmp_path / "the forged file ran"
    files[1].write_bytes(pickle.dumps(_RunsCode(str(ran))))
    with caplog.at_level(logging.WARNING, logger="jaxserve.executor.executable_store"):
        damaged = _engine(model_dir, cache_dir)
    summary = damaged.executor.startup.summary
    assert (summary["executables_loaded"], summary["executables_compiled"]) == (programs - 2, 2)
    assert not ran.exists()
    assert sorted(r.getMessage() for r in caplog.records if "signature" in r.getMessage()) == sorted(
        f"executable store: {path.name} failed its signature check; compiling the step instead"
        for path in files[:2])
    assert all(path.read_bytes().startswith(b"jaxserve-signed-1\n") for path in files[:2])
    assert _serve(damaged) == (first[2][0], 0)
    del damaged
    # Different code (the source hash is part of every key): nothing loads, every shape compiles.
    monkeypatch.setattr(executable_store, "source_digest", lambda: "some other source")
    changed = _engine(model_dir, cache_dir)
    summary = changed.executor.startup.summary
    assert (summary["executables_loaded"], summary["executables_compiled"]) == (0, programs)
    assert _serve(changed) == (first[2][0], 0)



def test_a_store_miss_is_compiled_and_stored_though_the_compilation_cache_holds_it(model_dir, first, tmp_path,
                                                                                    monkeypatch):
    """After a change of the source that leaves the programs alone (an upgrade), every key of the store is new
    while JAX's compilation cache still holds every program. Its executables cannot be stored (see below), so
    the store must compile its misses itself: before it did, nothing was stored and every later start traced,
    lowered and read every program again (a warm start of the ~100M model took 30 s instead of 12)."""
    cache_dir = str(tmp_path)
    cold = _engine(model_dir, cache_dir)
    programs = _programs(cold)
    assert cold.executor.startup.summary["executables_compiled"] == programs
    xla_entries = sorted(p.name for p in tmp_path.glob("*-cache"))
    del cold
    monkeypatch.setattr(executable_store, "source_digest", lambda: "an upgrade")
    upgraded = _engine(model_dir, cache_dir)
    summary = upgraded.executor.startup.summary
    assert (summary["executables_loaded"], summary["executables_compiled"]) == (0, programs)
    assert len(list(Path(cache_dir, "executables").glob("*.exe"))) == 2 * programs
    # the compilation cache holds what it held: the store's own compilations leave nothing there
    assert sorted(p.name for p in tmp_path.glob("*-cache")) == xla_entries
    del upgraded
    compiled = compile_counter.count()
    again = _engine(model_dir, cache_dir)
    summary = again.executor.startup.summary
    assert (summary["executables_loaded"], summary["executables_compiled"]) == (programs, 0)
    assert compile_counter.count() - compiled <= 1
    assert _serve(again) == (first[2][0], 0)


def test_a_step_read_from_the_compilation_cache_is_not_stored(model_dir, first, tmp_path, monkeypatch):
    """An executable the persistent compilation cache returned serializes without some of its XLA:CPU kernels (a
    server loading it in another process failed at its first step: "Function ... not found"): only a step XLA
    compiled in this process goes into the store. Here every compilation reports a cache hit."""
    from itertools import count
    from pathlib import Path

    hits = count()
    monkeypatch.setattr(CompileCounter, "thread_cache_hits", lambda self: next(hits))
    engine = _engine(model_dir, str(tmp_path))
    summary = engine.executor.startup.summary
    assert (summary["executables_loaded"], summary["executables_compiled"]) == (0, _programs(engine))
    assert not list(Path(tmp_path, "executables").glob("*.exe"))
    assert _serve(engine) == (first[2][0], 0)


def test_the_source_digest_covers_every_package_source():
    """The key's source hash reads the packages' files wherever the store module lives (when it moved into
    ``jaxserve/executor/``, it looked one folder too low, found no file, and a code change kept old executables)."""
    root = Path(executable_store.__file__).resolve().parents[2]
    names = {str(p.relative_to(root)) for p in executable_store.source_files()}
    assert {"jaxserve/executor/runner.py", "jaxserve/models/decoder.py", "sharding/rules.py",
            "pallas_kernels/ragged_paged_attention/cpu_native.cc"} <= names

