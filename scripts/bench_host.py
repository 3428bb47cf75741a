"""Host overhead of the engine loop: a model whose device step costs almost nothing, so the host is the cost.

    python scripts/bench_host.py [--concurrency 1,64,256] [--workloads decode,mixed] [--features off,on]
        [--async-scheduling both|on|off] [--repeats 1] [--compare vllm [--vllm-python PY]] [--model DIR]
        [--phases] [--profile OUT.pstats] [--device-probe KV_LEN] [--json OUT.json] [--results-json AREA.json]

The model (written once to ``--model``, default /tmp/jaxserve-host-model-hd32): Llama-shaped, 1 layer, hidden
64, 4 heads of dim 32 (vLLM's CPU attention has no head_dim 16), vocab 512, fp32, random weights, the byte tokenizer. Workloads, at each concurrency c (max_num_seqs):

- ``decode``: 256 requests (16 at c=1) x 128 output tokens, 8..16-token prompts, all queued at once;
- ``mixed``: 256 requests (16 at c=1) x 64 output tokens, 32..192-token prompts arriving 8 per step, so
  prompt chunks ride in the decode steps.

Features ``off``: greedy. ``on``: temperature 0.8, top-p 0.9, repetition 1.1 and frequency 0.1 penalties,
logprobs=2, a stop string (that never matches; it is checked on every token). EOS is ignored everywhere, so
every configuration produces the same number of tokens.

Per run it reports output tokens/s, engine steps/s, host µs per step (engine.step() wall time minus the time
the host spent blocked on the device) and the device idle gap between consecutive steps, i.e. the host time on
the device's critical path: a watcher thread blocks on each launched step's output and timestamps its
completion; the gap before step N+1 is ``max(0, launch(N+1) - done(N))`` (steps run in launch order). Gaps are
means over all steps of the run (and the median). On a machine shared with other jobs those wall-clock figures
move with the load, so each run also prints CPU times, which move far less: the engine thread's CPU per step in
``step()`` ("cpu": the host loop; "dispatch" is its share in the compiled step's call, including whatever
XLA:CPU runs on the dispatching thread before the call returns) and the whole process's
("process cpu": the host loop and XLA:CPU's threads, i.e. this machine's "device" too), and the load average.
The first line names the commit. ``--phases`` splits the engine thread's CPU per step by phase (schedule,
launch, commit, fetch, resolve, outputs); ``--profile`` writes a cProfile of jaxserve's runs (start-up
excluded) and prints its top functions; ``--device-probe KV_LEN`` times the compiled decode step alone on a
full batch (the device's share of a step on this machine). As vLLM's offline ``generate``, the engine builds outputs of
finished requests only; runs without features use ``skip_tokenizer_init`` (no detokenization, as vLLM's run),
runs with them load the tokenizer (stop strings are checked on text).

``--compare vllm`` runs the decode workload (greedy, and with features: temperature, top-p, penalties,
logprobs, no stop string, which vLLM cannot check without a tokenizer) through vLLM's offline engine
(``skip_tokenizer_init=True``, token-id prompts) in its own virtualenv, at the same concurrency, alternating
with jaxserve's runs, and prints jaxserve / vLLM.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.config.engine import EngineConfig  # noqa: E402
from jaxserve.engine.engine import Engine  # noqa: E402
from jaxserve.executor.batch import StepKind  # noqa: E402
from jaxserve.models.demo import DEMO_CONFIG, byte_tokenizer, write_random_checkpoint  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from scripts import bench_results  # noqa: E402

HERE = Path(__file__).resolve().parent
# head_dim 32 (not 64 / 4 = 16): vLLM's CPU attention has no kernel for head_dim 16.
TINY = dict(DEMO_CONFIG, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=4, head_dim=32, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False)
MAX_MODEL_LEN = 256


def make_model(folder: Path) -> Path:
    if not (folder / "config.json").exists():
        write_random_checkpoint(folder, TINY, seed=0, std=0.08)
        byte_tokenizer().save_pretrained(folder)
    return folder


def workload(kind: str, concurrency: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    n = 16 if concurrency == 1 else 256
    if kind == "decode":
        lens, out_len, per_step = rng.integers(8, 17, n), 128, n
    else:
        lens, out_len, per_step = rng.integers(32, 193, n), 64, 8
    prompts = [rng.integers(3, 256, k).tolist() for k in lens]
    return {"prompts": prompts, "output_len": out_len, "per_step": per_step, "max_model_len": MAX_MODEL_LEN}


def params_for(features: bool, out_len: int, *, stop_strings: bool = True) -> dict:
    base = dict(max_tokens=out_len, ignore_eos=True)
    if not features:
        return dict(base, temperature=0.0)
    extra = dict(stop=["\x00\x01\x02"]) if stop_strings else {}
    return dict(base, temperature=0.8, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.1, logprobs=2,
                seed=1, **extra)


class Timeline:
    """Launch and completion times of every step the runner runs (a watcher thread waits on each output)."""

    def __init__(self, runner):
        self.runner, self.real = runner, runner.run
        self.launched: list[float] = []
        self.done: list[float] = []
        self.dispatch_cpu = 0.0  # CPU time the engine thread spent in the compiled step's dispatch
        self.decode_batches: list = []  # decode batches of synchronous steps, for --device-probe
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        runner.run = self._run

    def _run(self, kind, batch, *prev):
        c0 = time.thread_time()
        out = self.real(kind, batch, *prev)
        self.dispatch_cpu += time.thread_time() - c0
        if kind == StepKind.DECODE and not prev:  # (async steps read ids of the step before: not replayable)
            self.decode_batches.append(batch)
        self.launched.append(time.perf_counter())
        self._queue.put(out.greedy_ids)
        return out

    def _watch(self):
        while True:
            a = self._queue.get()
            if a is None:
                return
            jax.block_until_ready(a)
            self.done.append(time.perf_counter())

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self.runner.run = self.real

    def gaps(self) -> list[float]:
        return [max(0.0, self.launched[i + 1] - self.done[i]) for i in range(len(self.done) - 1)]


class Phases:
    """Engine-thread CPU time (``time.thread_time``) spent in each phase of ``Engine.step``, by wrapping the methods
    that make up a step (``--phases``). Wrapping costs ~1 µs per call, a few per step."""

    def __init__(self, engine: Engine):
        ex = engine.executor
        self.cpu: dict[str, float] = {}
        self._undo = []
        for obj, name, label in [(engine.scheduler, "schedule", "schedule"), (ex, "make_batch", "launch: batch"),
                                 (ex, "_sample_step", "launch: sampling"), (ex.runner, "run", "launch: step call"),
                                 (ex, "launch", "launch (all)"), (ex, "fetch", "fetch"),
                                 (engine.scheduler, "commit", "commit"), (engine.scheduler, "resolve", "resolve"),
                                 (engine, "_collect", "outputs"), (engine, "_mark_scheduled", "queue stamps"),
                                 (engine, "step", "step (all)")]:
            self._wrap(obj, name, label)

    def _wrap(self, obj, name, label):
        real = getattr(obj, name)
        own = name in vars(obj)  # an instance attribute (or a module function) to put back, not a class method

        def timed(*a, **k):
            c0 = time.thread_time()
            try:
                return real(*a, **k)
            finally:
                self.cpu[label] = self.cpu.get(label, 0.0) + time.thread_time() - c0

        setattr(obj, name, timed)
        self._undo.append(lambda: setattr(obj, name, real) if own else delattr(obj, name))

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo()


def run_jaxserve(engine: Engine, w: dict, features: bool, profile: cProfile.Profile | None = None,
                 phases: bool = False) -> dict:
    sp = SamplingParams(**params_for(features, w["output_len"]))
    ex = engine.executor
    steps0, wait0 = engine.stats_counters["steps"], ex.host_wait_seconds
    split = Phases(engine) if phases else None
    timeline = Timeline(ex.runner)
    pending = list(enumerate(w["prompts"]))
    out_tokens, step_wall, step_cpu = 0, 0.0, 0.0
    start, process_cpu = time.perf_counter(), time.process_time()
    if profile is not None:
        profile.enable()
    try:
        while pending or engine.has_unfinished():
            for i, p in pending[: w["per_step"]]:
                engine.add_request(f"h{i}", p, sp)
            pending = pending[w["per_step"]:]
            t0, c0 = time.perf_counter(), time.thread_time()
            outs = engine.step()
            step_wall += time.perf_counter() - t0
            step_cpu += time.thread_time() - c0
            out_tokens += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
        seconds = time.perf_counter() - start
        process_cpu = time.process_time() - process_cpu
    finally:
        if profile is not None:
            profile.disable()
        timeline.close()
        if split is not None:
            split.close()
    steps = engine.stats_counters["steps"] - steps0
    wait = ex.host_wait_seconds - wait0
    gaps = timeline.gaps()
    return {"seconds": seconds, "output_tokens": out_tokens, "steps": steps,
            "host_us": 1e6 * (step_wall - wait) / max(1, steps),
            # CPU time of the engine's thread in step(): what the host loop costs whatever else loads the machine
            # (it includes work XLA:CPU runs on the dispatching thread; a blocked fetch costs none).
            "host_cpu_us": 1e6 * step_cpu / max(1, steps),
            # CPU time of the whole process (the host loop plus XLA:CPU's threads, i.e. the "device" here)
            "process_cpu_us": 1e6 * process_cpu / max(1, steps),
            # of the engine thread's CPU: the step's dispatch (``ModelRunner.run``: packing, the host-to-device
            # copy, the jit call and what XLA:CPU runs on the calling thread before it returns)
            "dispatch_cpu_us": 1e6 * timeline.dispatch_cpu / max(1, steps),
            "phases_cpu_us": {k: 1e6 * v / max(1, steps) for k, v in (split.cpu.items() if split else ())},
            "decode_batches": timeline.decode_batches,
            "gap_us": 1e6 * statistics.fmean(gaps) if gaps else 0.0,
            "gap_median_us": 1e6 * statistics.median(gaps) if gaps else 0.0}


def run_vllm(python: str, model: Path, w: dict, features: bool, concurrency: int) -> dict | None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "workload.json"
        params = params_for(features, w["output_len"], stop_strings=False)
        path.write_text(json.dumps(dict(w, params=params)))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
        cmd = [python, str(HERE / "peers" / "vllm_generate.py"), str(path), "--model", str(model), "--dtype",
               "float32", "--max-num-seqs", str(concurrency)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode:
            print(f"vllm failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
            return None
        lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
        return lines[-1] if lines else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("/tmp/jaxserve-host-model-hd32"))
    p.add_argument("--concurrency", default="1,64,256")
    p.add_argument("--workloads", default="decode,mixed")
    p.add_argument("--features", default="off,on")
    p.add_argument("--async-scheduling", default="both", choices=("both", "on", "off"))
    p.add_argument("--repeats", type=int, default=1, help="runs of each configuration, alternating")
    p.add_argument("--compare", default="", help="'vllm' to run the decode workload through vLLM-CPU too")
    p.add_argument("--vllm-python", default="/work/venv-vllm/bin/python")
    p.add_argument("--json", type=Path, default=None, help="also write every run's numbers here")
    p.add_argument("--device-probe", type=int, default=0, metavar="KV_LEN",
                   help="after each concurrency's runs, time the compiled decode step alone (called back to back "
                        "and waited for) on a full decode batch of a synchronous run whose longest row is "
                        "nearest KV_LEN tokens: the device's share of a step, without the host loop")
    p.add_argument("--phases", action="store_true",
                   help="also print the engine thread's CPU per step in each phase of a step (schedule, launch, "
                        "commit, fetch, resolve, outputs)")
    p.add_argument("--profile", type=Path, default=None,
                   help="cProfile jaxserve's runs (not engine start-up, not vLLM) into this pstats file and print "
                        "the top functions")
    bench_results.add_arguments(p)
    args = p.parse_args()
    figures = bench_results.Results(args)
    model = make_model(args.model)
    profile = cProfile.Profile() if args.profile else None
    print(f"# {_commit()}, jax {jax.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, load average {_load()}", flush=True)
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.async_scheduling]
    results = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        engines = {}

        def engine(a: bool, feat: bool) -> Engine:
            if (a, feat) not in engines:
                t0 = time.perf_counter()
                e = engines[a, feat] = Engine(EngineConfig(
                    model=str(model), max_num_seqs=c, max_num_batched_tokens=max(512, c), max_model_len=MAX_MODEL_LEN,
                    async_scheduling=a, skip_tokenizer_init=not feat), final_outputs_only=True)
                print(f"# concurrency {c}, async_scheduling={a}, tokenizer={feat}: engine ready in "
                      f"{time.perf_counter() - t0:.1f}s", flush=True)
            return engines[a, feat]

        probe_batches: list = []
        for kind in args.workloads.split(","):
            w = workload(kind, c)
            for feat in [x == "on" for x in args.features.split(",")]:
                label = f"c={c:<3} {kind:<6} features={'on ' if feat else 'off'}"
                name = f"c={c} {kind}, features {'on' if feat else 'off'}"
                for rep in range(args.repeats):
                    tps = {}
                    for a in modes:
                        r = run_jaxserve(engine(a, feat), w, feat, profile, args.phases)
                        probe_batches += r.pop("decode_batches")
                        tps[a] = r["output_tokens"] / r["seconds"]
                        results.append(dict(r, concurrency=c, workload=kind, features=feat, async_scheduling=a,
                                            load=_load()))
                        print(f"{label} async={'on ' if a else 'off'}: {tps[a]:9.0f} out tok/s  "
                              f"{r['steps'] / r['seconds']:7.1f} steps/s  host {r['host_us']:7.0f} us/step "
                              f"(cpu {r['host_cpu_us']:5.0f}, of which dispatch {r['dispatch_cpu_us']:4.0f}; "
                              f"process cpu {r['process_cpu_us']:5.0f})  device idle gap "
                              f"(host on the critical path) mean {r['gap_us']:7.0f} us (median "
                              f"{r['gap_median_us']:.0f})  load {_load()}", flush=True)
                        run = f"{name}, async {'on' if a else 'off'}"
                        figures.add(f"{run}: jaxserve output tok/s", tps[a], "tok/s")
                        figures.add(f"{run}: engine-thread CPU per step", r["host_cpu_us"], "µs")
                        figures.add(f"{run}: device idle gap, median", r["gap_median_us"], "µs")
                        if r["phases_cpu_us"]:
                            print("    engine-thread CPU us/step by phase: " + ", ".join(
                                f"{k} {v:.0f}" for k, v in r["phases_cpu_us"].items()), flush=True)
                    if "vllm" in args.compare and kind == "decode":
                        v = run_vllm(args.vllm_python, model, w, feat, c)
                        if v:
                            vt = v["output_tokens"] / v["seconds"]
                            results.append(dict(v, concurrency=c, workload=kind, features=feat, peer="vllm"))
                            ratios = ", ".join(f"async {'on' if a else 'off'} {t / vt:.2f}x" for a, t in tps.items())
                            print(f"{label} vllm     : {vt:9.0f} out tok/s (start-up {v['startup_seconds']:.0f}s); "
                                  f"jaxserve / vllm: {ratios}  load {_load()}", flush=True)
                            figures.add(f"{name}: vLLM-CPU output tok/s", vt, "tok/s")
                            for a, t in tps.items():
                                figures.add(f"{name}, async {'on' if a else 'off'}: jaxserve / vLLM-CPU", t / vt, "x")
        if args.device_probe:
            device_probe(next(iter(engines.values())), probe_batches, args.device_probe, c)
        del engines
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    figures.save()
    if profile is not None:
        profile.dump_stats(args.profile)
        pstats.Stats(str(args.profile)).sort_stats("tottime").print_stats(25)


def device_probe(engine: Engine, batches: list, kv_len: int, concurrency: int) -> None:
    full = [b for b in batches if int(b.md.num_seqs.sum()) == concurrency]
    if not full:
        print(f"c={concurrency:<3} device probe: no full decode batch from a synchronous run (add "
              "--async-scheduling both or off)", flush=True)
        return
    batch = min(full, key=lambda b: abs(int(b.md.kv_lens.max()) - kv_len))
    runner, times = engine.executor.runner, []
    for _ in range(40):
        t0 = time.perf_counter()
        jax.block_until_ready(runner.run(StepKind.DECODE, batch))
        times.append(time.perf_counter() - t0)
    print(f"c={concurrency:<3} device probe: the decode step alone, {concurrency} rows, longest "
          f"{int(batch.md.kv_lens.max())} tokens: median {1e3 * statistics.median(times):.2f} ms, min "
          f"{1e3 * min(times):.2f} ms (40 calls)  load {_load()}", flush=True)


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(HERE), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return f"commit {out.stdout.strip()}{' + local changes' if dirty else ''}"
    except OSError:
        return "commit unknown"


if __name__ == "__main__":
    main()
