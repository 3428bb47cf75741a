"""Peer run: the workload through vLLM's offline ``LLM.generate`` (run with vLLM's own Python).

    VLLM_CPU_KVCACHE_SPACE=2 /path/to/vllm-venv/bin/python scripts/peers/vllm_generate.py WORKLOAD.json \
        --model M [--dtype float32] [--max-num-seqs 48] [--rounds 1] [--paced]

Token-id prompts and ``skip_tokenizer_init`` so no tokenizer is involved; the workload's ``params`` (if any) are
the requests' ``SamplingParams`` keywords. After a two-request warm-up, runs the workload ``--rounds`` times and
prints one JSON line per round: {"seconds", "output_tokens", "startup_seconds", "round"}. ``--paced`` (rounds
paired with another engine's, taking turns): first prints {"ready": true, "startup_seconds"}, then runs each
round when a line arrives on standard input (it stops at end of input).
"""

import argparse
import json
import sys
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("workload")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--paced", action="store_true", help="run each round when a line arrives on standard input")
    args = p.parse_args()
    from vllm import LLM, SamplingParams

    w = json.load(open(args.workload))
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, skip_tokenizer_init=True, max_num_seqs=args.max_num_seqs,
              max_model_len=w["max_model_len"], seed=0)
    startup = time.perf_counter() - start
    # The workload may carry its own sampling parameters (SamplingParams keywords); greedy by default.
    options = w.get("params") or dict(max_tokens=w["output_len"], ignore_eos=True, temperature=0.0)
    params = SamplingParams(**options, detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in w["prompts"]]
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0, detokenize=False))
    if args.paced:
        print(json.dumps({"ready": True, "startup_seconds": startup}), flush=True)
    for r in range(args.rounds):
        if args.paced and not sys.stdin.readline():
            break
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(json.dumps({"seconds": seconds, "output_tokens": tokens, "startup_seconds": startup, "round": r}),
              flush=True)


if __name__ == "__main__":
    main()
