"""Offline throughput of jaxserve on a seeded synthetic workload, optionally side by side with peers.

    python scripts/benchmark_offline.py --model M [--num-requests 48 --prompt-len 16:256 --output-len 64]
        [--compare transformers,vllm --vllm-python /path/to/vllm-venv/bin/python] [--probe-batches 1,32]
        [engine options]
    python scripts/benchmark_offline.py --make-model DIR [--preset 100m|smollm-135m|llama-3.2-1b|llama-3.1-8b] ...
        # writes a random-weight model of that shape first
    python scripts/benchmark_offline.py --make-model DIR --preset smollm-135m --dtypes float32,bfloat16 --profile \
        --compare transformers,vllm --vllm-python /path/to/vllm-venv/bin/python
        # each dtype in turn: jaxserve (with its step split by layer kind), then the peers in the same dtype

Greedy, EOS ignored, prompts of random token ids. Reports requests/s, input and output tokens/s, mean step
time, start-up time (load + compile), roofline bounds, decode probes (step time at a batch size against its
bandwidth bound, and host overhead: how much of a step the device waits for the host), and the peers' output
tokens/s with ratios. Peers run in their own processes (vLLM with its own Python) and are never dependencies.

``--profile`` runs the workload again under ``jax.profiler`` (fresh prompts of the same lengths, so none is in the
prefix cache, as in the timed run) and splits each step's op time by layer kind
(embedding, norms, attention, MLP, LM head, the greedy sampler, the rest: ``jaxserve.tools.step_profile``), per
step kind and per layer; the timed run is never the profiled one.

``--api generate`` runs the workload through the offline API, ``LLM.generate``, as vLLM's peer run does (a
two-request ``generate`` first, before the clock), and times its phases: admission (``add_request`` of every
prompt), the engine steps that carry prompt tokens, the decode-only steps, and output assembly (the rest of the
call). ``--rounds N`` runs the workload N times; with ``--compare vllm`` vLLM's engine stays up and takes turns
with jaxserve's, round by round, and the median of the paired ratios is reported. Pass ``--skip-tokenizer-init``
to compare with vLLM's run, which detokenizes nothing.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.config.args import add_engine_args, engine_config_from_args  # noqa: E402
from jaxserve.engine.engine import Engine  # noqa: E402
from jaxserve.executor.batch import StepKind  # noqa: E402
from jaxserve.llm import LLM  # noqa: E402
from jaxserve.models.demo import DEMO_CONFIG, byte_tokenizer, write_random_checkpoint  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from jaxserve.tools.roofline import decode_cost, measure_peaks, prefill_cost  # noqa: E402
from jaxserve.tools.step_profile import KINDS, load_trace, split_trace  # noqa: E402
from scripts import bench_results  # noqa: E402

HERE = Path(__file__).resolve().parent
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
PRESETS = {
    # The CPU target: ~100M parameters.
    "100m": dict(DEMO_CONFIG, hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048, vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=2048,
                 bos_token_id=1, eos_token_id=2),
    # A deep narrow shape (SmolLM-135M's): 30 layers of 576, 9 query and 3 KV heads of 64, tied embeddings.
    "smollm-135m": dict(DEMO_CONFIG, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                        num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                        tie_word_embeddings=True, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2),
    # Host-bound: the device step costs almost nothing, so admission, scheduling and outputs are the cost
    # (issue 34's end-to-end case: 256 prompts of 8-32 tokens, 96 greedy tokens each). Heads of 32: vLLM's CPU
    # attention has no head_dim 16.
    "host-2x128": dict(DEMO_CONFIG, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=344),
    "llama-3.2-1b": dict(DEMO_CONFIG, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                         tie_word_embeddings=True, max_position_embeddings=131072, bos_token_id=1, eos_token_id=2,
                         rope_parameters=dict(_LLAMA3_ROPE, factor=32.0)),
    "llama-3.1-8b": dict(DEMO_CONFIG, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                         max_position_embeddings=131072, bos_token_id=1, eos_token_id=2,
                         rope_parameters=dict(_LLAMA3_ROPE, factor=8.0)),
}


def make_model(folder: Path, preset: str, dtype: str) -> Path:
    """Write a random-weight checkpoint of a preset shape (with a byte tokenizer) unless it exists."""
    if not (folder / "config.json").exists():
        write_random_checkpoint(folder, PRESETS[preset], seed=0, std=0.02, dtype=dtype)
        byte_tokenizer().save_pretrained(folder)
    return folder


def workload(args, vocab: int) -> dict:
    rng = np.random.default_rng(args.seed)
    lo, hi = map(int, args.prompt_len.split(":"))
    lens = rng.integers(lo, hi + 1, args.num_requests)
    prompts = [rng.integers(3, vocab, n).tolist() for n in lens]
    return {"prompts": prompts, "output_len": args.output_len, "max_model_len": hi + args.output_len}


def run_jaxserve(engine: Engine, w: dict) -> dict:
    params = SamplingParams(max_tokens=w["output_len"], temperature=0.0, ignore_eos=True)
    steps0 = engine.stats_counters["steps"]
    start = time.perf_counter()
    for i, p in enumerate(w["prompts"]):
        engine.add_request(f"b{i}", p, params)
    out_tokens = 0
    while engine.has_unfinished():
        out_tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    seconds = time.perf_counter() - start
    steps = engine.stats_counters["steps"] - steps0
    return {"seconds": seconds, "output_tokens": out_tokens, "steps": steps}


def run_generate(llm: LLM, w: dict) -> dict:
    """The workload through ``LLM.generate``, its phases timed (see the module docstring)."""
    engine, runner = llm.engine, llm.engine.executor.runner
    params = SamplingParams(max_tokens=w["output_len"], temperature=0.0, ignore_eos=True)
    phases = {"admission": 0.0, "prompt_steps": 0.0, "decode_steps": 0.0}
    counts = {"prompt_steps": 0, "decode_steps": 0}
    launched: list[StepKind] = []
    real_add, real_step, real_run = engine.add_request, engine.step, runner.run

    def add_request(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real_add(*args, **kwargs)
        finally:
            phases["admission"] += time.perf_counter() - start

    def step():
        launched.clear()
        start = time.perf_counter()
        out = real_step()
        phase = "prompt_steps" if StepKind.PREFILL in launched else "decode_steps"
        phases[phase] += time.perf_counter() - start
        counts[phase] += 1
        return out

    engine.add_request, engine.step = add_request, step
    runner.run = lambda kind, b, *a, **k: (launched.append(kind), real_run(kind, b, *a, **k))[1]
    try:
        start = time.perf_counter()
        outs = llm.generate(w["prompts"], params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        del engine.add_request, engine.step  # the class's methods again
        runner.run = real_run
    phases["assembly"] = seconds - sum(phases.values())
    return {"seconds": seconds, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "steps": sum(counts.values()), "phases": phases, "counts": counts}


def format_phases(res: dict) -> str:
    ph, n = res["phases"], res["counts"]
    return (f"admission {1e3 * ph['admission']:.0f} ms, {n['prompt_steps']} steps with prompt tokens "
            f"{1e3 * ph['prompt_steps']:.0f} ms, {n['decode_steps']} decode steps {1e3 * ph['decode_steps']:.0f} ms "
            f"({1e3 * ph['decode_steps'] / max(1, n['decode_steps']):.2f} ms each), output assembly "
            f"{1e3 * ph['assembly']:.0f} ms")


class PacedPeer:
    """vLLM's peer run kept up (``vllm_generate.py --paced``): one round of the workload per ``round()``."""

    def __init__(self, cmd: list[str], env=None):
        self.proc = subprocess.Popen([*cmd, "--paced", "--rounds", "1000000"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self.startup_seconds = self._next()["startup_seconds"]

    def _next(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"the peer exited (code {self.proc.wait()})")

    def round(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self._next()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def run_rounds(args, llm: LLM, w: dict, wpath: Path, results: bench_results.Results) -> None:
    """``--api generate --rounds N``: jaxserve's rounds, each followed by vLLM's when compared; paired ratios."""
    peer = None
    if "vllm" in args.compare.split(","):
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
        peer = PacedPeer([args.vllm_python, str(HERE / "peers" / "vllm_generate.py"), str(wpath), "--model",
                          args.model, "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs)], env)
        print(f"vllm {args.dtype}: up (start-up {peer.startup_seconds:.1f}s)", flush=True)
    ratios = []
    try:
        for r in range(args.rounds):
            # vLLM's worker spins on its message queue for a second after its last message: let it go idle
            time.sleep(2.5 if peer is not None else 0.5)
            res = run_generate(llm, w)
            tps = res["output_tokens"] / res["seconds"]
            line = f"round {r + 1}: jaxserve {tps:.0f} output tok/s ({format_phases(res)})"
            if peer is not None:
                time.sleep(0.5)
                v = peer.round()
                vtps = v["output_tokens"] / v["seconds"]
                ratios.append(tps / vtps)
                line += f"; vllm {vtps:.0f}; jaxserve / vllm = {tps / vtps:.2f}x"
            print(f"{line}; load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        if peer is not None:
            peer.close()
    if ratios:
        print(f"jaxserve / vllm {args.dtype} over {len(ratios)} paired rounds: median {np.median(ratios):.2f}x "
              f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x)")
        results.add(f"{args.dtype}: jaxserve / vLLM-CPU, paired median of {len(ratios)} rounds",
                    np.median(ratios), "x")


def probe_decode(engine: Engine, batch: int, context: int, steps: int = 16) -> dict:
    """Steady-state decode at a batch size: wall time per engine step vs the compiled call alone.

    Each engine step is followed by a replay of the batch it just ran (the same compiled call on the same
    inputs, which rewrites the same K/V), and the medians of both are compared: interleaving them keeps a
    noisy machine's slow spells from landing on one side only.
    """
    rng = np.random.default_rng(batch)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    ids = [engine.add_request(f"probe{batch}-{i}", rng.integers(3, min(1000, vocab), context).tolist(), params)
           for i in range(batch)]
    seen = []
    runner = engine.executor.runner
    real = runner.run
    runner.run = lambda kind, b, *prev: (kind == StepKind.DECODE and seen.append(b), real(kind, b, *prev))[1]
    started: set[str] = set()
    walls, devices = [], []
    try:
        while len(started) < batch:  # until every sequence has its first token: all decoding from here on
            started.update(o.request_id for o in engine.step() if o.outputs and o.outputs[0].delta_token_ids)
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
            start = time.perf_counter()
            jax.block_until_ready(real(StepKind.DECODE, seen[-1]))
            devices.append(time.perf_counter() - start)
    finally:
        runner.run = real
        for rid in ids:
            engine.abort_request(rid)
    return {"batch": batch, "context": context, "step_s": float(np.median(walls)),
            "device_s": float(np.median(devices))}


def profile_workload(engine: Engine, w: dict, folder: str) -> list[tuple[str, dict]]:
    """The workload again under ``jax.profiler``: each step's (kind, split by layer kind), in call order."""
    runner = engine.executor.runner
    real = runner.run
    calls = []
    runner.run = lambda kind, b, *a, **k: (calls.append((kind, b)), real(kind, b, *a, **k))[1]
    try:
        with jax.profiler.trace(folder):
            run_jaxserve(engine, w)
    finally:
        runner.run = real
    programs: dict[str, str] = {}  # "<kind> <shape fields>" -> the compiled step's HLO text
    for kind, b in calls:
        key = runner.step_key(kind, b)
        label = f"{kind.name.lower()} {key[1]}"
        if label not in programs:
            compiled = runner.executables.get(key)
            programs[label] = (compiled if compiled is not None else runner.lower(kind, b).compile()).as_text()
    return [(sp["program"].split()[0], sp) for sp in split_trace(load_trace(folder), programs)]


def print_profile(steps: list[tuple[str, dict]], num_layers: int) -> None:
    kinds = (*KINDS, "rest")
    for name in sorted({k for k, _ in steps}):
        group = [sp for k, sp in steps if k == name]
        n = len(group)
        mean = {k: sum(sp[k] for sp in group) / n / 1e3 for k in (*kinds, "wall_us", "ops_us")}  # ms per step
        parts = ", ".join(f"{k} {mean[k]:.2f} ({mean[k] / mean['ops_us']:.0%})" for k in kinds)
        per_layer = ", ".join(f"{k} {1e3 * mean[k] / num_layers:.0f}" for k in ("attention", "mlp", "norm"))
        print(f"  profile {name} steps ({n}): wall {mean['wall_us']:.1f} ms, ops {mean['ops_us']:.1f} ms = {parts} "
              f"ms; per layer (us): {per_layer}")


def run_peer(cmd: list[str], env=None) -> list[dict]:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        print(f"peer failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}", file=sys.stderr)
        return []
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--make-model", type=Path, default=None, help="write a random model of --preset here and use it")
    p.add_argument("--preset", default="100m", choices=sorted(PRESETS), help="shape for --make-model")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--prompt-len", default="16:256", help="LO:HI, uniform")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--compare", default="", help="comma list of peers: transformers, vllm")
    p.add_argument("--vllm-python", default=None, help="python of a virtualenv with vllm (vllm-cpu on CPU)")
    p.add_argument("--vllm-dtypes", default=None,
                   help="comma list of dtypes to run vLLM in (default: jaxserve's), e.g. float32,bfloat16")
    p.add_argument("--hf-batch-sizes", default="8,16,48")
    p.add_argument("--probe-batches", default="1,32", help="decode probes at these batch sizes ('' to skip)")
    p.add_argument("--probe-context", type=int, default=256)
    p.add_argument("--dtypes", default=None,
                   help="comma list of dtypes to run in turn, each with its peers (default: --dtype alone)")
    p.add_argument("--profile", action="store_true",
                   help="split the step's time by layer kind from a profiled second run of the workload")
    p.add_argument("--api", choices=("engine", "generate"), default="engine",
                   help="drive the engine step by step, or go through LLM.generate with its phases timed")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --api generate: run the workload this many times (paired with vLLM's rounds)")
    add_engine_args(p)
    bench_results.add_arguments(p)
    args = p.parse_args()
    dtypes = (args.dtypes or args.dtype).split(",")
    if args.make_model:
        args.model = str(make_model(args.make_model, args.preset,
                                    "bfloat16" if dtypes == ["bfloat16"] else "float32"))
    if args.model is None:
        p.error("--model or --make-model is required")
    peers = [x for x in args.compare.split(",") if x]
    if "vllm" in peers and not args.vllm_python:
        p.error("--compare vllm needs --vllm-python")
    results = bench_results.Results(args)
    for dtype in dtypes:
        args.dtype = dtype
        print(f"=== {dtype} ===", flush=True)
        run_dtype(args, peers, results)
    results.save()


def run_dtype(args, peers: list[str], results: bench_results.Results) -> None:
    start = time.perf_counter()
    config = engine_config_from_args(args, max_model_len=args.max_model_len or None)
    if args.api == "generate":
        llm = LLM(config.model, **{f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                                   if f.name != "model"})
        engine = llm.engine
    else:
        engine = Engine(config)
    startup = time.perf_counter() - start
    cfg = engine.model_config
    w = workload(args, cfg.vocab_size)
    itemsize = engine.executor.runner.params["embed_tokens"]["embedding"].get_value().dtype.itemsize
    dev = jax.devices()[0]
    print(f"device {dev.platform} ({dev.device_kind}), {len(jax.devices())} devices; model {cfg.architecture} "
          f"{cfg.num_params / 1e6:.1f}M params, itemsize {itemsize}; start-up (load + warm-up) {startup:.1f}s")
    peak_flops, peak_bw = measure_peaks(engine.executor.runner.params["embed_tokens"]["embedding"].get_value().dtype)
    print(f"measured peaks: {peak_flops / 1e9:.0f} GFLOP/s matmul, {peak_bw / 1e9:.1f} GB/s memory")

    if args.api == "generate":
        llm.generate(w["prompts"][:2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
        if args.rounds > 1:
            with tempfile.TemporaryDirectory() as tmp:
                wpath = Path(tmp) / "workload.json"
                wpath.write_text(json.dumps(w))
                run_rounds(args, llm, w, wpath, results)
            engine.close()
            return
        res = run_generate(llm, w)
    else:
        res = run_jaxserve(engine, w)
    in_tok = sum(map(len, w["prompts"]))
    out_tps = res["output_tokens"] / res["seconds"]
    print(f"jaxserve: {len(w['prompts'])} requests in {res['seconds']:.2f}s = {len(w['prompts']) / res['seconds']:.2f} "
          f"req/s, {in_tok / res['seconds']:.0f} input tok/s, {out_tps:.1f} output tok/s, {res['steps']} steps, "
          f"mean step {1e3 * res['seconds'] / res['steps']:.1f} ms", flush=True)
    results.add(f"{args.dtype}: jaxserve output tok/s", out_tps, "tok/s")
    if "phases" in res:
        print(f"  phases: {format_phases(res)}", flush=True)
    if engine.spec is not None:  # speculative decoding's counters (jaxserve/spec_decode/planner.py)
        sp = engine.spec.counters.stats()
        print(f"  speculation: {sp['spec_proposed_tokens']} proposed, {sp['spec_accepted_tokens']} accepted "
              f"({sp['spec_acceptance_rate']:.0%}), {sp['spec_emitted_tokens']} emitted over "
              f"{sp['spec_verified_sequences']} verified sequence-steps ({sp['spec_mean_accepted_length']:.2f} "
              f"tokens each)")
    # Compute bound of the whole workload: every prompt's prefill plus every decode step's matmuls.
    flops = sum(prefill_cost(cfg, itemsize, len(pr)).flops for pr in w["prompts"])
    flops += sum(decode_cost(cfg, itemsize, 1, len(pr) + t).flops for pr in w["prompts"]
                 for t in range(w["output_len"] - 1))
    bound = flops / peak_flops
    print(f"  workload compute bound {bound:.2f}s -> {res['output_tokens'] / bound:.0f} output tok/s; "
          f"achieved {bound / res['seconds']:.0%} of it")

    for b in [int(x) for x in args.probe_batches.split(",") if x]:
        r = probe_decode(engine, b, args.probe_context)
        c = decode_cost(cfg, itemsize, b, args.probe_context)
        bw_bound = c.bytes / peak_bw
        print(f"decode batch {b} @ context {args.probe_context}: step {1e3 * r['step_s']:.2f} ms, compiled call "
              f"{1e3 * r['device_s']:.2f} ms, host overhead {max(0.0, 1 - r['device_s'] / r['step_s']):.0%}; "
              f"bandwidth bound {1e3 * bw_bound:.2f} ms ({bw_bound / r['step_s']:.0%} achieved), roofline "
              f"{1e3 * c.bound_seconds(peak_flops, peak_bw):.2f} ms")

    if args.profile:  # fresh prompts of the same lengths: the timed run's are in the prefix cache now
        rng = np.random.default_rng(args.seed + 1)
        fresh = dict(w, prompts=[rng.integers(3, cfg.vocab_size, len(p)).tolist() for p in w["prompts"]])
        with tempfile.TemporaryDirectory() as tmp:
            print_profile(profile_workload(engine, fresh, tmp), cfg.num_layers)
    engine.close()  # its memory back before the peers run
    del engine
    with tempfile.TemporaryDirectory() as tmp:
        wpath = Path(tmp) / "workload.json"
        wpath.write_text(json.dumps(w))
        if "transformers" in peers:
            runs = run_peer([sys.executable, str(HERE / "peers" / "hf_generate.py"), str(wpath), "--model",
                             args.model, "--batch-sizes", args.hf_batch_sizes, "--dtype",
                             "float32" if itemsize == 4 else "bfloat16", "--threads", str(os.cpu_count())])
            for r in runs:
                print(f"transformers batch {r['batch_size']}: {r['output_tokens'] / r['seconds']:.1f} output tok/s")
            if runs:
                best = max(r["output_tokens"] / r["seconds"] for r in runs)
                print(f"  jaxserve / transformers (best batch) = {out_tps / best:.2f}x")
                results.add(f"{args.dtype}: transformers output tok/s (best batch)", best, "tok/s")
                results.add(f"{args.dtype}: jaxserve / transformers (best batch)", out_tps / best, "x")
        if "vllm" in peers:
            env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
            dtypes = (args.vllm_dtypes or ("float32" if itemsize == 4 else "bfloat16")).split(",")
            for dtype in dtypes:
                runs = run_peer([args.vllm_python, str(HERE / "peers" / "vllm_generate.py"), str(wpath), "--model",
                                 args.model, "--dtype", dtype, "--max-num-seqs", str(args.max_num_seqs)], env)
                for r in runs:
                    tps = r["output_tokens"] / r["seconds"]
                    print(f"vllm {dtype}: {tps:.1f} output tok/s (start-up {r['startup_seconds']:.1f}s); "
                          f"jaxserve / vllm {dtype} = {out_tps / tps:.2f}x")
                    results.add(f"{args.dtype}: vLLM-CPU {dtype} output tok/s", tps, "tok/s")
                    results.add(f"{args.dtype}: jaxserve / vLLM-CPU {dtype}", out_tps / tps, "x")




if __name__ == "__main__":
    main()
