"""Speculative decoding against none, in one process, the configurations alternating round by round.

    python scripts/bench_spec.py --model /tmp/m100 --work DIR [--k 4 --rounds 3 --large-batch 48 --output-len 64]

``skip`` (batch 1, draft model): a ``--skip-layers``-layer target whose layers 3.. have zero ``o_proj`` and ``down_proj`` (the
residual passes through them unchanged) and a draft made of its first two layers, norm and head: the draft
predicts the target exactly, so every proposal is accepted, at a fraction of the target's cost. Both are written
into ``--work``. Then two workloads, each run on the same engine options with and without
``--speculative-config`` (n-gram):
``copy`` (batch 1): a prompt made of a random 16-token pattern repeated, then the greedy continuation; it reports
how much of that continuation the n-gram proposer gets right and the output tokens/s. ``large`` (batch
``--large-batch``, random prompts of 16..256 tokens): the compute-bound case, where the planner proposes nothing
(more decodes than ``disable_by_batch_size``), so speculation must cost nothing. Greedy, EOS ignored.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from jaxserve.config.engine import EngineConfig  # noqa: E402
from jaxserve.engine.engine import Engine  # noqa: E402
from jaxserve.models.demo import DEMO_CONFIG, byte_tokenizer, write_random_checkpoint  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from scripts import bench_results  # noqa: E402


def run(engine: Engine, prompts: list[list[int]], output_len: int) -> tuple[float, int, list[list[int]]]:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, params)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    seconds = time.perf_counter() - start
    tokens = [outs[f"q{i}"] for i in range(len(prompts))]
    return seconds, sum(map(len, tokens)), tokens


SKIP_TARGET = dict(DEMO_CONFIG, hidden_size=512, intermediate_size=1536, num_hidden_layers=24, num_attention_heads=8,
                   num_key_value_heads=4, vocab_size=8192, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def make_skip_models(work: Path, layers: int) -> tuple[Path, Path]:
    """The ``skip`` target (upper layers zeroed where they write the residual) and its two-layer draft."""
    from safetensors.numpy import load_file, save_file

    target, draft = work / f"skip_target{layers}", work / f"skip_draft{layers}"
    if not (draft / "config.json").exists():
        write_random_checkpoint(target, dict(SKIP_TARGET, num_hidden_layers=layers), seed=0, std=0.08)
        byte_tokenizer().save_pretrained(target)
        weights = load_file(str(target / "model.safetensors"))
        for name in weights:
            layer = name.split(".")[2] if name.startswith("model.layers.") else None
            if layer is not None and int(layer) >= 2 and name.endswith(("o_proj.weight", "down_proj.weight")):
                weights[name] = np.zeros_like(weights[name])
        save_file(weights, str(target / "model.safetensors"))
        kept = {n: w for n, w in weights.items() if not n.startswith("model.layers.") or int(n.split(".")[2]) < 2}
        draft.mkdir(parents=True, exist_ok=True)
        save_file(kept, str(draft / "model.safetensors"))
        (draft / "config.json").write_text(json.dumps(dict(SKIP_TARGET, num_hidden_layers=2)))
        byte_tokenizer().save_pretrained(draft)
    return target, draft


def skip_workload(args, figures: bench_results.Results) -> None:
    target, draft = make_skip_models(Path(args.work), args.skip_layers)
    base = dict(model=str(target), max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                skip_tokenizer_init=True, compilation_cache_dir=args.cache)
    spec = {"model": str(draft), "num_speculative_tokens": args.k}
    engines = {"none": Engine(EngineConfig(**base)), "draft": Engine(EngineConfig(**base, speculative_config=spec))}
    prompt = [np.random.default_rng(args.seed).integers(3, 8192, 32).tolist()]
    rates, outs = {}, {}
    for r in range(args.rounds):
        for mode in (["none", "draft"] if r % 2 == 0 else ["draft", "none"]):
            e = engines[mode]
            seconds, tokens, outs[mode] = run(e, prompt, args.copy_output_len)
            rates.setdefault(mode, []).append(tokens / seconds)
            extra = ""
            if e.spec is not None:
                c = e.spec.counters.stats()
                extra = (f"; cumulative acceptance {c['spec_acceptance_rate']:.0%}, "
                         f"{c['spec_mean_accepted_length']:.2f} tokens per verified step")
            print(f"round {r} skip  {mode:5s}: {tokens} tokens in {seconds:.2f}s = {tokens / seconds:.1f} output "
                  f"tok/s{extra}", flush=True)
    a, b = np.median(rates["none"]), np.median(rates["draft"])
    print(f"skip: none {a:.1f} tok/s, draft {b:.1f} tok/s (median of {args.rounds}) -> {b / a:.2f}x; outputs "
          f"identical: {outs['none'] == outs['draft']}", flush=True)
    figures.add(f"skip, {args.skip_layers}-layer target, draft k={args.k}: speculative / none, ratio of medians",
                b / a, "x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--large-batch", type=int, default=48)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--copy-output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="/tmp/bench_spec", help="where the skip workload's models are written")
    p.add_argument("--cache", default=None, help="compilation cache directory (start-up only)")
    p.add_argument("--only", default="skip,copy,large")
    p.add_argument("--skip-layers", type=int, default=24, help="layers of the skip target (the draft has 2)")
    bench_results.add_arguments(p)
    args = p.parse_args()
    figures = bench_results.Results(args)
    if "skip" in args.only:
        skip_workload(args, figures)
    if "copy" not in args.only and "large" not in args.only:
        figures.save()
        return
    base = dict(model=args.model, max_model_len=512, max_num_seqs=args.large_batch, max_num_batched_tokens=512,
                compilation_cache_dir=args.cache, num_pages=args.large_batch * 32 + 64)
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    t = time.perf_counter()
    engines = {"none": Engine(EngineConfig(**base)), "ngram": Engine(EngineConfig(**base, speculative_config=spec_cfg))}
    print(f"start-up of both engines {time.perf_counter() - t:.0f}s; speculative_config {json.dumps(spec_cfg)} "
          f"(disable_by_batch_size {engines['ngram'].spec.config.disable_by_batch_size})")
    rng = np.random.default_rng(args.seed)
    vocab = engines["none"].model_config.vocab_size
    copy = [rng.integers(3, vocab, 16).tolist() * 6]
    large = [rng.integers(3, vocab, int(n)).tolist() for n in rng.integers(16, 257, args.large_batch)]
    results: dict[tuple[str, str], list[float]] = {}
    outputs = {}
    for r in range(args.rounds):
        order = ["none", "ngram"] if r % 2 == 0 else ["ngram", "none"]
        for name, prompts, out_len in (("copy", copy, args.copy_output_len), ("large", large, args.output_len)):
            for mode in order:
                e = engines[mode]
                c0 = dict(e.spec.counters.stats()) if e.spec else None
                seconds, tokens, outs = run(e, prompts, out_len)
                results.setdefault((name, mode), []).append(tokens / seconds)
                outputs[(name, mode)] = outs
                extra = ""
                if c0 is not None:
                    c1 = e.spec.counters.stats()
                    prop = c1["spec_proposed_tokens"] - c0["spec_proposed_tokens"]
                    acc = c1["spec_accepted_tokens"] - c0["spec_accepted_tokens"]
                    ver = c1["spec_verified_sequences"] - c0["spec_verified_sequences"]
                    emit = c1["spec_emitted_tokens"] - c0["spec_emitted_tokens"]
                    extra = (f"; proposed {prop}, accepted {acc} ({acc / prop:.0%})" if prop else "; proposed 0")
                    extra += f", {emit / ver:.2f} tokens per verified step" if ver else ""
                print(f"round {r} {name:5s} {mode:5s}: {tokens} tokens in {seconds:.2f}s = {tokens / seconds:.1f} "
                      f"output tok/s{extra}", flush=True)
    for name in ("copy", "large"):
        same = outputs[(name, "none")] == outputs[(name, "ngram")]
        a, b = np.median(results[(name, "none")]), np.median(results[(name, "ngram")])
        print(f"{name}: none {a:.1f} tok/s, ngram {b:.1f} tok/s (median of {args.rounds}) -> {b / a:.2f}x; "
              f"outputs identical: {same}")
        figures.add(f"{name}, n-gram k={args.k}: speculative / none, ratio of medians", b / a, "x")
    figures.save()


if __name__ == "__main__":
    main()
