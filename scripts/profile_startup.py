"""Where start-up goes: model load, then for every step shape its tracing, lowering, XLA compile (or
persistent-cache read) and first execution, with a cold and then a warm compilation cache.

    python scripts/profile_startup.py [--model PATH] [--dtype float32] [engine flags...] [--out FILE.json]

Each of the two runs is a fresh process (``--phase`` child) building the executor with ``warmup=False`` and
then doing by hand, shape by shape in one thread, every phase a start may go through: loading the step's
executable from the executable store (``jaxserve.executor.executable_store``; what a warm start does instead of all the
rest), ``jit.trace``, ``.lower()``, ``.compile()`` (a persistent-cache read when the XLA cache holds the
program), one execution of the compiled program (which warm-up no longer does), and the sampler variants.
The parent prints a table per run and the totals per phase; ``--out`` keeps the figures. Single-threaded on purpose: the phases are told apart, not overlapped as serving does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(argv: list[str]) -> dict:
    t0 = time.perf_counter()
    import jax
    import numpy as np

    from jaxserve.executor import builder, executor as executor_module
    from jaxserve.executor.batch import StepKind
    from jaxserve.config.args import add_engine_args, engine_config_from_args
    from jaxserve.executor.runner import CompileCounter
    from jaxserve.executor.executable_store import ExecutableStore

    t_import = time.perf_counter() - t0
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(argv), warmup=False)
    loaded = {}
    real_load = builder.load_model

    def timed_load(*a, **kw):
        s = time.perf_counter()
        out = real_load(*a, **kw)
        jax.block_until_ready(jax.tree.leaves(__import__("flax").nnx.state(out[0])))
        loaded["seconds"] = time.perf_counter() - s
        return out

    builder.load_model = timed_load
    s = time.perf_counter()
    ex = executor_module.Executor(config, model_path=config.model or str(_demo()))
    t_executor = time.perf_counter() - s
    compile_counter = CompileCounter()
    rows = []
    runner = ex.runner
    store = ExecutableStore.for_runner(config, runner)
    for decode, tokens, slots, pages in ex.shapes.all_shapes():
        kind = StepKind.DECODE if decode else StepKind.PREFILL
        batch = ex.padding_batch(decode, tokens, slots, pages)
        fn, args = runner._call_args(kind, batch, batch.pack())
        key = (int(kind), batch.shape_fields())
        z = time.perf_counter()
        stored = store.load(key, list(runner.mesh.devices.flat))
        t_load = time.perf_counter() - z if stored is not None else None
        counts0 = compile_counter.cache_counts()
        a = time.perf_counter()
        traced = fn.trace(*args, prev_ids=runner._no_prev)
        b = time.perf_counter()
        lowered = traced.lower()
        c = time.perf_counter()
        compiled = lowered.compile()
        d = time.perf_counter()
        if stored is None:  # before it runs: XLA:CPU's sort thunks do not serialize once they have run
            store.save(key, compiled)
        out, runner.kv_cache = compiled(*args[:3], prev_ids=runner._no_prev)
        jax.block_until_ready(out)
        e = time.perf_counter()
        counts = compile_counter.cache_counts()
        rows.append({"shape": f"{kind.name.lower()} t={tokens} s={slots} p={pages}", "trace": b - a,
                     "lower": c - b, "compile": d - c, "execute": e - d,
                     "cache_hit": counts["hits"] > counts0["hits"], "store_load": t_load})
    s = time.perf_counter()
    # The sampler variants, as the warm-up compiles them (through jit: trace + lower + compile + run).
    out = runner.local(out)
    from jaxserve.executor.sampler import SamplingTensors
    from jaxserve.sampling_params import MAX_LOGIT_BIAS, SamplingParams

    for logprobs in (None, 1):
        tensors = SamplingTensors.build([SamplingParams(temperature=1.0, logprobs=logprobs)], num_slots=ex._sample_rows,
                                        seeds=[0], num_generated=[0], penalty_rows=[0],
                                        logprobs_mode=config.logprobs_mode, token_bitmask=ex._all_allowed,
                                        logit_bias_width=MAX_LOGIT_BIAS)
        for penalties in (None, ex._penalties):
            jax.block_until_ready(ex._sample(out.logits, tensors, penalties))
    t_sampler = time.perf_counter() - s
    return {"import": t_import, "executor": t_executor, "load_model": loaded.get("seconds", float("nan")),
            "shapes": rows, "sampler": t_sampler, "total": time.perf_counter() - t0}


def _demo():
    from jaxserve.models.demo import demo_model_path

    return demo_model_path()


def report(name: str, result: dict) -> None:
    rows = result["shapes"]
    print(f"\n## {name}: {result['total']:.1f}s in the process (import {result['import']:.1f}s, executor built in "
          f"{result['executor']:.1f}s of which model load {result['load_model']:.1f}s, sampler "
          f"{result['sampler']:.1f}s)")
    print("| shape | executable store load s | trace s | lower s | compile s | execute s | XLA cache hit |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    fmt = lambda v: "miss" if v is None else f"{v:.2f}"  # noqa: E731
    for r in rows:
        print(f"| {r['shape']} | {fmt(r['store_load'])} | {r['trace']:.2f} | {r['lower']:.2f} | {r['compile']:.2f} | "
              f"{r['execute']:.2f} | {'yes' if r['cache_hit'] else 'no'} |")
    tot = {k: sum(r[k] or 0.0 for r in rows) for k in ("store_load", "trace", "lower", "compile", "execute")}
    print(f"| **{len(rows)} shapes** | {tot['store_load']:.1f} | {tot['trace']:.1f} | {tot['lower']:.1f} | "
          f"{tot['compile']:.1f} | {tot['execute']:.1f} | {sum(r['cache_hit'] for r in rows)} |")


def main() -> None:
    if "--phase" in sys.argv:
        argv = [a for a in sys.argv[1:] if a != "--phase"]
        out = argv.pop(argv.index("--result") + 1)
        argv.remove("--result")
        Path(out).write_text(json.dumps(child(argv)))
        return
    argv = sys.argv[1:]
    save = None
    if "--out" in argv:
        save = argv.pop(argv.index("--out") + 1)
        argv.remove("--out")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    results = {}
    with tempfile.TemporaryDirectory(prefix="jaxserve-xla-") as cache:
        for name in ("cold", "warm"):
            res = Path(cache) / f"{name}.json"
            subprocess.run([sys.executable, __file__, "--phase", "--result", str(res), "--compilation-cache-dir",
                            str(Path(cache) / "xla"), *argv], check=True, env=env, cwd=ROOT)
            results[name] = json.loads(res.read_text())
            report(name, results[name])
    if save:
        Path(save).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
