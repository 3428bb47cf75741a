"""Time pushing new weights into a running engine against reloading them, on a random ~100M Llama-shaped model.

    python scripts/bench_weight_push.py [--hidden 768 --layers 8 --heads 12 --kv-heads 4 --mlp 2048 --vocab 32000]
        [--repeats 5] [--workdir DIR]

Four ways the engine gets new weights, each timed until the new weights are on the device, ready for the next
step (a short greedy generate follows each push, untimed, so the engine really serves them):

- ``pytree``: ``llm.update_weights(params)`` with a pytree already on the devices, as a JAX trainer holds it;
- ``state dict``: ``llm.update_weights(state_dict)``, host NumPy arrays by Hugging Face names (as a PyTorch
  trainer would send them), copied to the devices;
- ``folder``: ``llm.update_weights(path)``, the safetensors checkpoint read from disk (the page cache warm);
- ``restart``: a new ``LLM`` on the checkpoint until it has answered the request (loading, and compiling the
  steps that request runs: what serving new weights costs without ``update_weights``); ``restart, load only``
  the same until the weights are loaded.

Each push is followed by a check that it compiled nothing (``CompileCounter``). Then ``llm.sleep(level)`` and
``wake_up()``: the bytes of live device arrays (``jax.live_arrays``, what the CPU backend can count; on an
accelerator ``memory_stats`` says the same) before, while asleep at each level, and after, with the time of each.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.executor.runner import CompileCounter  # noqa: E402
from jaxserve.models.demo import DEMO_CONFIG, byte_tokenizer, write_random_checkpoint  # noqa: E402
from scripts import bench_results  # noqa: E402
from jaxserve.models.loader import hf_name  # noqa: E402

OPTIONS = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, page_size=16,
               warmup=False, compilation_cache_dir=None)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
PROMPT = [[1, 2, 3, 4, 5, 6, 7, 8]]


def answer(llm: LLM) -> list[int]:
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--mlp", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workdir", type=Path, default=None)
    bench_results.add_arguments(p)
    args = p.parse_args()
    figures = bench_results.Results(args)

    cfg = dict(DEMO_CONFIG, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
               num_key_value_heads=args.kv_heads, intermediate_size=args.mlp, vocab_size=args.vocab,
               tie_word_embeddings=False)
    folder = (args.workdir or Path(tempfile.mkdtemp(prefix="jaxserve-bench-push-"))) / "model"
    write_random_checkpoint(folder, cfg)
    byte_tokenizer().save_pretrained(folder)
    llm = LLM(str(folder), **OPTIONS)
    answer(llm)  # compiles the steps this request runs
    generate = statistics.median(timed(lambda: answer(llm), args.repeats))
    params = llm.get_weights()
    nbytes = sum(a.nbytes for a in jax.tree.leaves(params))
    print(f"model: {llm.model_config.num_params / 1e6:.1f}M params, {nbytes / 2**20:.0f} MiB float32, "
          f"device {jax.devices()[0].platform}; a 4-token generate alone: {generate * 1000:.0f}ms")

    scaled = jax.jit(lambda p: jax.tree.map(lambda x: x * 1.001, p))(params)
    jax.block_until_ready(scaled)
    flat = dict(nnx.to_flat_state(llm.engine.executor.runner.params))
    state_dict = {hf_name(path, llm.model_config): np.asarray(v.get_value()).T if v.get_value().ndim == 2
                  and path[-1] == "weight" else np.asarray(v.get_value()) for path, v in flat.items()}

    runner = llm.engine.executor.runner

    def push(what):
        start = time.perf_counter()
        llm.update_weights(what)
        jax.block_until_ready(runner.params)
        took = time.perf_counter() - start
        answer(llm)  # served with the new weights (untimed)
        return took

    results = {}
    compiles = CompileCounter()
    for name, what in (("pytree", scaled), ("state dict", state_dict), ("folder", str(folder))):
        results[name] = [push(what) for _ in range(args.repeats)]
    pushed_compiles = compiles.count()

    def live() -> float:
        return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted()) / 2**20

    del params, scaled, state_dict, flat  # the benchmark's own references, not the engine's
    gc.collect()
    print(f"device memory (live arrays): awake {live():.0f} MiB")
    for level in (1, 2):
        start = time.perf_counter()
        llm.sleep(level=level)
        slept = time.perf_counter() - start
        asleep = live()
        start = time.perf_counter()
        llm.wake_up()
        woke = time.perf_counter() - start
        answer(llm)
        print(f"  sleep(level={level}) {slept * 1000:.0f}ms: {asleep:.0f} MiB; wake_up {woke * 1000:.0f}ms: "
              f"{live():.0f} MiB")
        figures.add(f"sleep(level={level})", slept * 1000, "ms")

    def restart(first_answer: bool):
        start = time.perf_counter()
        fresh = LLM(str(folder), **OPTIONS)
        if first_answer:
            answer(fresh)
        return time.perf_counter() - start

    results["restart, load only"] = [restart(False) for _ in range(max(1, args.repeats // 2))]
    results["restart"] = [restart(True) for _ in range(max(1, args.repeats // 2))]
    for name, times in results.items():
        print(f"{name:18s} median {statistics.median(times) * 1000:9.1f}ms  "
              f"({', '.join(f'{t * 1000:.1f}' for t in times)})")
        figures.add(f"{name}: median", statistics.median(times) * 1000, "ms")
    print(f"compilations during the pushes: {pushed_compiles}")
    figures.save()


if __name__ == "__main__":
    main()
